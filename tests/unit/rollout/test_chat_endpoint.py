"""OpenAI-compatible /v1/chat/completions and /v1/models (rollout/chat.py) with the real `openai`
client: on the embedded engine and through the router, with the run's bearer token; log-probs
and token ids equal a teacher-forced forward; tool calls parsed (qwen25) from a scripted core;
streamed token by token. The model here has a chat template of its own (a model with none or
only our generic one gets a 400: test_openai_completions.py)."""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future

import httpx
import openai
import pytest
import torch
from openai_streams import assert_streamed_while_generating, slow_steps, sse_events, text_of

from miles_platform.models.checkpoint import load_hf_checkpoint, load_tokenizer
from miles_platform.rollout.engine_server import create_app, serve_in_thread, start_engine_server
from miles_platform.rollout.router import start_router

KEY = "chat-secret"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 7+11?"}]
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
# a chat template of the model's own (the same layout as models/tokenizer.py's generic one)
OWN_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def chat_checkpoint(tiny_hf_checkpoint, tmp_path_factory):
    """The tiny checkpoint, its tokenizer given a chat template of its own."""
    path = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(tiny_hf_checkpoint, path)
    tok = load_tokenizer(path)
    tok.chat_template = OWN_TEMPLATE
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def fleet(chat_checkpoint):
    engine = start_engine_server(chat_checkpoint, api_key=KEY)
    router = start_router(worker_urls=[engine.url], api_key=KEY, worker_api_key=KEY)
    yield engine, router
    router.stop()
    engine.stop()


@pytest.fixture(scope="module")
def reference(chat_checkpoint):
    return load_hf_checkpoint(chat_checkpoint)


@pytest.mark.parametrize("via", ["engine", "router"])
def test_openai_client_gets_logprobs_and_token_ids_of_a_teacher_forced_forward(fleet, reference, via):
    engine, router = fleet
    model, tok = reference
    url = engine.url if via == "engine" else router.url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == [engine.core.model_path]
    r = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=5,
        logprobs=True, top_logprobs=3,
        extra_body={"return_token_ids": True, "return_prompt_token_ids": True, "return_meta_info": True},
    )  # fmt: skip
    c = r.choices[0].model_dump()
    prompt = tok.encode(tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True))
    assert c["prompt_token_ids"] == prompt and r.usage.prompt_tokens == len(prompt)
    ids = c["token_ids"]
    assert r.usage.completion_tokens == len(ids) and c["finish_reason"] in ("stop", "length")
    assert [t for _, t, _ in c["meta_info"]["output_token_logprobs"]] == ids
    with torch.no_grad():
        lp = torch.log_softmax(
            model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float(), -1
        )
    got = [x.logprob for x in r.choices[0].logprobs.content]
    assert torch.allclose(torch.tensor(got), lp.gather(1, torch.tensor(ids)[:, None])[:, 0], atol=1e-4)
    first = r.choices[0].logprobs.content[0]
    assert first.token == tok.decode([ids[0]]) and len(first.top_logprobs) == 3
    assert first.top_logprobs[0].logprob == pytest.approx(float(lp[0].max()), abs=1e-4)
    assert r.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)
    # the same seed answers the same; n=2 gives two choices in one batched request
    again = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=8, seed=5)
    assert again.choices[0].message.content == r.choices[0].message.content
    two = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=4, n=2, seed=1)
    assert [c.index for c in two.choices] == [0, 1] and two.usage.prompt_tokens == len(prompt)


