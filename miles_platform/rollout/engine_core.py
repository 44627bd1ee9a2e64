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
replay. With `sampling_logprobs_mode: "support"` each of those is a row instead, the renormalized
log-prob of every support id (score centering's support mode). `output_top_logprobs`
(`top_logprobs_num`) are of log_softmax(logits / T), the unfiltered sampler distribution, as in SGLang.
The trainer scores log_softmax(z / T), over the same support when one was recorded.

The engine's other parts: what a request may be (`engine_requests.py`), the running batch and its KV
cache (`engine_batch.py`), loading and updating the weights (`engine_weights.py`), the log-prob
extras (`engine_logprobs.py`), the sampler (`sampling.py`), LoRA serving (`lora_serving.py`) and the
memory it holds (`engine_memory.py`: the KV budget of --sglang-mem-fraction-static, release/resume).

Device: weights, KV cache, sampling and log-probs live on `device` (the CPU by default; the run's
engine actors and `serve-engine` take the GPU they were given). Requests are staged on the host and
copied once per step; only sampled tokens and log-probs come back.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from miles_platform.cluster.devices import rank_device, use_device
from miles_platform.errors import ConfigError
from miles_platform.models.vlm import is_vlm_config
from miles_platform.rollout.engine_batch import Batch, keep_rows, merge_batches, new_cache, reshaped_cache
from miles_platform.rollout.engine_logprobs import input_logprobs, step_extras, temperature_of
from miles_platform.rollout.engine_memory import EngineMemoryMixin, MemoryReleased, kv_budget_tokens
from miles_platform.rollout.engine_requests import (
    EnginePaused,
    EngineStopped,
    Request,
    RequestError,
    RequestParser,
    RunningRequest,
    SamplingParams,
    VersionConflict,
    stream_tokens,
    version_violation,
)
from miles_platform.rollout.engine_vlm import VisionPrep, generate_with_images
from miles_platform.rollout.engine_weights import EngineWeightsMixin, eos_ids, load_model, parse_engine_dtype
from miles_platform.rollout.lora_serving import LoraSlots
from miles_platform.rollout.metrics import TokenRate
from miles_platform.rollout.sampling import draw

log = logging.getLogger(__name__)

DEFAULT_PAUSE_WAIT_TIMEOUT_S = 600.0
# above a Miles rollout round sent as one batch (512 prompts x 16 samples), so a pause for a weight
# update never refuses one; a run whose trainer died stops there instead of piling requests up
DEFAULT_PAUSE_MAX_QUEUED_REQUESTS = 16384


def check_pause_limits(pause_wait_timeout_s: float, pause_max_queued_requests: int) -> None:
    """Refuse limits that bound nothing, naming the flag (`serve-engine` checks before it loads)."""
    t, n = pause_wait_timeout_s, pause_max_queued_requests
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise ConfigError(f"--pause-wait-timeout-s {t!r}: must be a number > 0 (seconds)")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"--pause-max-queued-requests {n!r}: must be an integer >= 1")


