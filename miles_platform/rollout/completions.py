"""OpenAI-compatible text completions over SGLang's `/generate` (SGLang's serving_completions), for
the embedded engine: the raw prompt, no chat template, tokenized as `/generate` tokenizes `text`.
Pure functions; openai_api.py routes and streams.

    body --parse_request--> CompletionRequest --generate_body--> one batched /generate body
    /generate answers --build_response--> text_completion

Fields (SGLang's CompletionRequest): `prompt` (a string, token ids, or a list of either; choice
`i * n + j` is prompt i's j-th), `max_tokens` (default 16), `temperature`, `top_p`, `top_k`, `min_p`,
`n` (choice j seeded `seed + j`), `stop`, `stop_token_ids`, `seed`, `logprobs` (the k most likely
tokens at each position, <= 20), `stream` (+ `stream_options.include_usage`), `ignore_eos`,
`skip_special_tokens`, `no_stop_trim`, `lora_path`. The chat route's validation (chat.py) checks
the fields both take; `echo`, `suffix`, `best_of` > 1 and what chat refuses are a 400 naming them.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from miles_platform.rollout import chat
from miles_platform.rollout.chat import ChatError

DEFAULT_MAX_TOKENS = 16  # OpenAI's and SGLang's
_UNSUPPORTED = {**chat.UNSUPPORTED, "echo": False, "suffix": None, "best_of": None}
_FLAGS = ("stream", "ignore_eos", "no_stop_trim")
_KNOWN = {"prompt", "logprobs", *chat.COMMON_FIELDS, *_UNSUPPORTED}


@dataclass
class CompletionRequest:
    prompts: list[str] | list[list[int]]  # texts or token ids, never mixed
    sampling_params: dict[str, Any] = field(default_factory=dict)  # SGLang names
    n: int = 1
    logprobs: int | None = None  # None: no log-probs; k: the token's and the k most likely
    stream: bool = False
    include_usage: bool = False
    lora_path: str | None = None
    model: str = "default"


def parse_request(body: Any) -> CompletionRequest:
    """Validate a /v1/completions body; ChatError (400) names the field."""
    chat.check_fields(body, _KNOWN, _UNSUPPORTED, _FLAGS, "completion", "CompletionRequest")
    req = CompletionRequest(_prompts(body.get("prompt")), chat.sampling_params(body, DEFAULT_MAX_TOKENS))
    req.n = chat.int_field(body, "n", 1, 1, chat.MAX_N)
    if len(req.prompts) * req.n > chat.MAX_N:
        raise ChatError(f"{len(req.prompts)} prompts x n={req.n}: at most {chat.MAX_N} choices per request")
    if body.get("logprobs") is not None:
        req.logprobs = chat.int_field(body, "logprobs", 0, 0, chat.MAX_TOP_LOGPROBS)
    req.stream, req.include_usage = bool(body.get("stream")), chat.include_usage(body)
    req.lora_path = chat.lora_field(body)
    return req


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)


def _prompts(prompt: Any) -> list[str] | list[list[int]]:
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and (all(isinstance(p, str) for p in prompt) or all(_is_ids(p) for p in prompt))
    ):
        prompts = prompt
    else:
        raise ChatError(
            f"prompt={prompt!r:.80}: must be a string, a list of token ids, or a non-empty list of "
            "strings or of token-id lists"
        )
    if "" in prompts:
        raise ChatError("prompt must not be empty (the model needs a context to continue)")
    return prompts


def generate_body(req: CompletionRequest) -> dict[str, Any]:
    """The /generate batch of every choice (prompt i's n choices at i*n .. i*n+n-1, choice j seeded
    `seed + j`, so seeded choices differ and stay reproducible)."""
    seed = req.sampling_params.get("sampling_seed")
    sps = [
        {**req.sampling_params, "sampling_seed": None if seed is None else seed + j}
        for _ in req.prompts
        for j in range(req.n)
    ]
    key = "text" if isinstance(req.prompts[0], str) else "input_ids"
    body: dict[str, Any] = {key: [p for p in req.prompts for _ in range(req.n)], "sampling_params": sps,
                            "return_logprob": True}  # fmt: skip
    if req.logprobs:
        body["top_logprobs_num"] = req.logprobs
    if req.lora_path is not None:
        body["lora_path"] = req.lora_path
    return body


def logprobs(tokenizer: Any, tokens: list[tuple[int, float, list | None]], offset: int) -> dict[str, Any]:
    """OpenAI's completion log-probs of `tokens` ((id, logprob, top entries)), text offsets from `offset`."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp, top in tokens:
        text = tokenizer.decode([tid])
        out["tokens"].append(text)
        out["token_logprobs"].append(float(lp))
        out["top_logprobs"].append({tokenizer.decode([i]): float(v) for v, i, *_ in top or []})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def output_tokens(output: dict[str, Any]) -> list[tuple[int, float, list | None]]:
    """(id, logprob, top entries) of each generated token of a /generate answer."""
    meta = output.get("meta_info") or {}
    tops = meta.get("output_top_logprobs") or []
    return [
        (tid, lp, tops[j] if j < len(tops) else None)
        for j, (lp, tid, *_) in enumerate(meta.get("output_token_logprobs") or [])
    ]


def finish(output: dict[str, Any]) -> tuple[str, Any]:
    """(finish_reason, matched_stop) of a /generate answer."""
    fin = (output.get("meta_info") or {}).get("finish_reason") or {}
    return fin.get("type", "stop"), fin.get("matched")


def usage(req: CompletionRequest, outputs: list[dict[str, Any]]) -> dict[str, int]:
    prompt = sum(
        (outputs[i * req.n].get("meta_info") or {}).get("prompt_tokens", 0) for i in range(len(req.prompts))
    )
    completion = sum(len(o.get("output_ids") or []) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def build_response(req: CompletionRequest, outputs: list[dict[str, Any]], tokenizer: Any) -> dict[str, Any]:
    """SGLang's CompletionResponse from the /generate answers (one per choice)."""
    choices = []
    for i, out in enumerate(outputs):
        reason, matched = finish(out)
        lps = logprobs(tokenizer, output_tokens(out), 0) if req.logprobs is not None else None
        choices.append({"index": i, "text": out.get("text", ""), "logprobs": lps, "finish_reason": reason,
                        "matched_stop": matched})  # fmt: skip
    meta0 = outputs[0].get("meta_info") or {}
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        "usage": usage(req, outputs),
        "metadata": {"weight_version": str(meta0.get("weight_version"))},
    }
