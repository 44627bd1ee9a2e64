"""OpenAI-compatible chat completions over SGLang's `/generate` (SGLang's serving_chat, for the
embedded engine and the TITO session server). Pure functions; openai_api.py and sessions.py route
(and stream), completions.py reuses the field checks (`check_fields`, `sampling_params`).

    body --parse_request--> ChatRequest --render_prompt--> input_ids --generate_body--> /generate body
    /generate answers --build_response--> chat.completion (or sse_chunks on the session server)

`render_prompt` refuses a model that learned no chat template (none, or our generic one: the task
models train on raw prompts) with a 400 that points to /v1/completions: rendering messages in a
layout the model never saw makes it answer nonsense where /generate on the raw prompt answers right.

Field names follow SGLang's ChatCompletionRequest / ChatCompletionResponse
(python/sglang/srt/entrypoints/openai/protocol.py): `max_completion_tokens` (or `max_tokens`),
`temperature`, `top_p`, `top_k`, `min_p`, `n`, `stop`, `stop_token_ids`, `seed`, `logprobs`,
`top_logprobs`, `tools`, `tool_choice`, `stream`, `return_meta_info` (the /generate `meta_info`
per choice), `return_token_ids` / `return_prompt_token_ids`, `chat_template_kwargs`. Tool calls
are read from the text with the qwen25 parser (SGLang's `--tool-call-parser qwen25`) when `tools`
are given and `tool_choice` is not "none". What the embedded engine cannot do (penalties,
constrained decoding, `tool_choice` required/named, audio / video parts, image URLs to fetch) is a
400 naming the field.

Image parts (`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`, OpenAI's
and SGLang's shape) render as Qwen-VL's `<|vision_start|><|image_pad|><|vision_end|>` where they
stand, and go to `/generate` as SGLang's `image_data` in message order (`image_uris`); the engine
expands each pad to its image's patch count (rollout/engine_vlm.py) and refuses them on a text model.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from miles_platform.data.images import parts_text
from miles_platform.models.tokenizer import has_learned_chat_template
from miles_platform.models.vlm import IMAGE_PAD, VISION_END, VISION_START
from miles_platform.rollout.generate_hub.tool_call import CALL_START, TOOL_CALL_PARSERS
from miles_platform.rollout.reasoning import force_reasoning, split_reasoning

ROLES = ("system", "developer", "user", "assistant", "tool")
# accepted and without effect here (OpenAI bookkeeping, SGLang routing hints)
IGNORED = {
    "model", "user", "parallel_tool_calls", "stream_options", "store", "metadata", "service_tier", "rid", "extra_key", "cache_salt", "priority",
    "routed_dp_rank", "data_parallel_rank",
}  # fmt: skip
# SGLang fields the embedded engine does not implement: a 400 unless left at the default (or harmless)
UNSUPPORTED = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": None,
    "response_format": None, "regex": None, "ebnf": None, "json_schema": None, "stop_regex": None,
    "min_tokens": 0, "continue_final_message": False, "return_hidden_states": False,
    "return_routed_experts": False, "reasoning_effort": None, "custom_logit_processor": None,
    "custom_params": None, "session_params": None, "session_id": None, "return_cached_tokens_details": False,
    "logprob_start_len": None, "routed_experts_start_len": 0,
}  # fmt: skip
_HARMLESS = {"response_format": ({"type": "text"},), "best_of": (1,)}  # what a default means too
# the /generate sampling params of both OpenAI routes (`sampling_params`), and the fields both take
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed",
                   "ignore_eos", "skip_special_tokens", "no_stop_trim")  # fmt: skip
COMMON_FIELDS = {*SAMPLING_FIELDS, "n", "stream", "lora_path", *IGNORED, *UNSUPPORTED}
_FLAGS = ("logprobs", "stream", "return_meta_info", "return_token_ids", "return_prompt_token_ids",
          "ignore_eos", "no_stop_trim", "separate_reasoning", "stream_reasoning")  # fmt: skip
_KNOWN = {"messages", "tools", "tool_choice", "max_completion_tokens", "top_logprobs", "chat_template_kwargs",
          "input_ids", *_FLAGS, *COMMON_FIELDS}  # fmt: skip
MAX_N = 64
# what an image part renders as (Qwen-VL's chat templates, SGLang's placeholder): one pad per image
IMAGE_TEXT = f"{VISION_START}{IMAGE_PAD}{VISION_END}"
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


class ChatError(ValueError):
    """A bad OpenAI request (chat or completion): HTTP 400 with this message."""


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]  # as sent (the session server compares these)
    model: str = "default"
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = "auto"
    sampling_params: dict[str, Any] = field(default_factory=dict)  # SGLang names; max_new_tokens may be None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    return_meta_info: bool = False
    return_token_ids: bool = False
    return_prompt_token_ids: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    lora_path: str | None = None
    input_ids: list[int] | None = None  # SGLang: pre-tokenized prompt, bypasses the template
    separate_reasoning: bool = True  # SGLang's: with a reasoning parser, thinking -> reasoning_content
    stream_reasoning: bool = True  # SGLang's: stream the thinking as it comes (False: once it closed)

    @property
    def parses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def check_fields(body: Any, known: set[str], unsupported: dict[str, Any], flags: tuple[str, ...],
                 what: str, schema: str) -> None:  # fmt: skip
    """What every OpenAI route checks first: a JSON object, no unknown field, no field the engine
    cannot honour (all of them named in one 400), flags as booleans."""
    if not isinstance(body, dict):
        raise ChatError("request body must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        raise ChatError(f"unknown {what} fields {unknown}; see SGLang's {schema}")
    bad = [
        f"{k}={body[k]!r}"
        for k, default in unsupported.items()
        if body.get(k) is not None and body[k] != default and body[k] not in _HARMLESS.get(k, ())
    ]
    if bad:
        one = len(bad) == 1
        raise ChatError(
            f"{', '.join(bad)} {'is' if one else 'are'} not supported by the embedded engine "
            f"(leave {'it' if one else 'them'} unset)"
        )
    for k in flags:
        if body.get(k) is not None and not isinstance(body[k], bool):
            raise ChatError(f"{k} must be true or false, got {body[k]!r}")


def parse_request(body: Any) -> ChatRequest:
    """Validate a /v1/chat/completions body into a ChatRequest; ChatError (400) names the field."""
    check_fields(body, _KNOWN, UNSUPPORTED, _FLAGS, "chat completion", "ChatCompletionRequest")
    req = ChatRequest(messages=_messages(body.get("messages")), model=str(body.get("model") or "default"))
    req.tools = _tools(body.get("tools"))
    req.tool_choice = _tool_choice(body.get("tool_choice"), req.tools)
    req.sampling_params = sampling_params(body)
    req.n = int_field(body, "n", 1, 1, MAX_N)
    req.logprobs = bool(body.get("logprobs"))
    req.top_logprobs = int_field(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if req.top_logprobs and not req.logprobs:
        raise ChatError("top_logprobs needs logprobs=true")
    req.stream, req.include_usage = bool(body.get("stream")), include_usage(body)
    for k in ("return_meta_info", "return_token_ids", "return_prompt_token_ids"):
        setattr(req, k, bool(body.get(k)))
    for k in ("separate_reasoning", "stream_reasoning"):
        setattr(req, k, body.get(k) is not False)
    kw = body.get("chat_template_kwargs")
    if kw is not None and not isinstance(kw, dict):
        raise ChatError("chat_template_kwargs must be an object")
    req.chat_template_kwargs = dict(kw or {})
    req.lora_path = lora_field(body)
    ids = body.get("input_ids")
    if ids is not None and (not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids)):
        raise ChatError("input_ids must be a non-empty list of token ids")
    req.input_ids = ids
    return req


def lora_field(body: dict) -> str | None:
    lora = body.get("lora_path")
    if lora is not None and not isinstance(lora, str):
        raise ChatError("lora_path must be an adapter name (a string)")
    return lora


def include_usage(body: dict) -> bool:
    opts = body.get("stream_options") or {}
    return bool(isinstance(opts, dict) and opts.get("include_usage"))


def int_field(body: dict, key: str, default: int, lo: int, hi: int | None = None) -> int:
    v = body.get(key)
    if v is None:
        return default
    if type(v) is not int or v < lo or (hi is not None and v > hi):
        raise ChatError(f"{key}={v!r}: must be an integer in [{lo}, {hi if hi is not None else 'inf'}]")
    return v


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ChatError(f"messages[{i}]: needs a role in {list(ROLES)}, got {m!r:.80}")
        c = m.get("content")
        if c is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise ChatError(f"messages[{i}] ({m['role']}): content is required")
        if isinstance(c, list):
            for j, p in enumerate(c):
                _content_part(p, f"messages[{i}].content[{j}]")
        elif c is not None and not isinstance(c, str):
            raise ChatError(f"messages[{i}]: content must be a string or a list of text / image_url parts")
        if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
            raise ChatError(f"messages[{i}].tool_calls must be a list")
        for j, call in enumerate(m.get("tool_calls") or []):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ChatError(f"messages[{i}].tool_calls[{j}]: needs function.name and function.arguments")
    return messages


def _content_part(p: Any, where: str) -> None:
    kind = p.get("type") if isinstance(p, dict) else None
    if kind == "text":
        return
    if kind != "image_url":
        raise ChatError(
            f"{where}: type {kind!r}: only text and image_url parts are supported (no audio, video)"
        )
    url = p.get("image_url")
    url = url.get("url") if isinstance(url, dict) else None
    if not isinstance(url, str) or not url:
        raise ChatError(f'{where}: an image_url part is {{"type": "image_url", "image_url": {{"url": ...}}}}')
    if url.split(":", 1)[0].lower() in ("http", "https"):
        raise ChatError(
            f"{where}: image URL {url[:60]!r}: the embedded engine does not fetch URLs; send the image "
            "as a data:image/...;base64 URI"
        )


def check_content_parts(parts: Any, where: str) -> None:
    """A list of text / image_url parts (a message's content, a tool's answer); ChatError else."""
    if not isinstance(parts, list):
        raise ChatError(f"{where}: a list of content parts, got {type(parts).__name__}")
    for j, p in enumerate(parts):
        _content_part(p, f"{where}[{j}]")


def image_uris(messages: list[dict[str, Any]]) -> list[str]:
    """The image parts' URLs (data URIs, base64 or paths), in message order: the request's image_data."""
    return [
        p["image_url"]["url"]
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if isinstance(p, dict) and p.get("type") == "image_url"
    ]


def content_text(parts: list[dict[str, Any]]) -> str:
    """A list content as template text: text parts joined by spaces, each image part `IMAGE_TEXT`."""
    return parts_text(parts, IMAGE_TEXT)


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatError("tools must be a list of {type: function, function: {name, parameters}}")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatError(f"tools[{i}]: expected {{type: function, function: {{name, parameters}}}}")
        if t.get("type", "function") != "function":
            raise ChatError(f"tools[{i}]: type {t.get('type')!r}; only function tools are supported")
    return tools or None


def _tool_choice(choice: Any, tools: list | None) -> Any:
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none"):
        return choice
    raise ChatError(
        f"tool_choice={choice!r}: only 'auto' and 'none' are supported (required / a named function "
        "need constrained decoding, which the embedded engine does not implement)"
    )


def sampling_params(body: dict, default_max_tokens: int | None = None) -> dict[str, Any]:
    """SGLang's to_sampling_params: max_completion_tokens or max_tokens -> max_new_tokens, seed ->
    sampling_seed; unset values are left out (the engine's defaults) except max_new_tokens
    (`default_max_tokens`; None: up to the context length)."""
    max_new = body.get("max_completion_tokens")
    max_new = body.get("max_tokens") if max_new is None else max_new
    max_new = default_max_tokens if max_new is None else max_new
    if max_new is not None and (type(max_new) is not int or max_new <= 0):
        raise ChatError(f"max_tokens / max_completion_tokens={max_new!r}: must be a positive integer")
    sp: dict[str, Any] = {"max_new_tokens": max_new}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                     ("min_p", "min_p"), ("stop_token_ids", "stop_token_ids"), ("seed", "sampling_seed"),
                     ("ignore_eos", "ignore_eos"), ("skip_special_tokens", "skip_special_tokens"),
                     ("no_stop_trim", "no_stop_trim")):  # fmt: skip
        if body.get(src) is not None:
            sp[dst] = body[src]
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ChatError(f"stop={body['stop']!r}: must be a non-empty string or a list of them")
        sp["stop"] = stop
    if sp.get("sampling_seed") is not None and type(sp["sampling_seed"]) is not int:
        raise ChatError(f"seed={sp['sampling_seed']!r}: must be an integer")
    return sp


# ---------------------------------------------------------------------------- prompt
def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them (SGLang's normalization): text parts joined and image
    parts as `IMAGE_TEXT` (`content_text`), tool-call arguments as objects, content None as ""."""
    out = []
    for m in messages:
        m = copy.deepcopy(m)
        if isinstance(m.get("content"), list):
            m["content"] = content_text(m["content"])
        if m.get("content") is None:
            m["content"] = ""
        for call in m.get("tool_calls") or []:
            args = call.get("function", {}).get("arguments")
            if isinstance(args, str):
                try:
                    call["function"]["arguments"] = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise ChatError(f"tool call arguments {args!r:.80} are not valid JSON") from None
        out.append(m)
    return out


def render_text(tokenizer: Any, messages: list[dict[str, Any]], tools: list | None, kwargs: dict,
                add_generation_prompt: bool) -> str:  # fmt: skip
    """The served tokenizer's chat template over `messages` (and `tools`), as text."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatError("the served tokenizer has no chat template; use /generate with input_ids")
    try:
        return tokenizer.apply_chat_template(
            template_messages(messages), tools=tools, tokenize=False,
            add_generation_prompt=add_generation_prompt, **kwargs,
        )  # fmt: skip
    except ChatError:
        raise
    except Exception as e:  # jinja errors: a message shape the template does not take
        raise ChatError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from e


def max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes one token of the vocabulary spells (added tokens included), cached on
    the tokenizer: a text of B bytes is at least B / this many tokens."""
    cached = getattr(tokenizer, "_miles_max_token_bytes", None)
    if cached is None:
        vocab = tokenizer.get_vocab()
        cached = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1) or 1
        try:
            tokenizer._miles_max_token_bytes = cached
        except AttributeError:
            pass
    return cached


