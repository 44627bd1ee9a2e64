"""Agentic generate (Miles' generate_hub/agentic_tool_call.py): an OpenAI-speaking agent, one TITO
session per sample.

    --custom-generate-function-path miles.rollout.generate_hub.agentic_tool_call.generate
    --custom-agent-function-path my_pkg.agent.run_agent     # async (base_url, prompt, request_kwargs, metadata, **kw)
    --custom-agent-function-mode subproc|inline              # subproc: a child process per call (default)
    --custom-agent-function-timeout 600                      # seconds; a hung agent is stopped
    --use-session-server  [--tito-model qwen3] [--max-seq-len N]

Per sample: POST /sessions (evaluation, the sample's temperature / top_p / top_k), the agent runs
against `base_url` = <session server>/sessions/<id> (it posts `{base_url}/v1/chat/completions`),
then the Sample is assembled from the session record: prompt_tokens = the first turn's rendered
prompt, response_tokens = everything after it, model tokens with their engine log-probs (loss
mask 1), the tokens the server appended for tool / user messages with loss mask 0, log-prob 0 and
the singleton support under replay; `sample.turns` one entry per appended and per model turn.
The agent's dict joins the metadata (a `reward` in it becomes the sample's reward). An agent that
raises, crashes its process, runs past the timeout, returns something else than a dict or None,
or breaks the session's append-only history gives a `failed` sample (kept out of the loss) with
the reason in `metadata.agent_error` / `metadata.session_error`; other samples are untouched.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import os
import signal
import sys
import tempfile
from typing import Any

import httpx

from miles_platform.config import ConfigError
from miles_platform.config.rollout import template_kwargs
from miles_platform.data.sample import Sample, Status
from miles_platform.plugins import load_function, load_object
from miles_platform.rollout.base_types import GenerateFnInput, GenerateFnOutput
from miles_platform.rollout.generate_hub.endpoint import finish_status, truncate
from miles_platform.rollout.http_common import generate_key
from miles_platform.tls import client_tls

AGENT_FLAG = "--custom-agent-function-path"
# our sampling names -> ChatCompletionRequest's (Miles' build_chat_request_kwargs)
_KEY_MAP = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
_CHAT_KEYS = {
    "max_tokens",
    "min_tokens",
    "seed",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
}


def validate_args(args: Any) -> None:
    """Before any engine starts: the agent function imports, is async and takes the four arguments;
    an `abort` beside it is a function of one argument."""
    load_agent(args.custom_agent_function_path)


def load_agent(path: str):
    fn = load_function(path, AGENT_FLAG, required_params=4)
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(
            f"{AGENT_FLAG} {path!r}: must be `async def run_agent(base_url, prompt, request_kwargs, metadata, "
            "**kwargs) -> dict | None`"
        )
    module = path.rpartition(".")[0]
    abort = getattr(__import__(module, fromlist=["_"]), "abort", None)
    if abort is not None:
        load_function(f"{module}.abort", f"{AGENT_FLAG} (its module's abort hook)", required_params=1)
    return fn


def request_kwargs(sampling_params: dict[str, Any]) -> dict[str, Any]:
    out = {_KEY_MAP.get(k, k): v for k, v in sampling_params.items()}
    return {k: v for k, v in out.items() if k in _CHAT_KEYS and v is not None and v != []}


def prompt_messages(prompt: str, images: list[str] | None = None) -> list[dict[str, Any]]:
    """Sample.prompt as OpenAI messages: a messages list kept as JSON text by the data loader, or a
    plain prompt as one user message. With `images` (an image prompt: Sample.image_data) each
    image's vision tokens in the text (chat.IMAGE_TEXT, what the loader made of `<image>`) become
    an image_url part with that image, in order."""
    try:
        obj = json.loads(prompt)
    except (TypeError, ValueError):
        obj = None
    if isinstance(obj, list) and obj and all(isinstance(m, dict) and "role" in m for m in obj):
        messages = obj
    else:
        messages = [{"role": "user", "content": prompt}]
    return _image_parts(messages, list(images or []))


def _image_parts(messages: list[dict[str, Any]], images: list[str]) -> list[dict[str, Any]]:
    from miles_platform.rollout.chat import IMAGE_TEXT

    if not images:
        return messages
    out = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, str) and IMAGE_TEXT in c:
            parts: list[dict[str, Any]] = []
            for i, text in enumerate(c.split(IMAGE_TEXT)):
                if i:
                    parts.append({"type": "image_url", "image_url": {"url": images.pop(0)}})
                if text:
                    parts.append({"type": "text", "text": text})
            m = {**m, "content": parts}
        out.append(m)
    return out


async def generate(input: GenerateFnInput) -> GenerateFnOutput:
    a, state, sample = input.args, input.state, copy.deepcopy(input.sample)
    url, headers = (
        a.session_server_url,
        ({"Authorization": f"Bearer {state.api_key}"} if state.api_key else {}),
    )
    sp = input.sampling_params
    async with httpx.AsyncClient(timeout=60.0, headers=headers, verify=client_tls()) as http:
        r = await http.post(f"{url}/sessions", json={"evaluation": input.evaluation,
                            **{k: sp.get(k) for k in ("temperature", "top_p", "top_k")}})  # fmt: skip
        r.raise_for_status()
        sid = r.json()["session_id"]
        base_url = f"{url}/sessions/{sid}"
        metadata = {**sample.metadata, "session_id": sid, "max_seq_len": a.max_seq_len}
        kwargs = {"base_url": base_url, "prompt": prompt_messages(sample.prompt, sample.image_data),
                  "request_kwargs": request_kwargs(sp), "metadata": metadata}  # fmt: skip
        # the agent gets the run's generate-only key: it can chat, never swap weights or pause engines
        agent_key = generate_key(state.api_key) if state.api_key else None
        result, agent_error = await run_agent(a, kwargs, agent_key)
        r = await http.get(base_url)
        r.raise_for_status()
        record = r.json()
        await http.delete(base_url)
    sample = assemble(sample, record, state, kwargs["prompt"], a.max_seq_len)
    if agent_error is None and result is not None and not isinstance(result, dict):
        agent_error = f"{AGENT_FLAG} {a.custom_agent_function_path} returned a {type(result).__name__}, not a dict or None"
    if isinstance(result, dict) and agent_error is None:
        sample.metadata.update(result)
        if isinstance(result.get("reward"), int | float | dict) and not isinstance(
            result.get("reward"), bool
        ):
            sample.reward = result["reward"]
    if agent_error is not None:
        sample.status = Status.FAILED.value
        sample.metadata["agent_error"] = agent_error
    return GenerateFnOutput(samples=sample)


def assemble(
    sample: Sample, record: dict[str, Any], state: Any, messages: list, max_seq_len: int | None
) -> Sample:
    """The Sample of a session record (see the module docstring)."""
    tok = state.tokenizer
    prompt = record["prompt_token_ids"]
    if not prompt:  # no model call was made: the prompt as the first turn would have rendered it
        from miles_platform.rollout.tito import TitoTokenizer

        kw = template_kwargs(getattr(state.args, "apply_chat_template_kwargs", None))
        prompt = TitoTokenizer(tok, state.args.tito_model).first_prompt(messages, None, kw)[0]
    sample.prompt_tokens = list(prompt)
    sample.response_tokens = list(record["response_token_ids"])
    sample.rollout_log_probs = [float(x) for x in record["response_log_probs"]]
    sample.loss_mask = [int(x) for x in record["loss_mask"]]
    if state.sampling_support_replay and record.get("sampling_support") is not None:
        sample.rollout_sampling_support = [list(x) for x in record["sampling_support"]]
    if state.moe_shape is not None and record.get("routed_experts") is not None:  # R3
        from miles_platform.models.moe import decode_routes

        sample.rollout_routed_experts = decode_routes(record["routed_experts"], *state.moe_shape).tolist()
    sample.turns = record["turns"] or None
    if record.get("image_data") or sample.image_data:  # every image the session saw, in order
        sample.image_data = list(record.get("image_data") or sample.image_data)
    sample.weight_version_start = int(record["weight_version_start"])
    sample.weight_version_end = int(record["weight_version_end"])
    sample.response = tok.decode(sample.response_tokens, skip_special_tokens=True)
    calls = sum(len(t["tool_calls"]) for t in record["turns"] if t["role"] == "assistant")
    sample.metadata = {**sample.metadata, "turns": int(record["num_calls"]), "tool_call_count": calls}
    sample.status = finish_status(record["finish_reason"] or "stop")
    if record["failure"]:
        sample.status = Status.FAILED.value
        sample.metadata["session_error"] = record["failure"]
    if not sample.response_tokens:  # never an empty response: one masked end-of-turn token
        eot = tok.eos_token_id
        sample.response_tokens, sample.rollout_log_probs, sample.loss_mask = [eot], [0.0], [0]
        if state.sampling_support_replay:
            sample.rollout_sampling_support = [[eot]]
        if not record["failure"]:
            sample.status = Status.FAILED.value
            sample.metadata["session_error"] = "the agent made no chat completion request"
    if max_seq_len and len(sample.prompt_tokens) + len(sample.response_tokens) > max_seq_len:
        truncate(sample, max(1, max_seq_len - len(sample.prompt_tokens)), tok)
    return sample


# ---------------------------------------------------------------------------- running the agent
async def run_agent(a: Any, kwargs: dict[str, Any], api_key: str | None) -> tuple[Any, str | None]:
    """(the agent's return value, None) or (None, why it failed)."""
    path, timeout = a.custom_agent_function_path, a.custom_agent_function_timeout
    fn = load_agent(path)
    if api_key is not None and _takes(fn, "api_key"):
        kwargs = {**kwargs, "api_key": api_key}
    if a.custom_agent_function_mode == "inline":
        try:
            return await asyncio.wait_for(fn(**kwargs), timeout), None
        except TimeoutError:
            return None, f"the agent did not finish within --custom-agent-function-timeout {timeout} s"
        except Exception as e:
            return None, f"the agent raised {type(e).__name__}: {e}"
    return await _run_in_child(path, kwargs, timeout, api_key)


def _takes(fn, name: str) -> bool:
    params = inspect.signature(fn).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


async def _run_in_child(
    path: str, kwargs: dict, timeout: float, api_key: str | None
) -> tuple[Any, str | None]:
    with tempfile.TemporaryDirectory(prefix="agent-") as d:
        job, result = os.path.join(d, "job.json"), os.path.join(d, "result.json")
        with open(job, "w") as f:
            json.dump({"path": path, "kwargs": kwargs, "result": result}, f)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        env["OPENAI_BASE_URL"] = f"{kwargs['base_url']}/v1"  # AsyncOpenAI() reaches the session as is
        if api_key:
            env["OPENAI_API_KEY"] = api_key
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "miles_platform.rollout.agent_process", job,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True,
        )  # fmt: skip
        try:
            _, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            await _stop(proc)
            return (
                None,
                f"the agent did not finish within --custom-agent-function-timeout {timeout} s (stopped)",
            )
        except asyncio.CancelledError:
            await _stop(proc)
            raise
        if os.path.exists(result):
            with open(result) as f:
                out = json.load(f)
            return (out["result"], None) if out["ok"] else (None, f"the agent raised {out['error']}")
        tail = (err or b"").decode(errors="replace").strip().splitlines()[-3:]
        return None, f"the agent process exited with code {proc.returncode} and no result: {' | '.join(tail)}"


async def _stop(proc: asyncio.subprocess.Process, grace: float = 5.0) -> None:
    """SIGTERM (the agent's cleanup runs), then SIGKILL the process group after `grace` seconds."""
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), grace)
    except (ProcessLookupError, TimeoutError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()


async def call_abort_hook(args: Any) -> None:
    """The agent module's optional `abort(args)` (sync or async), called by the rollout when it
    cancels in-flight episodes. Errors are reported, never raised over the rollout's own."""
    path = args.custom_agent_function_path
    try:
        hook = load_object(f"{path.rpartition('.')[0]}.abort", AGENT_FLAG)
    except ConfigError:
        return
    try:
        out = hook(args)
        if inspect.isawaitable(out):
            await out
    except Exception as e:  # noqa: BLE001
        print(f"{AGENT_FLAG} {path}: abort hook raised {type(e).__name__}: {e}", file=sys.stderr)
