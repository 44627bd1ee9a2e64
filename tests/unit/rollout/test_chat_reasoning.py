"""SGLang's `--reasoning-parser` / `--tool-call-parser` on the embedded engine's /v1/chat/completions
(rollout/reasoning.py, chat.py, openai_api.py): the thinking goes to `message.reasoning_content`, the
tool calls (the named parser's format) to `message.tool_calls` with finish_reason `tool_calls`, as
SGLang's serving_chat builds them; streamed as `reasoning_content` deltas; names checked before
anything starts (and every --sglang-* flag refused where no started engine would take it)."""

from __future__ import annotations

import json
from concurrent.futures import Future
from types import SimpleNamespace

import openai
import pytest

from miles_platform.config import ConfigError, RunConfig
from miles_platform.models.checkpoint import load_tokenizer
from miles_platform.preflight import _check_sglang_args_have_an_engine
from miles_platform.rollout import chat
from miles_platform.rollout.engine_fleet import embedded_chat_parsers
from miles_platform.rollout.engine_server import create_app, serve_in_thread
from miles_platform.rollout.openai_api import ChoiceText
from miles_platform.rollout.reasoning import force_reasoning, split_reasoning, template_forces_reasoning

KEY = "reasoning-secret"
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}  # fmt: skip
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]
THOUGHT = "I add 2 and 3 with the tool."
CALL = "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>"


def test_split_as_sglangs_detectors():
    # qwen3: forced (thinking by default) or opened by the tag; closed by </think> or a tool call
    assert split_reasoning("<think>a b</think>\n\nAnswer", "qwen3", False) == ("a b", "\n\nAnswer")
    assert split_reasoning("a b</think>Answer", "qwen3", True) == ("a b", "Answer")
    assert split_reasoning("Answer", "qwen3", False) == ("", "Answer")
    assert split_reasoning("still thinking", "qwen3", True) == ("still thinking", "")
    assert split_reasoning("<think>x<tool_call>{}", "qwen3", False) == ("x", "<tool_call>{}")
    # deepseek-r1 always starts inside; kimi never does and has its own tags
    assert split_reasoning("a</think>b", "deepseek-r1", False) == ("a", "b")
    assert split_reasoning("◁think▷a◁/think▷b", "kimi", True) == ("a", "b")
    assert split_reasoning("a◁/think▷b", "kimi", True) == ("", "a◁/think▷b")
    assert split_reasoning("<think>a</think>b", "glm45", False) == ("a", "b")
    # who forces: the request's template kwargs by parser, or the template itself
    assert force_reasoning("qwen3", None, {}) and not force_reasoning(
        "qwen3", None, {"enable_thinking": False}
    )
    assert not force_reasoning("deepseek-v3", None, {}) and force_reasoning(
        "deepseek-v3", None, {"thinking": True}
    )
    assert force_reasoning("deepseek-r1", None, {"enable_thinking": False})
    assert template_forces_reasoning("{{'<|im_start|>assistant\\n<think>\\n'}}")
    assert not template_forces_reasoning(
        "{%- set t = enable_thinking | default(false) %}<|im_start|>assistant\\n<think>\\n"
    )


def test_flags_checked_before_anything_starts():
    ok = RunConfig(sglang_args={"reasoning-parser": "qwen3", "tool-call-parser": "qwen3_coder"})
    assert embedded_chat_parsers(ok) == {"tool_call_parser": "qwen3_coder", "reasoning_parser": "qwen3"}
    with pytest.raises(ConfigError, match="--sglang-reasoning-parser 'gpt-oss'.*built:"):
        embedded_chat_parsers(RunConfig(sglang_args={"reasoning-parser": "gpt-oss"}))
    with pytest.raises(ConfigError, match="--sglang-tool-call-parser 'llama3'.*built:"):
        embedded_chat_parsers(RunConfig(sglang_args={"tool-call-parser": "llama3"}))
    # attached engines and engine-less runs would drop any --sglang-* flag: refused
    with pytest.raises(ConfigError, match="--sglang-reasoning-parser .*attached, not started"):
        _check_sglang_args_have_an_engine(RunConfig(sglang_args={"reasoning-parser": "qwen3"},
                                                    rollout_external_engine_addrs=["h:1"]))  # fmt: skip
    with pytest.raises(ConfigError, match="--sglang-mem-fraction-static .*start no rollout engine"):
        _check_sglang_args_have_an_engine(RunConfig(sglang_args={"mem-fraction-static": "0.5"},
                                                    debug_train_only=True))  # fmt: skip
    _check_sglang_args_have_an_engine(ok)