def content_bytes(messages: list[dict[str, Any]], tools: list | None = None) -> int:
    """UTF-8 bytes of the text a chat template renders from `messages` (and the tool schemas)."""
    n = 0
    for m in messages:
        c = m.get("content")
        parts = [c] if isinstance(c, str) else [p.get("text") for p in c or [] if isinstance(p, dict)]
        n += sum(len(p.encode("utf-8", "surrogatepass")) for p in parts if isinstance(p, str))
        for call in m.get("tool_calls") or []:
            n += len(json.dumps(call, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if tools:
        n += len(json.dumps(tools, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return n


def check_fits(tokenizer: Any, messages: list[dict[str, Any]], tools: list | None, budget: int,
               what: str = "the request") -> None:  # fmt: skip
    """Refuse, before any tokenization, messages that cannot fit in `budget` tokens: their bytes
    divided by the vocabulary's longest token is a lower bound on their token count. Rendering and
    tokenizing megabytes of text only to refuse them stalled the server (issue #49, item 9)."""
    least = -(-content_bytes(messages, tools) // max_token_bytes(tokenizer))
    if least > budget:
        raise ChatError(
            f"{what} is at least {least} tokens long: over the {budget} tokens left in the context "
            "(--max-seq-len / the model's context length); shorten the messages"
        )


def render_prompt(tokenizer: Any, req: ChatRequest) -> list[int]:
    """The prompt's token ids: `input_ids` as given, else the chat template with the generation
    prompt. A model that learned no chat template (none, or our generic one: models/tokenizer.py)
    is refused: rendering messages it never saw makes it answer nonsense."""
    if req.input_ids is not None:
        return list(req.input_ids)
    if not has_learned_chat_template(tokenizer):
        kind = "no chat template" if not getattr(tokenizer, "chat_template", None) else (
            "only miles-platform's generic chat template, which its training prompts never used"
        )  # fmt: skip
        raise ChatError(
            f'the served model has {kind}: POST the raw prompt (e.g. "18+25=") to /v1/completions, '
            "or token ids as input_ids here"
        )
    text = render_text(tokenizer, req.messages, req.tools, req.chat_template_kwargs, True)
    return tokenizer.encode(text, add_special_tokens=False)


def generate_body(req: ChatRequest, input_ids: list[int], context_length: int) -> dict[str, Any]:
    """The /generate body for the request's n choices (SGLang's batch form when n > 1; each choice
    its own seed, so seeded choices differ and stay reproducible)."""
    sp = dict(req.sampling_params)
    if sp.get("max_new_tokens") is None:
        sp["max_new_tokens"] = max(0, context_length - len(input_ids))
    body: dict[str, Any] = {"return_logprob": True}
    images = image_uris(req.messages)
    if images:  # SGLang's image_data: one prompt's images, or one list per choice of a batch
        body["image_data"] = images if req.n == 1 else [images] * req.n
    if req.top_logprobs:
        body["top_logprobs_num"] = req.top_logprobs
    if req.lora_path is not None:
        body["lora_path"] = req.lora_path
    if req.n == 1:
        return {**body, "input_ids": list(input_ids), "sampling_params": sp}
    seed = sp.get("sampling_seed")
    sps = [{**sp, "sampling_seed": None if seed is None else seed + i} for i in range(req.n)]
    return {**body, "input_ids": [list(input_ids)] * req.n, "sampling_params": sps}


# ---------------------------------------------------------------------------- response
def parse_tool_calls(
    text: str, tools: list[dict[str, Any]], parser: str = "qwen25"
) -> tuple[str, list[dict[str, Any]]]:
    """`parser` (SGLang's names; the session server: its --tito-model's, as Miles binds them): the
    text before the first call's opening tag is the content; each parsed call a tool call."""
    calls = TOOL_CALL_PARSERS[parser](tools)(text)
    if not calls:
        return text, []
    content = text[: text.find(CALL_START[parser])].strip()
    return content, [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "index": i, "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
        for i, c in enumerate(calls)
    ]  # fmt: skip


@dataclass(frozen=True)
class Reasoning:
    """A request's reasoning split (`--sglang-reasoning-parser`): the parser, and whether the
    answer starts inside the thinking block (rollout/reasoning.py `force_reasoning`)."""

    parser: str
    force: bool


def request_reasoning(req: ChatRequest, parser: str | None, tokenizer: Any) -> Reasoning | None:
    """SGLang's serving_chat: with a reasoning parser and `separate_reasoning` (default true) the
    thinking is split off; forced by the chat template or the request's template kwargs."""
    if not parser or not req.separate_reasoning:
        return None
    template = getattr(tokenizer, "chat_template", None)
    return Reasoning(parser, force_reasoning(parser, template if isinstance(template, str) else None,
                                             req.chat_template_kwargs))  # fmt: skip


def split_answer(req: ChatRequest, text: str, reasoning: Reasoning | None) -> tuple[str, str]:
    """(reasoning_content, the rest) of an answer's text, SGLang's `force_nonempty_content` template
    kwarg included (an answer with no content after its thinking: the thinking is the content)."""
    if reasoning is None:
        return "", text
    thought, text = split_reasoning(text, reasoning.parser, reasoning.force)
    if req.chat_template_kwargs.get("force_nonempty_content") is True and not text:
        thought, text = text, thought
    return thought, text


def assistant_message(
    req: ChatRequest, output: dict[str, Any], parser: str = "qwen25", reasoning: Reasoning | None = None
) -> tuple[dict[str, Any], str, Any]:
    """(message, finish_reason, matched_stop) of one /generate answer, as SGLang's serving_chat
    builds it: the thinking split off first (`reasoning`), then the tool calls (`parser`) read
    from the rest."""
    fin = (output.get("meta_info") or {}).get("finish_reason") or {}
    reason, matched = fin.get("type", "stop"), fin.get("matched")
    thought, text = split_answer(req, output.get("text", ""), reasoning)
    calls: list[dict[str, Any]] = []
    if req.parses_tools:
        text, calls = parse_tool_calls(text, req.tools or [], parser)
    if calls and reason == "stop":  # SGLang: a stop with tool calls is finish_reason tool_calls
        reason, matched = "tool_calls", None
    msg = {"role": "assistant", "content": text or "", "reasoning_content": thought or None,
           "tool_calls": calls or None}  # fmt: skip
    return msg, reason, matched


def token_logprob(tokenizer: Any, logprob: float, token_id: int, top: list | None) -> dict[str, Any]:
    """One `logprobs.content[]` entry: the token, its log-prob and its `top` ([logprob, id, ...])."""
    token = tokenizer.decode([token_id])
    tops = [
        {"token": (t := tokenizer.decode([i])), "bytes": list(t.encode()), "logprob": float(v)}
        for v, i, *_ in top or []
    ]
    return {"token": token, "bytes": list(token.encode()), "logprob": float(logprob), "top_logprobs": tops}


def _logprobs(output: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    meta = output.get("meta_info") or {}
    tops = meta.get("output_top_logprobs") or []
    return {
        "content": [
            token_logprob(tokenizer, lp, tid, tops[j] if j < len(tops) else None)
            for j, (lp, tid, *_) in enumerate(meta.get("output_token_logprobs") or [])
        ]
    }


def build_response(
    req: ChatRequest,
    outputs: list[dict[str, Any]],
    tokenizer: Any,
    prompt_ids: list[int],
    parser: str = "qwen25",
    reasoning_parser: str | None = None,
) -> dict[str, Any]:
    """SGLang's ChatCompletionResponse from the /generate answers (one per choice; `parser`: the
    tool-call parser, `reasoning_parser`: the reasoning one, if any)."""
    choices = []
    reasoning = request_reasoning(req, reasoning_parser, tokenizer)
    for i, out in enumerate(outputs):
        msg, reason, matched = assistant_message(req, out, parser, reasoning)
        choice: dict[str, Any] = {
            "index": i, "message": msg, "finish_reason": reason, "matched_stop": matched,
            "logprobs": _logprobs(out, tokenizer) if req.logprobs else None,
        }  # fmt: skip
        if req.return_token_ids:
            choice["token_ids"] = list(out.get("output_ids") or [])
        if req.return_prompt_token_ids:
            choice["prompt_token_ids"] = list(prompt_ids)
        if req.return_meta_info:
            choice["meta_info"] = out.get("meta_info")
        choices.append(choice)
    meta0 = outputs[0].get("meta_info") or {}
    completion = sum(len(o.get("output_ids") or []) for o in outputs)
    prompt_n = int(meta0.get("prompt_tokens") or len(prompt_ids))  # with images: the expanded prompt
    return {
        "id": f"chatcmpl-{meta0.get('id') or uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_n,
            "completion_tokens": completion,
            "total_tokens": prompt_n + completion,
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
        },
        # SGLang's weight_version is a string (OpenAI's metadata is str -> str)
        "metadata": {"weight_version": str(meta0.get("weight_version"))},
    }


def sse_chunks(response: dict[str, Any], include_usage: bool = False) -> list[str]:
    """stream=true on the session server: the finished response as SSE `chat.completion.chunk`s
    (role, content and tool calls, finish), the usage chunk when asked, then `[DONE]` (a session
    turn is assembled whole; the engine's routes stream token by token: openai_api.py)."""
    head = {k: response[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(choices, **extra) -> str:
        return "data: " + json.dumps({**head, "choices": choices, **extra}) + "\n\n"

    out = []
    for c in response["choices"]:
        i, msg = c["index"], c["message"]
        out.append(
            chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        )
        delta: dict[str, Any] = {"content": msg["content"]}
        if msg.get("reasoning_content"):
            delta = {"reasoning_content": msg["reasoning_content"], **delta}
        if msg.get("tool_calls"):
            delta["tool_calls"] = msg["tool_calls"]
        out.append(chunk([{"index": i, "delta": delta, "logprobs": c["logprobs"], "finish_reason": None}]))
        out.append(chunk([{"index": i, "delta": {}, "finish_reason": c["finish_reason"],
                           "matched_stop": c["matched_stop"]}]))  # fmt: skip
    if include_usage:
        out.append(chunk([], usage=response["usage"]))
    out.append("data: [DONE]\n\n")
    return out


def models_list(model_id: str, model_path: str, context_length: int) -> dict[str, Any]:
    """GET /v1/models: SGLang's ModelList with the served model (`model_id`, its checkpoint `root`)."""
    card = {"id": model_id, "object": "model", "created": int(time.time()), "owned_by": "sglang",
            "root": model_path, "parent": None, "max_model_len": context_length}  # fmt: skip
    return {"object": "list", "data": [card]}
