"""Embedded rollout engine: an HF causal LM behind a continuous-batching scheduler.

One scheduler thread owns the model. Requests queue in `_waiting`; every step either prefills
the newly admitted requests (left-padded, merged into the running KV cache) or decodes one token
for every running request. Finished rows leave the batch at once, so short and long requests share
forward passes (continuous batching).

Log-prob contract (Miles' and SGLang's default, SGLANG_RETURN_ORIGINAL_LOGPROB=0):
`output_token_logprobs` holds log_softmax(logits / T) of the sampled token over the full vocabulary,
from the fp32 logits of the very forward pass that sampled it (greedy requests score at T = 1). With
`return_sampling_mask` the response also carries, per generated token, the support it was drawn from
after top-k / top-p / min-p (`output_token_sampling_mask`, ascending token ids) and the token's
log-prob renormalized over that support (`output_token_sampling_logprobs`): Miles' sampling-support
replay. The trainer scores log_softmax(z / T), over the same support when one was recorded.

Weight updates take the step lock, so a forward pass never sees half-old, half-new weights; they are
validated (names, shapes) before any tensor is copied, so a failed update keeps old weights and version.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import os
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from transformers import DynamicCache

from miles_platform.errors import CheckpointError, MilesError
from miles_platform.rollout.engine_logprobs import (
    LogprobOptions,
    input_logprobs,
    parse_logprob_options,
    step_extras,
    temperature_of,
)
from miles_platform.rollout.lora_serving import LoraSlots, parse_adapter
from miles_platform.rollout.sampling import draw

log = logging.getLogger(__name__)


class RequestError(MilesError, ValueError):
    """A malformed generate request (HTTP 400); the message names the field and the allowed values."""


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
        d = dict(d or {})
        if not isinstance(d, dict):
            raise RequestError("sampling_params must be a JSON object")
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


@dataclass
class _Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    min_version: int | None
    exact_version: int | None
    future: Future
    seed: int  # of the counter-based sampler: draw k of this request is uniforms(seed, k)
    max_new_tokens: int
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    return_sampling_mask: bool = False
    supports: list[list[int]] = field(default_factory=list)
    support_logprobs: list[float] = field(default_factory=list)
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

    @property
    def scores_input(self) -> bool:
        return self.return_logprob and self.lp_opts.wants_input


class _Batch:
    """Running requests and their shared left-padded KV cache (rows aligned with `reqs`)."""

    def __init__(self):
        self.reqs: list[_Request] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, T] 1 = real token in cache
        self.pos: torch.Tensor | None = None  # [B] next position id per row

    def __len__(self) -> int:
        return len(self.reqs)


def _version_violation(req: _Request, version: int) -> str | None:
    if req.exact_version is not None and version != req.exact_version:
        return f"engine serves weight_version {version}, request needs exactly {req.exact_version}"
    if req.min_version is not None and version < req.min_version:
        return f"engine serves weight_version {version}, request needs at least {req.min_version}"
    return None


GROUP_JOIN_TIMEOUT_S = 30.0  # an engine joining a trainer's weight-broadcast group


class EngineCore:
    """The in-process engine: `generate`, weight updates and pause/continue, thread-safe."""

    def __init__(
        self,
        hf_checkpoint: str | os.PathLike,
        dtype: str | torch.dtype = "fp32",
        max_batch_size: int = 512,
        batch_wait_ms: float = 5.0,
        weight_version: int = 0,
        num_threads: int | None = None,
    ):
        """`num_threads`: torch intra-op threads of the scheduler thread (None: the process setting).
        With libgomp, two threads that both run multi-threaded torch ops oversubscribe the CPUs and
        throttle each other badly; see docs/engine.md."""
        self.model_path = str(hf_checkpoint)
        self.dtype = _parse_dtype(dtype)
        self.max_batch_size = int(max_batch_size)
        self.batch_wait_s = batch_wait_ms / 1000.0
        self._weight_version = int(weight_version)
        self.stats = {
            "num_forward_calls": 0,
            "num_batched_forward_calls": 0,  # forwards that served more than one request
            "num_prefill_calls": 0,
            "num_shared_prefill_rows": 0,  # prefill rows served by an identical row of the same step
            "num_decode_calls": 0,
            "max_batch_size_seen": 0,
            "num_generated_tokens": 0,
            "num_finished_requests": 0,
            "num_weight_updates": 0,
            "num_scored_requests": 0,  # prefill-only scoring (input log-probs), e.g. an OPD teacher
        }
        self._step_lock = threading.Lock()  # held during a forward pass and any state swap
        # request ids without `rid`: unique per engine process, cheaper than a uuid4 per request
        self._rid_prefix, self._rid_counter = f"{uuid.uuid4().hex[:12]}-", itertools.count()
        self._weight_groups: dict = {}  # group_name -> (process group, backend): broadcast updates
        self._group_init = threading.Lock()  # one init_weights_update_group join at a time
        self._cv = threading.Condition()  # guards _waiting / _paused / _stopping
        self._waiting: deque[_Request] = deque()
        self._batch = _Batch()
        self._paused = False
        self._stopping = False
        self._control: deque[tuple] = deque()  # (fn, Future) run on the scheduler thread
        self._batch_submitted = False  # a multi-prompt request arrived: it is its own batch, no wait
        self._num_threads = num_threads
        # All torch compute (load, forward, weight copies) runs on the scheduler thread: a second
        # thread with its own OpenMP team would make libgomp throttle both (see docs/engine.md).
        self._ready, self._load_error = threading.Event(), None
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error

    def _run(self) -> None:
        if self._num_threads:
            torch.set_num_threads(self._num_threads)
        try:
            self.model, self.tokenizer = _load_model(self.model_path, self.dtype)
            self.context_length = int(getattr(self.model.config, "max_position_embeddings", 2048))
            self.vocab_size = int(self.model.config.vocab_size)
            # the longest token's text: a prompt longer than context x this cannot fit (checked
            # before tokenizing it, so a huge body costs a length check, not seconds of BPE)
            self._max_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1) + 1
            self.eos_ids = _eos_ids(self.model, self.tokenizer)
            self._params = dict(self.model.state_dict(keep_vars=True))  # tied names alias one Parameter
            self._lora = LoraSlots(self.model)
        except BaseException as e:
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop()

    def _in_scheduler(self, fn):
        """Run `fn()` on the scheduler thread between steps and return its result (or raise)."""
        if threading.current_thread() is self._thread:
            return fn()
        fut: Future = Future()
        with self._cv:
            if self._stopping:
                raise EngineStopped("engine stopped")
            self._control.append((fn, fut))
            self._cv.notify_all()
        return fut.result()

    # ---- public API -------------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def paused(self) -> bool:
        return self._paused

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(
        self,
        input_ids: list[int] | None = None,
        sampling_params: dict | SamplingParams | None = None,
        return_logprob: bool = True,
        text: str | None = None,
        min_weight_version: int | None = None,
        exact_weight_version: int | None = None,
        rid: str | None = None,
        return_sampling_mask: bool = False,
    ) -> Future:
        """Queue one request; the Future resolves to an SGLang-shaped dict {text, output_ids, meta_info}."""
        req = self._make_request(
            input_ids, sampling_params, return_logprob, text, min_weight_version, exact_weight_version, rid,
            return_sampling_mask,
        )  # fmt: skip
        self._enqueue([req])
        return req.future

    def submit_json(self, body: dict) -> tuple[list[Future], bool]:
        """Parse an SGLang `/generate` body (single or batch); returns (futures, is_batch)."""
        reqs, is_batch = self._parse_generate_body(body)
        self._enqueue(reqs)
        return [r.future for r in reqs], is_batch

    def generate(
        self,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict | list[dict] | None = None,
        return_logprob: bool = True,
        text: str | list[str] | None = None,
        min_weight_version: int | None = None,
        exact_weight_version: int | None = None,
        timeout: float | None = None,
        return_sampling_mask: bool = False,
        lora_path: str | list[str | None] | None = None,
    ) -> dict | list[dict]:
        """Blocking generate with the `/generate` semantics (a list of prompts returns a list)."""
        body = {"sampling_params": sampling_params, "return_logprob": return_logprob}
        if lora_path is not None:
            body["lora_path"] = lora_path
        if return_sampling_mask:
            body["return_sampling_mask"] = True
        body.update({"input_ids": input_ids} if input_ids is not None else {"text": text})
        if min_weight_version is not None:
            body["min_weight_version"] = min_weight_version
        if exact_weight_version is not None:
            body["exact_weight_version"] = exact_weight_version
        futures, is_batch = self.submit_json(body)
        results = [f.result(timeout) for f in futures]
        return results if is_batch else results[0]

    def update_weights_from_tensors(
        self, named_tensors: dict[str, torch.Tensor], weight_version: int
    ) -> None:
        """Copy (a subset of) parameters in, atomically between forward passes; set the version."""
        self._in_scheduler(
            lambda: self._swap(self._prepare_tensors(named_tensors, require_all=False), int(weight_version))
        )

    def update_weights_from_disk(self, path: str | os.PathLike, weight_version: int | None = None) -> int:
        """Load a full HF checkpoint dir (quantized ones via the dequantizing loader); returns the new version."""
        version = self._weight_version + 1 if weight_version is None else int(weight_version)
        if version < 0 or version < self._weight_version:
            raise RequestError(
                f"weight_version {version}: versions only move forward (this engine serves v{self._weight_version})"
            )
        state = _read_state_dict(path)
        self._in_scheduler(
            lambda: self._swap(self._prepare_tensors(state, require_all=True, source=str(path)), version)
        )
        self.model_path = str(path)
        return version

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
    ) -> None:
        """Join the trainer's weight-broadcast group as rank `rank_offset` (SGLang's API). Blocks
        until every rank joined; a second init under the same name replaces the group."""
        from miles_platform.weights.transports.broadcast import new_weights_group

        if backend not in ("gloo", "nccl"):
            raise RequestError(f"init_weights_update_group backend={backend!r}: must be gloo or nccl")
        # one join at a time, each bounded: calls to a dead port cannot pile up and block updates
        if not self._group_init.acquire(blocking=False):
            raise RequestError("init_weights_update_group: another join is in progress on this engine")
        try:
            group = new_weights_group(
                master_address, master_port, rank_offset, world_size, group_name, backend,
                join_timeout_s=GROUP_JOIN_TIMEOUT_S,
            )  # fmt: skip
        finally:
            self._group_init.release()
        self._weight_groups[group_name] = (group, backend)

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: int | None = None,
    ) -> int:
        """Receive each tensor by broadcast from rank 0 in the order given, then load them atomically
        (names and shapes are checked after receiving, so the group stays in step on a bad update).
        Returns the new version. The receive runs on the caller's thread; the swap on the scheduler."""
        from miles_platform.weights.transports.broadcast import broadcast, parse_dtype

        if group_name not in self._weight_groups:
            raise RequestError(
                f"no weights update group {group_name!r}: call /init_weights_update_group first"
            )
        if not (len(names) == len(dtypes) == len(shapes)):
            raise RequestError(
                f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}"
            )
        try:
            kinds = [parse_dtype(d) for d in dtypes]
        except ValueError as e:
            raise RequestError(f"update_weights_from_distributed: {e}") from e
        group, backend = self._weight_groups[group_name]
        device = "cuda" if backend == "nccl" else "cpu"
        named = {}
        for name, dtype, shape in zip(names, kinds, shapes, strict=True):
            t = torch.empty([int(x) for x in shape], dtype=dtype, device=device)
            broadcast(group, t)
            named[name] = t
        version = self._weight_version + 1 if weight_version is None else int(weight_version)
        self.update_weights_from_tensors(named, version)
        return version

    def get_weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of every parameter (tied ones once), for --check-weight-update-equal."""
        return self._in_scheduler(
            lambda: {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}
        )

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        """SGLang's `/get_weights_by_name`: the first `truncate_size` rows (elements of a 1-D tensor)
        of one parameter, by HF name (tied names too), as a float64 numpy array (every served value
        exactly; the HTTP layer writes it as nested JSON lists, as SGLang does)."""
        if name not in self._params:
            raise RequestError(
                f"unknown parameter {name!r} (this model has e.g. {next(iter(self._params))!r})"
            )
        n = int(truncate_size)
        return self._in_scheduler(
            lambda: self._params[name].detach()[:n].to("cpu", torch.float64).numpy().copy()
        )

    def weights_checksums(self, names: list[str] | None = None) -> dict[str, dict]:
        """Our extension to SGLang's API (`POST /weights_checksum`): {name: {"dtype", "shape",
        "xxh3_128"}} of each parameter's bytes as served, every one (`names=None`) or those named.
        One request answers what `/get_weights_by_name` needs one request per tensor for."""
        from miles_platform.weights.checksum import checksum

        names = list(self._params) if names is None else list(names)
        unknown = [n for n in names if n not in self._params]
        if unknown:
            raise RequestError(
                f"unknown parameter {unknown[0]!r} (this model has e.g. {next(iter(self._params))!r})"
            )

        def digest():
            out = {}
            for n in names:
                t = self._params[n].detach()
                out[n] = {
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                    "xxh3_128": checksum(t),
                }
            return out

        return self._in_scheduler(digest)

    # ---- LoRA adapters (SGLang's /load_lora_adapter, /unload_lora_adapter, `lora_path`) ----------

    def load_lora_adapter(
        self, name: str, tensors: dict, config: dict, weight_version: int | None = None,
        path: str | None = None, replace: bool = False,
    ) -> int:  # fmt: skip
        """Serve a PEFT LoRA adapter as `name` (requests select it with `lora_path`). `replace`: swap
        an adapter of that name in one step (a weight update); else, as SGLang, a loaded name is an
        error. Validated before anything changes. Returns the adapter's version."""
        if not isinstance(name, str) or not name:
            raise RequestError("lora_name must be a non-empty string")
        old = self._lora.adapters.get(name)
        if weight_version is None:
            version = old.version + 1 if old is not None else self._weight_version
        else:
            version = int(weight_version)
        if old is not None and version < old.version:
            raise RequestError(f"LoRA adapter {name!r}: weight_version {version} < served v{old.version}")

        def load():
            adapter = parse_adapter(name, tensors, config, self.model, self.dtype, version, path)
            with self._step_lock:
                self._lora.load(adapter, replace=replace)
                b, keep = self._batch, []
                for i, r in enumerate(b.reqs):  # exact/min constraints of running requests (as _swap)
                    why = _version_violation(r, version) if r.lora == name else None
                    if why:
                        self._fail_version(r, why)
                    else:
                        keep.append(i)
                if len(keep) != len(b):
                    self._batch = _select(b, keep, self.model.config)
                self.stats["num_lora_loads"] = self.stats.get("num_lora_loads", 0) + 1

        try:
            self._in_scheduler(load)
        except ValueError as e:
            raise RequestError(str(e)) from e
        return version

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving `name`. Requests still holding it fail when next scheduled (400), except
        across a pause: an unload + load under the same name inside a pause is a seamless update."""

        def unload():
            with self._step_lock:
                self._lora.unload(name)

        try:
            self._in_scheduler(unload)
        except ValueError as e:
            raise RequestError(str(e)) from e

    def lora_adapters(self) -> dict[str, dict]:
        return {n: {"lora_path": a.path, "weight_version": a.version, "rank": a.rank}
                for n, a in sorted(self._lora.adapters.items())}  # fmt: skip

    def get_lora_adapter_checksums(self, name: str) -> dict:
        """SHA-256 of each served lora_A / lora_B tensor (in the serving dtype): --check-lora-weight-equal."""
        a = self._lora.adapters.get(name)
        if a is None:
            raise RequestError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self._lora.adapters)})")
        return {"lora_name": name, "weight_version": a.version, "sha256": a.checksums()}

    def _version_of(self, r: _Request) -> int:
        """The policy version serving `r`: its adapter's (`lora_path`), else the base weights'."""
        if r.lora is None:
            return self._weight_version
        a = self._lora.adapters.get(r.lora)
        return a.version if a is not None else (r.version_start or 0)

    def _fail_unloaded(self, r: _Request) -> None:
        if not r.future.done():
            r.future.set_exception(RequestError(f"lora_path {r.lora!r} was unloaded while the request ran"))

    def _drop_unloaded(self) -> None:
        b = self._batch
        keep = [i for i, r in enumerate(b.reqs) if r.lora is None or r.lora in self._lora.adapters]
        if len(keep) != len(b):
            for i in set(range(len(b))) - set(keep):
                self._fail_unloaded(b.reqs[i])
            self._batch = _select(b, keep, self.model.config)

    def pause_generation(self, mode: str = "abort") -> None:
        """abort: finish in-flight and queued requests with finish_reason abort; retract: drop their KV
        and requeue them (recomputed after continue); in_place: freeze them with their KV cache."""
        if mode not in ("abort", "retract", "in_place"):
            raise RequestError(f"pause_generation mode={mode!r}: must be one of abort, retract, in_place")
        with self._step_lock:
            with self._cv:
                self._paused = True
                if mode == "abort":
                    queued = list(self._waiting)
                    self._waiting.clear()
                    for r in queued:
                        self._finish(r, {"type": "abort", "message": "aborted by pause_generation"})
                elif mode == "retract":
                    self._waiting.extendleft(reversed(self._batch.reqs))
            if mode == "abort":
                for r in self._batch.reqs:
                    self._finish(r, {"type": "abort", "message": "aborted by pause_generation"})
            if mode in ("abort", "retract"):
                self._batch = _Batch()

    def continue_generation(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def flush_cache(self) -> bool:
        """No prefix cache is kept between requests, so there is nothing to flush."""
        return True

    def num_inflight(self) -> int:
        return len(self._waiting) + len(self._batch)

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=10)
        with self._step_lock, self._cv:
            for r in list(self._waiting) + self._batch.reqs:
                if not r.future.done():
                    r.future.set_exception(EngineStopped("engine stopped"))
            for _, fut in self._control:
                fut.set_exception(EngineStopped("engine stopped"))
            self._waiting.clear()
            self._control.clear()
            self._batch = _Batch()

    # ---- request parsing ----------------------------------------------------------------------------

    _BODY_FIELDS = {
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
    }

    def _parse_generate_body(self, body: dict) -> tuple[list[_Request], bool]:
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        unknown = set(body) - self._BODY_FIELDS
        if unknown:
            raise RequestError(
                f"unknown /generate fields {sorted(unknown)}; allowed: {sorted(self._BODY_FIELDS)}"
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
        sps = _parse_sampling_params(sps)
        loras = body.get("lora_path")
        loras = loras if isinstance(loras, list) else [loras] * n
        if len(loras) != n or not all(x is None or isinstance(x, str) for x in loras):
            raise RequestError(f"lora_path must be an adapter name, null, or a list of {n} of them")
        opts = parse_logprob_options(body, n, is_batch, self.vocab_size, _raise_request_error)
        reqs = []
        for i, (kind, p) in enumerate(prompts):
            rid = rids[i] if rids[i] is None or not is_batch or isinstance(body.get("rid"), list) else None
            reqs.append(
                self._make_request(
                    p if kind == "ids" else None,
                    sps[i],
                    text=p if kind == "text" else None,
                    rid=rid,
                    lp_opts=opts[i],
                    **kw,
                )  # fmt: skip
            )
            reqs[-1].lora = loras[i]
        return reqs, is_batch

    def _make_request(
        self, input_ids, sampling_params, return_logprob, text, min_weight_version, exact_weight_version, rid,
        return_sampling_mask=False, lp_opts: LogprobOptions | None = None,
    ) -> _Request:  # fmt: skip
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
        return _Request(
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

    def _enqueue(self, reqs: list[_Request]) -> None:
        with self._cv:
            if self._stopping:
                raise EngineStopped("engine stopped")
            for r in reqs:
                if r.lora is not None and r.lora not in self._lora.adapters:
                    raise RequestError(
                        f"lora_path {r.lora!r} is not loaded (loaded: {sorted(self._lora.adapters)}); "
                        "POST /load_lora_adapter first"
                    )
                why = _version_violation(r, self._version_of(r))
                if why:
                    raise VersionConflict(why, self._version_of(r), r.min_version, r.exact_version)
            for r in reqs:
                if r.max_new_tokens == 0 and not r.scores_input:
                    r.version_start = self._version_of(r)
                    self._finish(r, {"type": "length", "length": 0})
                else:
                    self._waiting.append(r)
            self._batch_submitted |= len(reqs) > 1
            self._cv.notify_all()

    # ---- scheduler ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while (
                    not self._stopping
                    and not self._control
                    and (self._paused or (not self._waiting and not len(self._batch)))
                ):
                    self._cv.wait()
                if self._stopping:
                    return
                control = list(self._control)
                self._control.clear()
            if control:
                for fn, fut in control:
                    try:
                        fut.set_result(fn())
                    except BaseException as e:
                        fut.set_exception(e)
                continue
            with self._cv:
                batched, self._batch_submitted = self._batch_submitted, False
                if not len(self._batch) and len(self._waiting) < self.max_batch_size and not batched:
                    # Collect single requests that arrive together into one batch (a client that
                    # sent a batch has done that already).
                    deadline = time.monotonic() + self.batch_wait_s
                    while (
                        len(self._waiting) < self.max_batch_size
                        and not self._stopping
                        and not self._control
                        and not self._batch_submitted
                    ):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cv.wait(left)
            try:
                with self._step_lock:
                    if not self._paused and not self._stopping:
                        self._step()
            except Exception as e:  # a bug or OOM must fail the requests, not hang them
                log.exception("engine step failed")
                with self._step_lock:
                    for r in self._batch.reqs:
                        if not r.future.done():
                            r.future.set_exception(e)
                    self._batch = _Batch()

    def _step(self) -> None:
        new = []
        with self._cv:
            while self._waiting and len(self._batch) + len(new) < self.max_batch_size:
                r = self._waiting.popleft()
                if r.lora is not None and r.lora not in self._lora.adapters:
                    self._fail_unloaded(r)
                    continue
                why = _version_violation(r, self._version_of(r))
                if why:
                    self._fail_version(r, why)
                else:
                    new.append(r)
        self._drop_unloaded()
        scoring = [r for r in new if r.scores_input and r.input_meta is None]
        if scoring:  # prefill-only scoring (max_new_tokens 0) finishes here, without joining the batch
            self._score_inputs(scoring)
            new = [r for r in new if r.max_new_tokens > 0]
        if new:
            self._prefill(new)
        elif len(self._batch):
            self._decode()

    @torch.no_grad()
    def _prefill(self, reqs: list[_Request]) -> None:
        # retracted ones recompute output; the adapter is part of the context (its KV differs)
        contexts = [(r.lora, tuple(r.prompt_ids + r.output_ids)) for r in reqs]
        # Identical contexts (the n samples of a GRPO group) are prefilled once and their KV rows
        # copied: SGLang's prefix cache does the same; `cached_tokens` reports the hit.
        unique = list(dict.fromkeys(contexts))
        width = max(len(c) for _, c in unique)
        ids = torch.zeros(len(unique), width, dtype=torch.long)
        mask = torch.zeros(len(unique), width, dtype=torch.long)
        for i, (_, c) in enumerate(unique):
            ids[i, width - len(c) :] = torch.tensor(c)
            mask[i, width - len(c) :] = 1
        cache = DynamicCache(config=self.model.config)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        logits = self._forward(ids, mask, pos, cache, prefill=True, loras=[lo for lo, _ in unique])
        if len(unique) < len(reqs):
            row = {c: i for i, c in enumerate(unique)}
            inv = torch.tensor([row[c] for c in contexts])
            logits, mask = logits[inv], mask[inv]
            cache = _cache_from([(k[inv], v[inv]) for k, v in _cache_tensors(cache)], self.model.config)
            self.stats["num_shared_prefill_rows"] += len(reqs) - len(unique)
        first = set()
        for r, c in zip(reqs, contexts, strict=True):
            if r.version_start is None:
                r.version_start = self._version_of(r)
            if c in first:
                r.cached_tokens = len(c[1])
            first.add(c)
        new = _Batch()
        new.reqs, new.cache, new.mask = reqs, cache, mask
        new.pos = torch.tensor([len(c) for _, c in contexts])
        start = len(self._batch)
        self._batch = _merge(self._batch, new, self.model.config)
        self._advance(logits, rows=range(start, start + len(reqs)))

    def _score_inputs(self, reqs: list[_Request]) -> None:
        """Input log-probs of `reqs` (logprob_start_len >= 0) in batched full forwards, one batch per
        served adapter (`lora_path`; the base is None), each under its own adapter."""
        by_lora: dict = {}
        for r in reqs:
            by_lora.setdefault(r.lora, []).append(r)
        for lora, group in by_lora.items():
            with self._lora.active([lora] * len(group)):  # one adapter for every row of each chunk
                metas = input_logprobs(
                    self.model, [r.prompt_ids for r in group], [r.lp_opts for r in group],
                    [r.params.temperature for r in group], self.tokenizer,
                )  # fmt: skip
            self._finish_scored(group, metas)
        self.stats["num_forward_calls"] += len(by_lora)

    def _finish_scored(self, reqs: list[_Request], metas: list) -> None:
        self.stats["num_scored_requests"] += len(reqs)
        for r, meta in zip(reqs, metas, strict=True):
            r.input_meta, r.version_start = meta, self._version_of(r)
            if r.max_new_tokens == 0:
                self._finish(r, {"type": "length", "length": 0})

    @torch.no_grad()
    def _decode(self) -> None:
        b = self._batch
        ids = torch.tensor([[r.output_ids[-1]] for r in b.reqs])
        b.mask = torch.cat([b.mask, torch.ones(len(b), 1, dtype=torch.long)], dim=1)
        logits = self._forward(
            ids, b.mask, b.pos[:, None], b.cache, prefill=False, loras=[r.lora for r in b.reqs]
        )
        b.pos = b.pos + 1
        self._advance(logits, rows=range(len(b)))

    def _forward(self, ids, mask, pos, cache, prefill: bool, loras: list[str | None]) -> torch.Tensor:
        # Without padding the causal mask is implied; passing None keeps SDPA on its fast path.
        with self._lora.active(loras):
            out = self.model(
                input_ids=ids,
                attention_mask=None if bool(mask.all()) else mask,
                position_ids=pos,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        s = self.stats
        s["num_forward_calls"] += 1
        s["num_prefill_calls" if prefill else "num_decode_calls"] += 1
        s["num_batched_forward_calls"] += int(ids.shape[0] > 1)
        s["max_batch_size_seen"] = max(s["max_batch_size_seen"], ids.shape[0])
        return out.logits[:, -1].float()

    def _advance(self, logits: torch.Tensor, rows: range) -> None:
        """Sample one token for `rows` of the batch, record log-probs, retire finished rows."""
        b = self._batch
        reqs = [b.reqs[i] for i in rows]
        ps = [r.params for r in reqs]
        d = draw(
            logits, [p.temperature for p in ps], [p.top_p for p in ps], [p.top_k for p in ps],
            [p.min_p for p in ps], [r.seed for r in reqs], [len(r.output_ids) for r in reqs],
            [r.return_sampling_mask for r in reqs],
        )  # fmt: skip
        self.stats["num_generated_tokens"] += len(d.tokens)
        done, finished = set(), []
        for j, (i, r, t, lp) in enumerate(zip(rows, reqs, d.tokens, d.logprobs)):
            r.output_ids.append(t)
            r.logprobs.append(lp)
            if r.return_sampling_mask:
                r.supports.append(d.supports[j])
                r.support_logprobs.append(d.support_logprobs[j])
            reason = self._finish_reason(r, t)
            if reason:
                finished.append((r, reason))
                done.add(i)
        self._record_extras(logits, reqs)
        self._decode_texts([r for r, _ in finished])
        for r, reason in finished:
            self._finish(r, reason)
        if done:
            self._batch = _select(b, [i for i in range(len(b)) if i not in done], self.model.config)

    def _record_extras(self, logits: torch.Tensor, reqs: list[_Request]) -> None:
        """top_logprobs_num / token_ids_logprob of the token just drawn (rows that asked)."""
        for j, r in enumerate(reqs):
            if r.return_logprob and r.lp_opts.wants_extras:
                t = temperature_of(r.params.temperature)
                lp = torch.log_softmax(logits[j : j + 1].float() / t, dim=-1)
                top, ids = step_extras(lp, r.lp_opts, self.tokenizer)
                if top is not None:
                    r.output_top += top
                if ids is not None:
                    r.output_token_ids += ids

    def _decode_texts(self, reqs: list[_Request]) -> None:
        """Detokenize the requests that finished in one step with one batch_decode per setting."""
        for skip in (True, False):
            todo = [r for r in reqs if r.text is None and r.params.skip_special_tokens is skip]
            if todo:
                texts = self.tokenizer.batch_decode([r.output_ids for r in todo], skip_special_tokens=skip)
                for r, text in zip(todo, texts, strict=True):
                    r.text = text

    def _finish_reason(self, r: _Request, t: int) -> dict | None:
        p = r.params
        if not p.ignore_eos and t in self.eos_ids:
            return {"type": "stop", "matched": t}
        if t in p.stop_token_ids:
            return {"type": "stop", "matched": t}
        if p.stop:
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=p.skip_special_tokens)
            hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                at, s = min(hits)
                r.text = text if p.no_stop_trim else text[:at]
                return {"type": "stop", "matched": s}
        if len(r.output_ids) >= r.max_new_tokens:
            return {"type": "length", "length": len(r.output_ids)}
        return None

    def _finish(self, r: _Request, reason: dict) -> None:
        if r.future.done():
            return
        r.finish_reason = reason
        if r.text is None:
            r.text = self.tokenizer.decode(r.output_ids, skip_special_tokens=r.params.skip_special_tokens)
        v = self._version_of(r)
        meta = {
            "id": r.rid,
            "finish_reason": reason,
            "prompt_tokens": len(r.prompt_ids),
            "completion_tokens": len(r.output_ids),
            "cached_tokens": r.cached_tokens,
            "weight_version": v,
            "weight_version_start": v if r.version_start is None else r.version_start,
            "weight_version_end": v,
            "e2e_latency": time.monotonic() - r.created,
        }
        if r.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.logprobs, r.output_ids)]
            meta.update(r.input_meta or {})
            if r.lp_opts.top_k > 0:
                meta["output_top_logprobs"] = r.output_top
            if r.lp_opts.token_ids:
                meta["output_token_ids_logprobs"] = r.output_token_ids
        if r.return_sampling_mask:
            meta["output_token_sampling_mask"] = r.supports
            meta["output_token_sampling_logprobs"] = r.support_logprobs
        self.stats["num_finished_requests"] += 1
        r.future.set_result({"text": r.text, "output_ids": list(r.output_ids), "meta_info": meta})

    def _fail_version(self, r: _Request, why: str) -> None:
        if not r.future.done():
            r.future.set_exception(VersionConflict(why, self._weight_version, r.min_version, r.exact_version))

    # ---- weights -----------------------------------------------------------------------------------

    def _prepare_tensors(self, named: dict, require_all: bool, source: str = "tensors") -> dict:
        unknown = [n for n in named if n not in self._params]
        if unknown:
            raise CheckpointError(
                f"weights from {source}: unknown tensor names {unknown[:5]} (model has e.g. {next(iter(self._params))})"
            )
        if require_all:
            covered = {id(self._params[n]) for n in named}
            missing = [n for n, p in self.model.named_parameters() if id(p) not in covered]
            if missing:
                raise CheckpointError(f"weights from {source}: missing tensors {missing[:5]}")
        out = {}
        for n, t in named.items():
            p = self._params[n]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(p.shape):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise CheckpointError(
                    f"weights from {source}: {n} has shape {shape}, model expects {tuple(p.shape)}"
                )
            out[n] = t.detach().to(device=p.device, dtype=p.dtype)
        return out

    def _swap(self, prepared: dict, version: int) -> None:
        with self._step_lock, torch.no_grad():
            for n, t in prepared.items():
                self._params[n].copy_(t)
            self._weight_version = version
            self.stats["num_weight_updates"] += 1
            # exact/min constraints of requests already running may now be violated: fail them (409).
            b, keep = self._batch, []
            for i, r in enumerate(b.reqs):
                why = _version_violation(r, version) if r.lora is None else None
                if why:
                    self._fail_version(r, why)
                else:
                    keep.append(i)
            if len(keep) != len(b):
                self._batch = _select(b, keep, self.model.config)


# ---- helpers ------------------------------------------------------------------------------------------


def _raise_request_error(message: str):
    raise RequestError(message)


def _parse_sampling_params(dicts: list) -> list[SamplingParams]:
    """SamplingParams per prompt; a batch whose entries differ only in `sampling_seed` (a GRPO group,
    a whole rollout) is parsed and validated once, the seed set per copy."""
    parsed: dict = {}
    out = []
    for d in dicts:
        if not isinstance(d, dict):
            out.append(SamplingParams.from_dict(d))
            continue
        seed = d.get("sampling_seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise RequestError(f"sampling_params.sampling_seed={seed!r}: must be an integer or null")
        try:
            key = tuple(
                sorted(
                    (k, tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k != "sampling_seed"
                )
            )
            hash(key)
        except TypeError:  # an unhashable value: parse it alone (from_dict names what is wrong)
            out.append(SamplingParams.from_dict(d))
            continue
        if key not in parsed:
            parsed[key] = SamplingParams.from_dict({k: v for k, v in d.items() if k != "sampling_seed"})
        p = copy.copy(parsed[key])
        p.sampling_seed = seed
        out.append(p)
    return out


def _parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
    }
    if dtype not in table:
        raise MilesError(f"--dtype {dtype!r}: must be one of fp32, bf16")
    return table[dtype]


def _load_model(path: str, dtype: torch.dtype):
    from miles_platform.models.checkpoint import load_hf_checkpoint, load_tokenizer, validate_hf_dir

    cfg = validate_hf_dir(path)
    if not cfg.get("quantization_config"):
        model, tok = load_hf_checkpoint(path, dtype)
    else:  # build the bf16/fp32 model from config, then load the dequantized weights into it
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(path)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        state = _read_state_dict(path)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise CheckpointError(
                f"HF checkpoint {path}: dequantized weights missing {missing[:5]} / unexpected {unexpected[:5]}"
            )
        tok = load_tokenizer(path)
    for p in model.parameters():
        p.requires_grad_(False)
    _check_cache_kwarg(model)
    return model, tok


def _check_cache_kwarg(model) -> None:
    """The decode loop hands its KV cache to forward as `cache=` (transformers 5.2x). An older
    transformers names it `past_key_values` and swallows `cache` into **kwargs, so every decode step
    would silently run without context (wrong tokens and log-probs): refuse to start instead."""
    import inspect

    import transformers

    if "cache" not in inspect.signature(type(model).forward).parameters:
        raise MilesError(
            f"transformers {transformers.__version__}: {type(model).__name__}.forward takes no `cache` "
            "argument; the embedded engine needs the pinned transformers (pip install -e .)"
        )


def _read_state_dict(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from miles_platform.models.checkpoint import validate_hf_dir

    cfg = validate_hf_dir(path, need_tokenizer=False)
    if cfg.get("quantization_config"):
        try:
            from miles_platform.weights.quantize import load_dequantized_state_dict
        except ImportError as e:
            raise CheckpointError(
                f"HF checkpoint {path} is quantized ({cfg['quantization_config'].get('quant_method', '?')}) "
                f"but miles_platform.weights.quantize is not available ({e})"
            ) from e
        return load_dequantized_state_dict(str(path))
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        e = getattr(src, "eos_token_id", None)
        if e is not None:
            ids.update(e if isinstance(e, list | tuple) else [e])
    return ids


def _cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _cache_from(tensors, config) -> DynamicCache:
    cache = DynamicCache(config=config)
    for i, (k, v) in enumerate(tensors):
        cache.update(k, v, i)
    return cache


def _merge(a: _Batch, b: _Batch, config) -> _Batch:
    """Concatenate two batches, left-padding the shorter KV cache (padding is masked out)."""
    if not len(a):
        return b
    ta, tb = a.mask.shape[1], b.mask.shape[1]
    width = max(ta, tb)

    def pad(x, t):
        return (
            torch.nn.functional.pad(x, (0, 0, width - t, 0))
            if x.dim() == 4
            else torch.nn.functional.pad(x, (width - t, 0))
        )

    tensors = [
        (torch.cat([pad(ka, ta), pad(kb, tb)]), torch.cat([pad(va, ta), pad(vb, tb)]))
        for (ka, va), (kb, vb) in zip(_cache_tensors(a.cache), _cache_tensors(b.cache))
    ]
    out = _Batch()
    out.reqs = a.reqs + b.reqs
    out.cache = _cache_from(tensors, config)
    out.mask = torch.cat([pad(a.mask, ta), pad(b.mask, tb)])
    out.pos = torch.cat([a.pos, b.pos])
    return out


def _select(b: _Batch, keep: list[int], config) -> _Batch:
    """Keep rows `keep`, and drop cache columns that are padding for every remaining row."""
    out = _Batch()
    if not keep:
        return out
    idx = torch.tensor(keep)
    mask = b.mask[idx]
    start = int((mask.sum(0) > 0).nonzero()[0])
    out.reqs = [b.reqs[i] for i in keep]
    out.mask = mask[:, start:]
    out.pos = b.pos[idx]
    out.cache = _cache_from(
        [(k[idx, :, start:], v[idx, :, start:]) for k, v in _cache_tensors(b.cache)], config
    )
    return out
