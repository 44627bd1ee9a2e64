"""What the embedded engine accepts: SGLang `/generate` bodies parsed into `Request`s, with the
sampling params, errors (400 / 409 / 503) and version constraints every path checks the same way.

`RequestParser` turns a body (single prompt or batch) into requests and refuses a malformed one with a
`RequestError` that names the field and the allowed values, before anything is queued.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, fields

from miles_platform.errors import MilesError
from miles_platform.rollout.engine_logprobs import LogprobOptions, parse_logprob_options

log = logging.getLogger(__name__)


class RequestError(MilesError, ValueError):
    """A malformed generate request (HTTP 400); the message names the field and the allowed values."""


class AdapterOwned(RequestError):
    """A LoRA adapter another key loaded (HTTP 403): only that key or the engine's admin key may
    unload, replace or reload it."""


class VersionConflict(Exception):
    """The engine cannot serve the requested policy version (HTTP 409, retryable)."""

    def __init__(self, message: str, weight_version: int, min_weight_version=None, exact_weight_version=None):
        super().__init__(message)
        self.info = {
            "message": message,
            "type": "weight_version_conflict",
            "retryable": True,
            "weight_version": weight_version,
            "min_weight_version": min_weight_version,
            "exact_weight_version": exact_weight_version,
        }


class EngineStopped(Exception):
    """The engine is shutting down (HTTP 503, retryable elsewhere)."""


class EnginePaused(Exception):
    """A paused engine gave up on a request (HTTP 503, retryable): it waited for
    /continue_generation longer than `--pause-wait-timeout-s`, or `--pause-max-queued-requests`
    requests were waiting already. `info` is the error body."""

    def __init__(self, message: str, paused_for_s: float):
        super().__init__(message)
        self.info = {
            "message": message,
            "type": "engine_paused",
            "retryable": True,
            "paused_for_s": round(paused_for_s, 3),
        }


# SGLang sampling fields we accept only at their defaults (the embedded engine does not implement them).
_UNSUPPORTED_DEFAULTS = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
}
_IGNORED = {"spaces_between_special_tokens", "stream_interval"}


@dataclass
class SamplingParams:
    """SGLang sampling params (same names and defaults) that the embedded engine implements."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        if d is not None and not isinstance(d, dict):
            raise RequestError("sampling_params must be a JSON object")
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        for k in list(d):
            if k in _IGNORED:
                d.pop(k)
            elif k in _UNSUPPORTED_DEFAULTS:
                v = d.pop(k)
                if v is not None and v != _UNSUPPORTED_DEFAULTS[k]:
                    raise RequestError(f"sampling_params.{k}={v!r} is not supported by the embedded engine")
            elif k not in known:
                raise RequestError(f"unknown sampling_params field {k!r}; allowed: {sorted(known)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if d.get("stop") is None:
            d.pop("stop", None)
        if d.get("stop_token_ids") is None:
            d.pop("stop_token_ids", None)
        p = cls(**d)
        p._validate()
        return p

    def _validate(self) -> None:
        def bad(name, allowed):
            raise RequestError(f"sampling_params.{name}={getattr(self, name)!r}: must be {allowed}")

        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool):
            bad("max_new_tokens", "an integer >= 0")
        if self.max_new_tokens < 0:
            bad("max_new_tokens", "an integer >= 0")
        if not isinstance(self.temperature, int | float) or not 0 <= self.temperature < math.inf:
            bad("temperature", "a number >= 0 (0 = greedy)")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            bad("top_k", "-1 (off) or an integer >= 1")
        if not isinstance(self.min_p, int | float) or not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "a non-empty string or a list of them")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) for t in self.stop_token_ids
        ):
            bad("stop_token_ids", "a list of integers")
        if self.sampling_seed is not None and not isinstance(self.sampling_seed, int):
            bad("sampling_seed", "an integer or null")