def test_stream_bad_requests_and_auth(fleet):
    engine, router = fleet
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEY)
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=MESSAGES,
            max_tokens=4,
            seed=2,
            stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    full = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=4, seed=2)
    assert text == full.choices[0].message.content and chunks[-1].usage.completion_tokens == 4
    for kw, needle in [
        ({"messages": []}, "messages must be a non-empty list"),
        ({"frequency_penalty": 0.5}, "frequency_penalty=0.5 is not supported"),
        ({"tool_choice": "required", "tools": [ADD]}, "tool_choice='required'"),
        ({"max_tokens": 0}, "must be a positive integer"),
        ({"extra_body": {"bogus": 1}}, "unknown chat completion fields ['bogus']"),
        ({"messages": [_image_msg("data:image/png;base64,iVBORw0KGgo=")]}, "not a vision-language model"),
        ({"messages": [_image_msg("https://x.org/a.png")]}, "the embedded engine does not fetch URLs"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "type 'input_audio'"),
    ]:
        body = {"model": "default", "messages": MESSAGES, **kw}
        with pytest.raises(openai.BadRequestError, match=None) as e:
            client.chat.completions.create(**body)
        assert e.value.status_code == 400 and needle in str(e.value), (kw, str(e.value))
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{engine.url}/v1", api_key="wrong").models.list()


def _image_msg(url: str) -> dict:
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}],
    }


@pytest.mark.parametrize("via", ["engine", "router"])
def test_chat_streams_tokens_as_they_are_generated(fleet, via):
    """Content deltas arrive during generation; joined they are the unstreamed answer, log-probs too."""
    engine, router = fleet
    url = engine.url if via == "engine" else router.url
    body = {"messages": MESSAGES, "max_tokens": 60, "ignore_eos": True, "temperature": 0, "logprobs": True}
    with slow_steps(engine.core):
        events = sse_events(url, "/v1/chat/completions", {**body, "stream": True}, KEY)
    assert_streamed_while_generating(events, tokens=60)
    full = httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH).json()["choices"][0]
    assert "".join(text_of(e) for _, e in events) == full["message"]["content"]
    streamed = [x for _, e in events for c in e["choices"] for x in (c["logprobs"] or {}).get("content", [])]
    assert streamed == full["logprobs"]["content"] and len(streamed) == 60
    assert events[0][1]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1][1]["choices"][0]["finish_reason"] == "length"


class ScriptedCore:
    """An EngineCore stand-in for create_app: answers every prompt with `text` (tool-call markup)."""

    def __init__(self, tok, text: str):
        self.tokenizer, self.text, self.model_path, self.context_length = tok, text, "scripted", 512
        self.seen: list[dict] = []

    def submit_json(self, body, on_token=None):
        self.seen.append(body)
        ids = self.tokenizer.encode(self.text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        meta = {"id": "r1", "finish_reason": {"type": "stop", "matched": ids[-1]}, "weight_version": 4,
                "output_token_logprobs": [[-0.5, t, None] for t in ids]}  # fmt: skip
        f: Future = Future()
        f.set_result({"text": self.text, "output_ids": ids, "meta_info": meta})
        return [f], False


def test_tool_calls_are_parsed_with_qwen25_when_tools_are_given(reference):
    _, tok = reference
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    core = ScriptedCore(tok, text)
    srv = serve_in_thread(create_app(core, api_key=KEY), "127.0.0.1", 0, "scripted-chat")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY)
        r = client.chat.completions.create(model="m", messages=MESSAGES, tools=[ADD], max_tokens=30)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content == "Let me add."
        [call] = c.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
        assert call.id.startswith("call_") and r.metadata == {"weight_version": "4"}
        assert r.model == os.path.abspath("scripted")  # the served model, whatever the request named
        assert core.seen[-1]["sampling_params"]["max_new_tokens"] == 30
        # without tools (or tool_choice none) the markup stays text
        r = client.chat.completions.create(model="m", messages=MESSAGES, tools=[ADD], tool_choice="none")
        assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == text
        assert r.choices[0].message.tool_calls is None
        # the assistant's tool call replayed in history renders (arguments as JSON text)
        hist = MESSAGES + [c.message.model_dump(exclude_none=True), {"role": "tool", "content": "5"}]
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": hist},
                       headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
        assert r.status_code == 200, r.text
        assert tok.decode(core.seen[-1]["input_ids"]).endswith(
            "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
        )
        # streamed: the content, then the parsed calls with the finish chunk's tool_calls reason
        chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, tools=[ADD], stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Let me add."
        [call] = [t for ch in chunks for t in ch.choices[0].delta.tool_calls or []]
        assert call.function.name == "add" and chunks[-1].choices[0].finish_reason == "tool_calls"
    finally:
        srv.stop()
