"""The embedded engine's memory: the KV budget (SGLang's --mem-fraction-static) and SGLang's
`/release_memory_occupation` / `/resume_memory_occupation` for colocated runs.

KV budget. SGLang sizes a static pool for weights + KV cache at `mem_fraction_static` of the GPU.
Here the KV cache is the running batch's left-padded `[rows, columns]` cache, so the bound is on
rows x columns: `kv_budget_tokens` = (fraction x device memory - weight bytes) / KV bytes per token.
The scheduler admits a waiting request only if the batch still fits with it, one decode column
included; before a decode step that would overflow, the newest rows go back to the head of the queue
(SGLang's retract: they are prefilled again, prompt and output, once the batch has room). A request
whose context alone does not fit fails (HTTP 400). Sampling is keyed by (seed, position), so a
retracted request draws the same tokens it would have.

Release / resume (tags "weights", "kv_cache"; SGLang's "cuda_graph" is accepted and holds nothing
here). Release needs an idle engine (no running or queued request: Miles releases after a rollout
and pauses first): "kv_cache" drops the running batch's cache, "weights" moves every parameter
(LoRA adapters stay) to host memory, and the device's caching allocator hands the freed blocks back.
While anything is released, /generate answers 503 (retryable); while the weights are, weight
updates and reads are refused (Miles resumes the weights, updates them, then resumes the KV cache);
resume puts the weights back on the device bit for bit.
"""

from __future__ import annotations

import torch