def parse_sampling_params(dicts: list) -> list[SamplingParams]:
    """SamplingParams per prompt; a batch whose entries differ only in `sampling_seed` (a GRPO group,
    a whole rollout) is parsed and validated once, the seed set per copy. An entry equal to the one
    before it but for its seed (how a rollout's batch comes) is matched by one dict comparison
    (~0.5 us) before the sorted key (~3 us a prompt)."""
    parsed: dict = {}
    out = []
    prev, prev_params = None, None  # the last entry without its seed, and what it parsed to
    for d in dicts:
        if not isinstance(d, dict):
            out.append(SamplingParams.from_dict(d))
            prev = None
            continue
        seed = d.get("sampling_seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise RequestError(f"sampling_params.sampling_seed={seed!r}: must be an integer or null")
        rest = dict(d)
        rest.pop("sampling_seed", None)
        if prev is not None and rest == prev:
            out.append(_with_seed(prev_params, seed))
            continue
        try:
            key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in rest.items()))
            hash(key)
        except TypeError:  # an unhashable value: parse it alone (from_dict names what is wrong)
            out.append(SamplingParams.from_dict(d))
            prev = None
            continue
        if key not in parsed:
            parsed[key] = SamplingParams.from_dict(rest)
        prev, prev_params = rest, parsed[key]
        out.append(_with_seed(prev_params, seed))
    return out


def _with_seed(params: SamplingParams, seed: int | None) -> SamplingParams:
    """A shallow copy of `params` with its `sampling_seed` (copy.copy's generic path is ~4x this)."""
    p = object.__new__(SamplingParams)
    p.__dict__.update(params.__dict__)
    p.sampling_seed = seed
    return p


def _raise_request_error(message: str):
    raise RequestError(message)


