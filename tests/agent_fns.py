"""--custom-agent-function-path agents for the tests (tests/unit/rollout/test_tito.py): each speaks OpenAI chat
to its TITO session with the real `openai` client."""

from __future__ import annotations

import asyncio
import json
import os

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
_OPENAI_KEYS = {"max_tokens", "temperature", "top_p", "seed", "stop"}


def _split(request_kwargs: dict) -> dict:
    """request_kwargs as openai's create() takes them: SGLang extras (top_k, stop_token_ids) in extra_body."""
    kw = {k: v for k, v in request_kwargs.items() if k in _OPENAI_KEYS}
    kw["extra_body"] = {k: v for k, v in request_kwargs.items() if k not in _OPENAI_KEYS}
    return kw


async def three_turns(base_url, prompt, request_kwargs, metadata, api_key=None, **kwargs):
    """Three model turns; after the first two a tool answers (whatever the model said)."""
    if metadata.get("prompt_id") == "crash":
        os._exit(3)  # the whole agent process dies
    if metadata.get("prompt_id") == "hang":
        await asyncio.sleep(3600)
    # imported here, not at the top: the crashing and the hung agent's processes (started beside this
    # one) then cost an interpreter start each, not openai's import too (~1 CPU-s), which under a full
    # `make test` kept this agent past its timeout
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key or os.environ["OPENAI_API_KEY"])
    messages = list(prompt)
    for turn in range(3):
        r = await client.chat.completions.create(
            model="default", messages=messages, tools=TOOLS, **_split(request_kwargs)
        )
        messages.append(r.choices[0].message.model_dump(exclude_none=True))  # replayed as given
        if turn < 2:
            messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": f"result {turn + 5}"})
    await client.close()
    return {"reward": 1.0, "agent_turns": 3, "seen_metadata": sorted(metadata)}


async def returns_a_list(base_url, prompt, request_kwargs, metadata, **kwargs):
    return [1, 2]


async def raises(base_url, prompt, request_kwargs, metadata, **kwargs):
    raise RuntimeError("sandbox down")


async def abort(args):
    """The optional teardown hook: records that it ran (tests/unit/rollout/test_tito.py)."""
    with open(os.environ["AGENT_FNS_ABORT_LOG"], "a") as f:
        f.write(json.dumps({"run": args.run_name}) + "\n")


async def grabs_the_engine(base_url, prompt, request_kwargs, metadata, api_key=None, **kwargs):
    """A hostile agent: with the key it was given it tries to swap the run's weights and pause the
    engines through the engine and the router, then chats as usual. Records what each call got."""
    import httpx

    key = api_key or os.environ["OPENAI_API_KEY"]
    h = {"Authorization": f"Bearer {key}"}
    tried = {}
    async with httpx.AsyncClient(timeout=30) as http:
        for name, url in (("engine", metadata["engine_url"]), ("router", metadata["router_url"])):
            for path, body in (("/update_weights_from_disk", {"model_path": "/tmp/x"}),
                               ("/pause_generation", {}), ("/continue_generation", {})):  # fmt: skip
                r = await http.post(f"{url}{path}", json=body, headers=h)
                tried[f"{name}{path}"] = r.status_code
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key)
    await client.chat.completions.create(model="default", messages=prompt, **_split(request_kwargs))
    await client.close()
    return {"tried": tried}