class StreamingCore:
    """An EngineCore stand-in for create_app: answers with `text`, token by token (on_token)."""

    def __init__(self, tok, text: str):
        self.tokenizer, self.text, self.model_path, self.context_length = tok, text, "scripted", 512

    def submit_json(self, body, on_token=None):
        ids = self.tokenizer.encode(self.text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        if on_token is not None:
            for k in range(1, len(ids) + 1):
                on_token(
                    0,
                    SimpleNamespace(
                        output_ids=ids[:k], logprobs=[-0.5] * k, lp_opts=SimpleNamespace(top_k=0)
                    ),
                )
        meta = {"id": "r1", "finish_reason": {"type": "stop", "matched": ids[-1]}, "weight_version": 1,
                "output_token_logprobs": [[-0.5, t, None] for t in ids]}  # fmt: skip
        f: Future = Future()
        f.set_result({"text": self.text, "output_ids": ids, "meta_info": meta})
        return [f], False


@pytest.fixture(scope="module")
def tok(tiny_hf_checkpoint):
    t = load_tokenizer(tiny_hf_checkpoint)
    t.chat_template = TEMPLATE
    return t


def test_chat_route_splits_reasoning_and_tool_calls_like_sglang(tok):
    core = StreamingCore(tok, f"<think>{THOUGHT}</think>\n\nLet me add.\n{CALL}")
    app = create_app(core, api_key=KEY, tool_call_parser="qwen3_coder", reasoning_parser="qwen3")
    srv = serve_in_thread(app, "127.0.0.1", 0, "reasoning-chat")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY)
        c = client.chat.completions.create(model="m", messages=MESSAGES, tools=[ADD]).choices[0]
        assert c.message.model_extra["reasoning_content"] == THOUGHT
        assert c.message.content == "Let me add." and c.finish_reason == "tool_calls"
        [call] = c.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
        # separate_reasoning false: no split (the thinking stays content); no tools: the markup too
        c = client.chat.completions.create(
            model="m", messages=MESSAGES, extra_body={"separate_reasoning": False}
        )
        assert (
            c.choices[0].message.content == core.text
            and not c.choices[0].message.model_extra["reasoning_content"]
        )
        # streamed: the thinking as reasoning_content deltas, then the content, then the calls
        chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, tools=[ADD], stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        thought = [
            d.model_extra.get("reasoning_content") for d in deltas if d.model_extra.get("reasoning_content")
        ]
        assert "".join(thought) == THOUGHT  # never a tag in it (deltas as tokens come: the test below)
        assert "".join(d.content or "" for d in deltas) == "Let me add."
        [call] = [t for d in deltas for t in d.tool_calls or []]
        assert call.function.name == "add" and chunks[-1].choices[0].finish_reason == "tool_calls"
    finally:
        srv.stop()


def test_stream_reasoning_false_sends_the_thinking_once_closed(tok):
    text = f"{THOUGHT}</think>42"
    ids = tok.encode(text, add_special_tokens=False)
    req = chat.parse_request({"messages": MESSAGES, "stream_reasoning": False})
    for stream_reasoning, pieces in ((True, len(ids) // 2), (False, 1)):
        ct = ChoiceText(tok, reasoning=chat.Reasoning("qwen3", True), stream_reasoning=stream_reasoning)
        got = [ct.grow([t]) for t in ids]
        thought = [r for r, _ in got if r]
        assert "".join(thought) == THOUGHT and "".join(c for _, c in got) == "42"
        assert len(thought) >= pieces if stream_reasoning else len(thought) == 1
        assert ct.finish("42", THOUGHT) == ("", "")
    assert req.stream_reasoning is False and req.separate_reasoning is True