@dataclass
class Request:
    """One generate request and its progress: the scheduler appends to `output_ids` and the log-prob
    lists each step, and resolves `future` with the SGLang-shaped answer when it finishes."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    min_version: int | None
    exact_version: int | None
    future: Future
    seed: (
        int  # of the counter-based sampler: the token at absolute position k is drawn with uniforms(seed, k)
    )
    max_new_tokens: int
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    return_sampling_mask: bool = False
    supports: list[list[int]] = field(default_factory=list)
    # sampling_logprobs_mode "selected": the drawn token's support-normalized log-prob per token;
    # "support": a row per token, each support id's (score centering's support mode)
    sampling_logprobs_mode: str = "selected"
    support_logprobs: list[float] | list[list[float]] = field(default_factory=list)
    version_start: int | None = None
    lora: str | None = None  # `lora_path`: the LoRA adapter this request is served with (None: the base)
    cached_tokens: int = 0
    finish_reason: dict | None = None
    text: str | None = None
    # SGLang's log-prob extras (rollout/engine_logprobs.py): input scoring, top-k, chosen ids
    lp_opts: LogprobOptions = field(default_factory=LogprobOptions)
    input_meta: dict | None = None
    output_top: list = field(default_factory=list)
    output_token_ids: list = field(default_factory=list)
    # SGLang's return_routed_experts (MoE, R3): per forwarded token, [num_layers, top_k] expert ids
    return_routed_experts: bool = False
    routes: list = field(default_factory=list)  # int32 arrays [tokens, num_layers, top_k], in order
    # streaming (the OpenAI routes): called with the request on the scheduler thread after each
    # generated token, its log-prob and top log-probs recorded; it must be quick
    on_token: Callable[[Request], None] | None = None
    # SGLang's image_data (a vision-language model, rollout/engine_vlm.py): the processor's
    # pixel_values and image_grid_thw; prompt_ids then carry the expanded image pads
    vision: dict | None = None

    @property
    def scores_input(self) -> bool:
        return self.return_logprob and self.lp_opts.wants_input

    @property
    def position(self) -> int:
        """The absolute position of the next token (prompt + output so far): the sampler's step, so
        a request whose input is an earlier request's prompt + partial output (a continued partial
        rollout) draws the tokens that request would have drawn."""
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass(frozen=True)
class RunningRequest:
    """A read-only view of one request of the running batch (`EngineCore.running()`)."""

    rid: str
    lora: str | None  # the adapter serving it (`lora_path`); None: the base weights
    output_tokens: int  # generated so far


def stream_tokens(reqs: list[Request]) -> None:
    """Hand each streamed request its new token (before any finishes: every token precedes the answer)."""
    for r in reqs:
        if r.on_token is not None:
            try:
                r.on_token(r)
            except Exception:  # a broken consumer loses its stream, not the batch its step
                log.exception("engine: on_token of request %s failed; streaming stops", r.rid)
                r.on_token = None


def version_violation(req: Request, version: int) -> str | None:
    """Why `version` cannot serve `req` (its exact / min weight_version), or None if it can."""
    if req.exact_version is not None and version != req.exact_version:
        return f"engine serves weight_version {version}, request needs exactly {req.exact_version}"
    if req.min_version is not None and version < req.min_version:
        return f"engine serves weight_version {version}, request needs at least {req.min_version}"
    return None


class RequestParser:
    """Builds `Request`s for one loaded model: token ids checked against its vocabulary and context
    length, text tokenized with its tokenizer. Thread-safe (callers parse on their own threads)."""

    BODY_FIELDS = {  # of an SGLang /generate body
        "text",
        "input_ids",
        "sampling_params",
        "return_logprob",
        "min_weight_version",
        "exact_weight_version",
        "rid",
        "stream",
        "logprob_start_len",
        "top_logprobs_num",
        "return_text_in_logprobs",
        "return_sampling_mask",
        "lora_path",
        "token_ids_logprob",
        "return_routed_experts",
        "sampling_logprobs_mode",
        "image_data",
    }
    vision = None  # a VLM's engine_vlm.VisionPrep: requests may carry image_data

    def __init__(self, tokenizer, context_length: int, vocab_size: int):
        self.tokenizer, self.context_length, self.vocab_size = tokenizer, context_length, vocab_size
        # the longest token's text: a prompt longer than context x this cannot fit (checked
        # before tokenizing it, so a huge body costs a length check, not seconds of BPE)
        self._max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1) + 1
        # request ids without `rid`: unique per engine process, cheaper than a uuid4 per request
        self._rid_prefix, self._rid_counter = f"{uuid.uuid4().hex[:12]}-", itertools.count()

    def parse_body(self, body: dict) -> tuple[list[Request], bool]:
        """An SGLang `/generate` body (one prompt or a batch) -> (its requests, is_batch)."""
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        unknown = set(body) - self.BODY_FIELDS
        if unknown:
            raise RequestError(
                f"unknown /generate fields {sorted(unknown)}; allowed: {sorted(self.BODY_FIELDS)}"
            )
        if body.get("stream"):
            raise RequestError("stream=true is not supported by the embedded engine")
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise RequestError("give exactly one of `text` or `input_ids`")
        if ids is not None:
            is_batch = isinstance(ids, list) and len(ids) > 0 and isinstance(ids[0], list)
            prompts = [("ids", x) for x in (ids if is_batch else [ids])]
        else:
            is_batch = isinstance(text, list)
            prompts = [("text", x) for x in (text if is_batch else [text])]
        n = len(prompts)
        sp = body.get("sampling_params")
        sps = sp if isinstance(sp, list) else [sp] * n
        if len(sps) != n:
            raise RequestError(f"sampling_params has {len(sps)} entries for {n} prompts")
        rids = body.get("rid")
        if isinstance(rids, list) and len(rids) != n:
            raise RequestError(f"rid has {len(rids)} entries for {n} prompts")
        rids = rids if isinstance(rids, list) else [rids] * n
        kw = dict(
            return_logprob=bool(body.get("return_logprob", False)),
            min_weight_version=body.get("min_weight_version"),
            exact_weight_version=body.get("exact_weight_version"),
            return_sampling_mask=bool(body.get("return_sampling_mask", False)),
        )
        sps = parse_sampling_params(sps)
        loras = body.get("lora_path")
        loras = loras if isinstance(loras, list) else [loras] * n
        if len(loras) != n or not all(x is None or isinstance(x, str) for x in loras):
            raise RequestError(f"lora_path must be an adapter name, null, or a list of {n} of them")
        opts = parse_logprob_options(body, n, is_batch, self.vocab_size, _raise_request_error)
        mode = body.get("sampling_logprobs_mode") or "selected"
        if mode not in ("selected", "support"):
            raise RequestError(f"sampling_logprobs_mode={mode!r}: must be 'selected' or 'support'")
        if mode == "support" and not kw["return_sampling_mask"]:
            raise RequestError("sampling_logprobs_mode 'support' needs return_sampling_mask: true")
        reqs = []
        for i, (kind, p) in enumerate(prompts):
            rid = rids[i] if rids[i] is None or not is_batch or isinstance(body.get("rid"), list) else None
            reqs.append(
                self.make_request(
                    p if kind == "ids" else None,
                    sps[i],
                    text=p if kind == "text" else None,
                    rid=rid,
                    lp_opts=opts[i],
                    **kw,
                )  # fmt: skip
            )
            reqs[-1].lora = loras[i]
            reqs[-1].return_routed_experts = bool(body.get("return_routed_experts", False))
            reqs[-1].sampling_logprobs_mode = mode
        if body.get("image_data") is not None:
            if self.vision is None:
                raise RequestError("image_data: the served model is not a vision-language model")
            self.vision.attach(reqs, body, is_batch, self.context_length)
        return reqs, is_batch

    def make_request(
        self, input_ids, sampling_params, return_logprob, text, min_weight_version, exact_weight_version, rid,
        return_sampling_mask=False, lp_opts: LogprobOptions | None = None,
    ) -> Request:  # fmt: skip
        """One request from one prompt (token ids, or text to tokenize), validated."""
        if text is not None:
            if not isinstance(text, str):
                raise RequestError("text must be a string or a list of strings")
            if len(text) > self.context_length * self._max_token_chars:  # checked before tokenizing
                raise RequestError(
                    f"text of {len(text)} characters cannot fit the context length of {self.context_length} tokens"
                )
            input_ids = self.tokenizer(text)["input_ids"]
        if not isinstance(input_ids, list) or not input_ids:
            raise RequestError("input_ids must be a non-empty list of token ids (or a list of such lists)")
        if set(map(type, input_ids)) != {int}:  # one C-level pass (bools and floats are not int)
            raise RequestError("input_ids must contain integers only")
        if min(input_ids) < 0 or max(input_ids) >= self.vocab_size:
            bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
            raise RequestError(f"input_ids {bad[:5]} out of vocabulary [0, {self.vocab_size})")
        if len(input_ids) >= self.context_length:
            raise RequestError(
                f"prompt has {len(input_ids)} tokens; the context length is {self.context_length}"
            )
        params = (
            sampling_params
            if isinstance(sampling_params, SamplingParams)
            else SamplingParams.from_dict(sampling_params)
        )
        versions = {}
        for name, v in (
            ("min_weight_version", min_weight_version),
            ("exact_weight_version", exact_weight_version),
        ):
            if v is not None:
                try:
                    versions[name] = int(v)
                except (TypeError, ValueError):
                    raise RequestError(f"{name}={v!r}: must be an integer policy version") from None
        lp_opts = lp_opts or LogprobOptions()
        if lp_opts.start_len >= len(input_ids):
            raise RequestError(
                f"logprob_start_len={lp_opts.start_len}: must be < the {len(input_ids)} input tokens"
            )
        seed = params.sampling_seed if params.sampling_seed is not None else int.from_bytes(os.urandom(7))
        return Request(
            lp_opts=lp_opts,
            rid=str(rid) if rid is not None else f"{self._rid_prefix}{next(self._rid_counter):x}",
            prompt_ids=list(input_ids),
            params=params,
            return_logprob=bool(return_logprob),
            return_sampling_mask=bool(return_sampling_mask),
            min_version=versions.get("min_weight_version"),
            exact_version=versions.get("exact_weight_version"),
            future=Future(),
            seed=seed % (1 << 64),
            max_new_tokens=min(params.max_new_tokens, self.context_length - len(input_ids)),
        )