class EngineCore(EngineWeightsMixin, EngineMemoryMixin):
    """The in-process engine: `generate`, weight updates (`EngineWeightsMixin`) and pause/continue,
    callable from any thread.

    Threads: one scheduler thread (`engine-scheduler`, started by __init__) loads the model, then runs
    `_loop`. It runs every forward pass and every weight copy or read; other threads hand those to it
    as control callbacks (`_in_scheduler`) run between steps (a broadcast update only receives its
    tensors on the caller's thread). Callers parse and validate their requests on their own threads
    (`request_parser`) and queue them in `_waiting`, each with a Future the scheduler resolves.

    Loop: wait on `_cv` for work; run queued control callbacks first; with nothing running, wait up to
    `batch_wait_ms` so single requests that arrive together share one prefill; then one `_step` under
    `_step_lock`: admit waiting requests up to `max_batch_size` and prefill them into the running
    batch, or else decode one token for every running request. Rows leave the batch as they finish.
    `_step_lock` (forward passes, weight swaps, pause) is taken before `_cv` (the queue and flags).

    Pause: while paused nothing steps; requests queue (at most `pause_max_queued_requests`, beyond
    that EnginePaused at once) and every request the pause holds (queued, retracted, frozen in place)
    fails with EnginePaused (HTTP 503, retryable) once it has waited `pause_wait_timeout_s`: a run
    whose trainer died mid-update does not leave its clients hanging.

    Test hook: `step_hook`, when set, is called as `step_hook(core)` on the scheduler thread after
    every step, outside `_step_lock`, so a test sees the engine at an exact state (`running()`) instead
    of sleeping. It may pause or update weights there (they run at once, between steps; not unload,
    which waits for steps), or block to hold the scheduler still while another thread acts. An
    exception in it fails the running requests as a failed step does. None (the default) costs one
    attribute check per step; it is Python-only, no HTTP route reaches it."""

    def __init__(
        self,
        hf_checkpoint: str | os.PathLike,
        dtype: str | torch.dtype = "auto",
        max_batch_size: int = 512,
        batch_wait_ms: float = 5.0,
        weight_version: int = 0,
        num_threads: int | None = None,
        pause_wait_timeout_s: float = DEFAULT_PAUSE_WAIT_TIMEOUT_S,
        pause_max_queued_requests: int = DEFAULT_PAUSE_MAX_QUEUED_REQUESTS,
        device: str | torch.device | None = None,
        mem_fraction_static: float | None = None,
        router_dtype: str | None = None,
    ):
        """`num_threads`: torch intra-op threads of the scheduler thread (None: the process setting).
        With libgomp, two threads that both run multi-threaded torch ops oversubscribe the CPUs and
        throttle each other badly; see docs/engine.md. `pause_wait_timeout_s` and
        `pause_max_queued_requests` bound what a pause holds (class docstring). `device`: where the
        engine computes ("cpu", "cuda:N", "auto": the GPU Ray gave this actor, else the CPU; None: the
        CPU). `dtype` "auto": bf16 on CUDA, fp32 on the CPU. `mem_fraction_static` (SGLang's
        --mem-fraction-static): weights + KV cache stay under this fraction of the device's memory;
        the scheduler admits and keeps only as many tokens as fit (engine_memory.py). `router_dtype`
        "fp32" (--moe-router-dtype): MoE routers in fp32 under any `dtype`, as the trainer's (load_model)."""
        check_pause_limits(pause_wait_timeout_s, pause_max_queued_requests)
        self.pause_wait_timeout_s = float(pause_wait_timeout_s)
        self.pause_max_queued_requests = int(pause_max_queued_requests)
        self.model_path, self.router_dtype = str(hf_checkpoint), router_dtype
        self.device = torch.device("cpu") if device is None else rank_device(device)
        self.dtype = parse_engine_dtype(dtype, self.device)
        self.mem_fraction_static = mem_fraction_static
        self.kv_budget: int | None = None  # tokens the KV cache may hold (None: unbounded)
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
            "num_prompt_tokens": 0,  # of finished requests (SGLang's prompt_tokens_total)
            "num_finished_requests": 0,
            "num_weight_updates": 0,
            "num_pauses": 0,  # /pause_generation calls (a LoRA run's updates make none)
            "num_pause_timeouts": 0,  # requests failed after waiting pause_wait_timeout_s
            "num_pause_queue_full": 0,  # requests refused: pause_max_queued_requests were waiting
            "num_scored_requests": 0,  # prefill-only scoring (input log-probs), e.g. an OPD teacher
            "max_kv_tokens_seen": 0,  # rows x columns of the KV cache, at its largest
            "num_kv_retractions": 0,  # rows sent back to the queue to keep the KV cache in its budget
            "num_memory_releases": 0,  # /release_memory_occupation calls that released something
        }
        self._step_lock = threading.Lock()  # held during a forward pass and any state swap
        self._weight_groups: dict = {}  # group_name -> (process group, backend): broadcast updates
        self._group_init = threading.Lock()  # one init_weights_update_group join at a time
        self._cv = threading.Condition()  # guards _waiting / _paused / _stopping
        self._waiting: deque[Request] = deque()
        self._batch = Batch()
        self._admitting: list[Request] = []  # popped from the queue by the step in progress
        self._paused = False
        self._paused_at = 0.0  # time.monotonic() of the pause in force
        self._stopping = False
        self._control: deque[tuple] = deque()  # (fn, Future) run on the scheduler thread
        self._batch_submitted = False  # a multi-prompt request arrived: it is its own batch, no wait
        self._num_threads = num_threads
        self.gen_rate = TokenRate()  # generated tokens per second, for GET /metrics
        self.step_hook: Callable[[EngineCore], None] | None = None  # tests only; see the class docstring
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
            use_device(self.device)  # CUDA's current device is per thread: this one computes
            self.model, self.tokenizer = load_model(self.model_path, self.dtype, self.router_dtype)
            self.model.to(self.device)
            self.kv_budget = kv_budget_tokens(self.model, self.device, self.mem_fraction_static)
            text_cfg = self.model.config.get_text_config()  # a VLM's text model: its vocabulary and context
            self.context_length = int(getattr(text_cfg, "max_position_embeddings", 2048))
            self.vocab_size = int(text_cfg.vocab_size)
            self.request_parser = RequestParser(self.tokenizer, self.context_length, self.vocab_size)
            self.request_parser.vision = (
                VisionPrep(self.model_path, self.model.config) if is_vlm_config(self.model.config) else None
            )
            self.eos_ids = eos_ids(self.model, self.tokenizer)
            self._params = dict(self.model.state_dict(keep_vars=True))  # tied names alias one Parameter
            self._lora = LoraSlots(self.model)
            self._lora_draining: set[str] = set()  # adapters being unloaded: no new requests
            from miles_platform.models.moe import RoutingReplay

            self._routes = RoutingReplay.of(self.model)  # MoE: return_routed_experts (None: dense)
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

    def running(self) -> list[RunningRequest]:
        """The running batch, in batch order: exact inside `step_hook`; from another thread a snapshot
        that may be a step old."""
        return [RunningRequest(r.rid, r.lora, len(r.output_ids)) for r in list(self._batch.reqs)]

    def served_loras(self) -> list[str]:
        """The LoRA adapters a new request may name: loaded and not being unloaded."""
        return sorted(set(self._lora.adapters) - self._lora_draining)

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
        req = self.request_parser.make_request(
            input_ids, sampling_params, return_logprob, text, min_weight_version, exact_weight_version, rid,
            return_sampling_mask,
        )  # fmt: skip
        self._enqueue([req])
        return req.future

    def submit_json(
        self, body: dict, on_token: Callable[[int, Request], None] | None = None
    ) -> tuple[list[Future], bool]:
        """Parse an SGLang `/generate` body (single or batch); returns (futures, is_batch).
        `on_token(i, request)`: called on the scheduler thread after each token of prompt i
        (streaming; quick, it holds up the whole batch)."""
        reqs, is_batch = self.request_parser.parse_body(body)
        if on_token is not None:
            for i, r in enumerate(reqs):
                r.on_token = functools.partial(on_token, i)
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

    def _version_of(self, r: Request) -> int:
        """The policy version serving `r`: its adapter's (`lora_path`), else the base weights'."""
        if r.lora is None:
            return self._weight_version
        a = self._lora.adapters.get(r.lora)
        return a.version if a is not None else (r.version_start or 0)

    def _fail_unloaded(self, r: Request) -> None:
        if not r.future.done():
            r.future.set_exception(RequestError(f"lora_path {r.lora!r} was unloaded while the request ran"))

    def _drop_unloaded(self) -> None:
        b = self._batch
        keep = [i for i, r in enumerate(b.reqs) if r.lora is None or r.lora in self._lora.adapters]
        if len(keep) != len(b):
            for i in set(range(len(b))) - set(keep):
                self._fail_unloaded(b.reqs[i])
            self._batch = keep_rows(b, keep, self.model.config)

    def pause_generation(self, mode: str = "abort") -> None:
        """abort: finish in-flight and queued requests with finish_reason abort; retract: drop their KV
        and requeue them (recomputed after continue); in_place: freeze them with their KV cache."""
        if mode not in ("abort", "retract", "in_place"):
            raise RequestError(f"pause_generation mode={mode!r}: must be one of abort, retract, in_place")
        with self._step_lock:
            with self._cv:
                if not self._paused:
                    self._paused_at = time.monotonic()
                self._paused = True
                self.stats["num_pauses"] += 1
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
                self._batch = Batch()

    def continue_generation(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def flush_cache(self) -> bool:
        """No prefix cache is kept between requests, so there is nothing to flush."""
        return True

    def num_inflight(self) -> int:
        return len(self._waiting) + len(self._batch)

    def num_queued(self) -> int:
        return len(self._waiting)

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
            self._batch = Batch()

    def _enqueue(self, reqs: list[Request]) -> None:
        with self._cv:
            if self._stopping:
                raise EngineStopped("engine stopped")
            if self._released:
                raise MemoryReleased(self.memory_released)
            if self._paused:
                self._check_room(reqs)
            for r in reqs:
                if r.lora is not None and (
                    r.lora not in self._lora.adapters or r.lora in self._lora_draining
                ):
                    raise RequestError(
                        f"lora_path {r.lora!r} is not loaded (loaded: {self.served_loras()}); "
                        "POST /load_lora_adapter first"
                    )
                if r.return_routed_experts and self._routes is None:
                    raise RequestError("return_routed_experts: the served model is dense (no MoE router)")
                why = version_violation(r, self._version_of(r))
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

    # ---- pause bounds ------------------------------------------------------------------------------

    def _check_room(self, reqs: list[Request]) -> None:
        """Under `_cv`, paused: refuse the whole submission when it would queue more than
        `pause_max_queued_requests` (requests that finish at once take no room)."""
        queued = sum(not (r.max_new_tokens == 0 and not r.scores_input) for r in reqs)
        if queued and len(self._waiting) + queued > self.pause_max_queued_requests:
            self.stats["num_pause_queue_full"] += queued
            paused_for = time.monotonic() - self._paused_at
            raise EnginePaused(
                f"the engine has been paused for {paused_for:.1f} s and {len(self._waiting)} requests "
                f"already wait for /continue_generation (--pause-max-queued-requests "
                f"{self.pause_max_queued_requests}); retry later",
                paused_for,
            )

    def _held_since(self, r: Request) -> float:
        """When `r` started waiting on the pause in force: its arrival, or the pause if it came first."""
        return max(r.created, self._paused_at)

    def _pause_wait_left(self) -> float | None:
        """Under `_cv`: seconds until the first request the pause holds runs out of patience (None:
        not paused, or it holds none). The queue is in arrival order (retracted requests, held since
        the pause, at its head) and batch rows are held since the pause, so the head is the first."""
        if not self._paused or not (self._waiting or len(self._batch)):
            return None
        first = self._paused_at if len(self._batch) else self._held_since(self._waiting[0])
        return first + self.pause_wait_timeout_s - time.monotonic()

    def _expire_paused(self) -> None:
        """On the scheduler thread: fail every request the pause has held for `pause_wait_timeout_s`
        (queued or frozen in the batch) with EnginePaused."""
        with self._step_lock, self._cv:
            if not self._paused:
                return
            now = time.monotonic()
            limit, expired = self.pause_wait_timeout_s, []
            while self._waiting and now - self._held_since(self._waiting[0]) >= limit:
                expired.append(self._waiting.popleft())
            if len(self._batch) and now - self._paused_at >= limit:  # rows admitted before the pause
                expired += self._batch.reqs
                self._batch = Batch()
            paused_for = now - self._paused_at
            msg = (
                f"the engine has been paused for {paused_for:.1f} s (no /continue_generation within "
                f"--pause-wait-timeout-s {limit:g}); retry once it continues"
            )
            for r in expired:
                if not r.future.done():
                    self.stats["num_pause_timeouts"] += 1
                    r.future.set_exception(EnginePaused(msg, paused_for))
        if expired:
            log.warning(
                "engine paused for %.1f s: %d waiting requests failed (503)", paused_for, len(expired)
            )

    # ---- scheduler ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while (
                    not self._stopping
                    and not self._control
                    and (self._paused or (not self._waiting and not len(self._batch)))
                ):
                    left = self._pause_wait_left()
                    if left is not None and left <= 0:
                        break
                    self._cv.wait(left)
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
            if self._paused:  # woken by the first held request's deadline
                self._expire_paused()
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
                    stepped = not self._paused and not self._stopping
                    if stepped:
                        self._step()
                if stepped and self.step_hook is not None:
                    self.step_hook(self)
            except Exception as e:  # a bug or OOM must fail the requests, not hang them
                log.exception("engine step failed")
                with self._step_lock:
                    for r in self._batch.reqs + self._admitting:  # a prefill that failed: its requests too
                        if not r.future.done():
                            r.future.set_exception(e)
                    self._batch, self._admitting = Batch(), []

    def _step(self) -> None:
        new = []
        with self._cv:
            while self._waiting and len(self._batch) + len(new) < self.max_batch_size:
                r = self._waiting.popleft()
                if r.lora is not None and r.lora not in self._lora.adapters:
                    self._fail_unloaded(r)
                    continue
                why = version_violation(r, self._version_of(r))
                if why:
                    self._fail_version(r, why)
                    continue
                fits = self._admit_within_kv(new, r)
                if fits is None:
                    self._fail_kv(r)
                elif not fits:  # waits at the head of the queue for the batch to shrink
                    self._waiting.appendleft(r)
                    break
                else:
                    new.append(r)
        self._drop_unloaded()
        self._admitting = new  # failed with the step if it raises before they join the batch
        if any(r.vision is not None for r in new):  # image prompts: rollout/engine_vlm.py
            generate_with_images(self, [r for r in new if r.vision is not None])
            new = [r for r in new if r.vision is None]
        scoring = [r for r in new if r.scores_input and r.input_meta is None]
        if scoring:  # prefill-only scoring (max_new_tokens 0) finishes here, without joining the batch
            self._score_inputs(scoring)
            new = [r for r in new if r.max_new_tokens > 0]
        if new:
            self._prefill(new)
        elif len(self._batch):
            self._decode()
        self._admitting = []

    @torch.no_grad()
    def _prefill(self, reqs: list[Request]) -> None:
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
        ids, mask = ids.to(self.device), mask.to(self.device)  # staged on the host, one copy each
        cache = new_cache(self.model.config)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        with self._recording(reqs) as rec:
            logits = self._forward(ids, mask, pos, cache, prefill=True, loras=[lo for lo, _ in unique])
        row = {c: i for i, c in enumerate(unique)}
        if rec is not None:  # MoE routes of every context token, per unique row -> each request
            routes = self._stack_routes(rec, len(unique), width)
            for r, c in zip(reqs, contexts, strict=True):
                if r.return_routed_experts:
                    r.routes = [routes[row[c], width - len(c[1]) :]]
        if len(unique) < len(reqs):
            inv = torch.tensor([row[c] for c in contexts], device=self.device)
            logits, mask = logits[inv], mask[inv]
            cache = reshaped_cache(cache, rows=inv)
            self.stats["num_shared_prefill_rows"] += len(reqs) - len(unique)
        first = set()
        for r, c in zip(reqs, contexts, strict=True):
            if r.version_start is None:
                r.version_start = self._version_of(r)
            if c in first:
                r.cached_tokens = len(c[1])
            first.add(c)
        new = Batch()
        new.reqs, new.cache, new.mask = reqs, cache, mask
        new.pos = torch.tensor([len(c) for _, c in contexts], device=self.device)
        start = len(self._batch)
        self._batch = merge_batches(self._batch, new, self.model.config)
        self._note_kv()
        self._advance(logits, rows=range(start, start + len(reqs)))

    def _score_inputs(self, reqs: list[Request]) -> None:
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

    def _finish_scored(self, reqs: list[Request], metas: list) -> None:
        self.stats["num_scored_requests"] += len(reqs)
        for r, meta in zip(reqs, metas, strict=True):
            r.input_meta, r.version_start = meta, self._version_of(r)
            if r.max_new_tokens == 0:
                self._finish(r, {"type": "length", "length": 0})

    @torch.no_grad()
    def _decode(self) -> None:
        self._fit_kv_for_decode()
        b = self._batch
        if not len(b):  # every row went back to the queue (or out) to stay in the KV budget
            return
        ids = torch.tensor([[r.output_ids[-1]] for r in b.reqs], device=self.device)
        b.mask = torch.cat([b.mask, torch.ones(len(b), 1, dtype=torch.long, device=self.device)], dim=1)
        self._note_kv()
        with self._recording(b.reqs) as rec:
            logits = self._forward(
                ids, b.mask, b.pos[:, None], b.cache, prefill=False, loras=[r.lora for r in b.reqs]
            )
        if rec is not None:
            routes = self._stack_routes(rec, len(b), 1)
            for i, r in enumerate(b.reqs):
                if r.return_routed_experts:
                    r.routes.append(routes[i])
        b.pos = b.pos + 1
        self._advance(logits, rows=range(len(b)))

    @contextlib.contextmanager
    def _recording(self, reqs):
        """Record MoE routes during a forward when a request of it asked (return_routed_experts)."""
        if self._routes is None or not any(r.return_routed_experts for r in reqs):
            yield None
            return
        with self._routes.record() as rec:
            yield rec

    @staticmethod
    def _stack_routes(rec: list, rows: int, width: int):
        """Per-layer [rows * width, k] indices -> int32 numpy [rows, width, num_layers, k]."""
        return torch.stack(rec, dim=1).reshape(rows, width, len(rec), -1).to("cpu", torch.int32).numpy()

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
            [p.min_p for p in ps], [r.seed for r in reqs], [r.position for r in reqs],
            [r.return_sampling_mask for r in reqs],
        )  # fmt: skip
        self.stats["num_generated_tokens"] += len(d.tokens)
        self.gen_rate.add(len(d.tokens))
        done, finished = set(), []
        for j, (i, r, t, lp) in enumerate(zip(rows, reqs, d.tokens, d.logprobs)):
            r.output_ids.append(t)
            r.logprobs.append(lp)
            if r.return_sampling_mask:
                r.supports.append(d.supports[j])
                support_row = r.sampling_logprobs_mode == "support"
                r.support_logprobs.append(d.support_row_logprobs[j] if support_row else d.support_logprobs[j])
            reason = self._finish_reason(r, t)
            if reason:
                finished.append((r, reason))
                done.add(i)
        self._record_extras(logits, reqs)
        stream_tokens(reqs)
        self._decode_texts([r for r, _ in finished])
        for r, reason in finished:
            self._finish(r, reason)
        if done:
            self._batch = keep_rows(b, [i for i in range(len(b)) if i not in done], self.model.config)

    def _record_extras(self, logits: torch.Tensor, reqs: list[Request]) -> None:
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

    def _decode_texts(self, reqs: list[Request]) -> None:
        """Detokenize the requests that finished in one step with one batch_decode per setting."""
        for skip in (True, False):
            todo = [r for r in reqs if r.text is None and r.params.skip_special_tokens is skip]
            if todo:
                texts = self.tokenizer.batch_decode([r.output_ids for r in todo], skip_special_tokens=skip)
                for r, text in zip(todo, texts, strict=True):
                    r.text = text

    def _finish_reason(self, r: Request, t: int) -> dict | None:
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

    def _finish(self, r: Request, reason: dict) -> None:
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
        if r.return_routed_experts and r.routes:
            import numpy as np

            from miles_platform.models.moe import encode_routes

            # SGLang's shape: (prompt + output - 1, num_layers, top_k); the last token was never fed
            n = len(r.prompt_ids) + len(r.output_ids) - 1
            meta["routed_experts"] = encode_routes(np.concatenate(r.routes)[:n])
        if r.return_sampling_mask:
            meta["output_token_sampling_mask"] = r.supports
            meta["output_token_sampling_logprobs"] = r.support_logprobs
        self.stats["num_finished_requests"] += 1
        self.stats["num_prompt_tokens"] += len(r.prompt_ids)
        r.future.set_result({"text": r.text, "output_ids": list(r.output_ids), "meta_info": meta})

    def _fail_version(self, r: Request, why: str) -> None:
        if not r.future.done():
            r.future.set_exception(VersionConflict(why, self._weight_version, r.min_version, r.exact_version))