from miles_platform.cluster.devices import empty_cache, total_memory
from miles_platform.errors import ConfigError
from miles_platform.models.mla_cache import cache_values_per_token
from miles_platform.rollout.engine_batch import Batch, keep_rows
from miles_platform.rollout.engine_requests import EnginePaused, RequestError

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Keys and values of one token over every layer, in the serving dtype (MLA: the compressed latent
    and rope key, plus DeepSeek-V3.2's indexer key, models/mla_cache.py; linear-attention layers,
    whose state does not grow, are counted as attention layers: an upper bound)."""
    if getattr(config, "kv_lora_rank", None):  # MLA
        per_layer = sum(v for k, v in cache_values_per_token(config).items() if k != "decompressed")
        return int(config.num_hidden_layers) * per_layer * torch.finfo(dtype).bits // 8
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    k_dim, v_dim = (
        getattr(config, "qk_head_dim", None) or head_dim,
        getattr(config, "v_head_dim", None) or head_dim,
    )
    return int(config.num_hidden_layers) * int(heads) * int(k_dim + v_dim) * torch.finfo(dtype).bits // 8


def kv_budget_tokens(model, device: torch.device, fraction: float | None) -> int | None:
    """Tokens the KV cache may hold under `fraction` of `device`'s memory (None: no bound)."""
    if fraction is None:
        return None
    if not 0 < fraction <= 1:
        raise ConfigError(f"--sglang-mem-fraction-static {fraction!r}: must be in (0, 1]")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    total = total_memory(device)
    room = fraction * total - weights
    per_token = kv_bytes_per_token(model.config, next(model.parameters()).dtype)
    if room < per_token:
        raise ConfigError(
            f"--sglang-mem-fraction-static {fraction}: {fraction * total / 2**30:.2f} GiB of {device}'s "
            f"{total / 2**30:.2f} GiB leaves no room for the KV cache after the weights "
            f"({weights / 2**30:.2f} GiB); raise it"
        )
    return int(room // per_token)


class MemoryReleased(EnginePaused):
    """The engine's memory is released (colocated run, trainer training): retry after resume."""

    def __init__(self, released: list[str]):
        super().__init__(
            f"the engine released its {' and '.join(released)} (/release_memory_occupation); retry once "
            "/resume_memory_occupation has run",
            0.0,
        )
        self.info["type"] = "memory_released"


class EngineMemoryMixin:
    """EngineCore's KV budget and release / resume. Uses the core's `model`, `device`, `kv_budget`,
    `_batch`, `_waiting`, `_cv`, `_step_lock`, `stats`, `_in_scheduler`, `_finish`."""

    _released: frozenset = frozenset()

    # ---- KV budget ------------------------------------------------------------------------------

    def _kv_fits(self, rows: int, columns: int) -> bool:
        return self.kv_budget is None or rows * columns <= self.kv_budget

    def _admit_within_kv(self, new: list, r) -> bool | None:
        """Whether `r` joins this step's prefill (with `new`) and the running batch in the KV budget,
        one decode column included: True, False (wait for room) or None (it can never fit)."""
        if self.kv_budget is None:
            return True
        width = self._batch.mask.shape[1] if len(self._batch) else 0
        width = max([width] + [len(x.prompt_ids) + len(x.output_ids) for x in (*new, r)])
        if self._kv_fits(len(self._batch) + len(new) + 1, width + 1):
            return True
        return None if len(self._batch) + len(new) == 0 else False

    def _fail_kv(self, r) -> None:
        n = len(r.prompt_ids) + len(r.output_ids)
        if not r.future.done():
            r.future.set_exception(
                RequestError(
                    f"a context of {n} tokens does not fit the KV cache budget of {self.kv_budget} tokens "
                    "(--sglang-mem-fraction-static); shorten the prompt or raise the fraction"
                )
            )

    def _fit_kv_for_decode(self) -> None:
        """Before a decode step: send the newest rows back to the queue (or fail a lone row that
        cannot grow) until the batch plus one column fits the budget."""
        b = self._batch
        if self.kv_budget is None or not len(b):
            return
        keep = list(range(len(b)))
        width = b.mask.shape[1]
        while keep and not self._kv_fits(len(keep), width + 1):
            i = keep.pop()
            r = b.reqs[i]
            if not keep:  # alone and still too long: SGLang aborts it too
                self._finish(r, {"type": "abort", "message": f"the KV cache budget of {self.kv_budget} "
                                 "tokens is full (--sglang-mem-fraction-static)"})  # fmt: skip
                continue
            with self._cv:
                self._waiting.appendleft(r)
            self.stats["num_kv_retractions"] += 1
        if len(keep) != len(b):
            self._batch = keep_rows(b, keep, self.model.config)

    def kv_tokens_used(self) -> int:
        """KV cache slots the running batch holds now (rows x columns, padding included)."""
        b = self._batch  # one object: its rows and mask agree even while the scheduler swaps batches
        return len(b) * b.mask.shape[1] if len(b) and b.mask is not None else 0

    def _note_kv(self) -> None:
        b = self._batch
        if len(b):
            s = self.stats
            s["max_kv_tokens_seen"] = max(s["max_kv_tokens_seen"], len(b) * b.mask.shape[1])

    # ---- release / resume (SGLang's memory occupation API) ---------------------------------------

    @property
    def memory_released(self) -> list[str]:
        return sorted(self._released)

    def _check_not_released(self, what: str) -> None:
        """Weight updates and reads need the weights on the device (a released KV cache is no matter)."""
        if "weights" in self._released:
            raise RequestError(f"{what}: the engine's weights are released; resume them first")

    def release_memory_occupation(self, tags: list[str] | None = None) -> list[str]:
        """Release `tags` (default: all); returns what is released now."""
        tags = _parse_tags(tags)

        def release():
            with self._step_lock:
                with self._cv:
                    busy = len(self._waiting) + len(self._batch)
                if busy:
                    raise RequestError(
                        f"release_memory_occupation: {busy} requests are running or queued; let them finish "
                        "or /pause_generation (abort or retract) first"
                    )
                if "kv_cache" in tags:
                    self._batch = Batch()
                if "weights" in tags and "weights" not in self._released:
                    self.model.to(
                        "cpu"
                    )  # the base weights, tied ones once; self._params keep pointing at them
                new = (set(tags) & {"weights", "kv_cache"}) - self._released
                self._released = self._released | new
                self.stats["num_memory_releases"] += bool(new)
                empty_cache(self.device)
            return self.memory_released

        return self._in_scheduler(release)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> list[str]:
        """Resume `tags` (default: all); returns what is still released."""
        tags = _parse_tags(tags)

        def resume():
            with self._step_lock:
                if "weights" in tags and "weights" in self._released:
                    self.model.to(self.device)
                self._released = self._released - set(tags)
            with self._cv:
                self._cv.notify_all()
            return self.memory_released

        return self._in_scheduler(resume)


def _parse_tags(tags) -> list[str]:
    if tags is None:
        return list(MEMORY_TAGS)
    if isinstance(tags, str):
        tags = [tags]
    if not isinstance(tags, list) or not all(t in MEMORY_TAGS for t in tags):
        raise RequestError(f"tags {tags!r}: a list of {', '.join(MEMORY_TAGS)} (or none: all of them)")
    return tags
