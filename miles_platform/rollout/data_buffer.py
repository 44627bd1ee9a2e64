"""The fully async data buffer (Miles' `fully_async_data_buffer.py`): the store of finished groups
between the rollout worker and the trainer, and every group-level decision with it.

`DataBuffer` is the contract the worker and the trainer see, nothing else:

    put(input)                           the worker, once per finished group: store it or reject it
    get(num_groups, current_version)     the trainer, once per rollout: that many groups, waiting for them
    get_metrics(trainer_model_id=None)   the trainer, once per rollout: what the buffer did since the last call
    state_dict() / load_state_dict(s)    checkpoint save / load: every accepted entry, JSON-serializable

`DefaultDataBuffer` is the built-in one; `--custom-async-data-buffer-path <module>.<Class>` replaces
it with a subclass of `DataBuffer`, built as `Class(DataBufferConstructorInput)`. The flags of the
default (capacity, staleness, the unused-samples handler, the dynamic filter) apply to a custom
buffer only if it reads them from `input.args`.

Threads: `put` runs on the worker's side and `get` / `state_dict` on the trainer's, concurrently,
so an implementation guards its store with a lock. `put` may block (a full buffer); `close()` (at
the end of the run) should wake it. `stored_uids(state)` tells a checkpoint which entries a state
holds, so a group whose `put` is still running is saved once: in the buffer's state, or else with
the worker's finished groups (the default answers it; a custom buffer that does not may have such
a group saved twice).
"""

from __future__ import annotations

import dataclasses
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles_platform.data.dataset import PromptRecord
from miles_platform.data.sample import Sample, Status
from miles_platform.rollout import filter_hub

PREFIX = "rollout/fully_async/"
# what generation adds to a sample's metadata (--partial-rollout): not the prompt's, so never put back with it
GENERATION_KEYS = ("sampling_seed", "weight_versions", "weight_version_offsets", "start_rollout_id")


@dataclass(frozen=True)
class DataBufferConstructorInput:
    args: Any  # the RunConfig: Miles' flag names as attributes
    unused_handler_fn: Callable[[DataBufferInput], None]  # --async-unused-samples-handler on one entry


@dataclass
class DataBufferInput:
    prompt: PromptRecord  # what the group answers: --async-unused-samples-handler retry serves it again
    group: list[Sample]  # the finished, scored samples
    uid: int = 0  # the worker's number for the group (unique in the run)


class BufferClosed(RuntimeError):
    """The run is ending: a blocked put or get gives up."""


class DataBuffer(ABC):
    """Store of finished groups between fully async generation and training (module docstring)."""

    @abstractmethod
    def put(self, input: DataBufferInput) -> None:
        """Accept a finished group: store it (blocking while full) or reject it."""

    @abstractmethod
    def get(self, num_groups: int, current_version: int | None = None) -> list[DataBufferInput]:
        """`num_groups` groups to train on, waiting until the buffer holds them."""

    @abstractmethod
    def get_metrics(self, trainer_model_id: str | None = None) -> dict[str, float]:
        """Metrics since the previous call (Miles' `rollout/fully_async/*`); window counters reset."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Every accepted entry needed to resume without loss or duplication (JSON-serializable)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the buffer's state with one `state_dict` returned."""

    def stored_uids(self, state: dict[str, Any]) -> set[int]:
        """The uids of the entries a `state_dict()` result holds (none known by default)."""
        return set()

    def close(self) -> None:
        """The run ends: wake a blocked put or get (they raise BufferClosed or return)."""
        return None


class DefaultDataBuffer(DataBuffer):
    """FIFO of finished groups, filtering what training should not see (Miles' DefaultDataBuffer).

    On put (fixed once generated): an aborted group goes to --async-unused-samples-handler
    (`aborted_groups_filtered`); a group --dynamic-sampling-filter-path rejects is dropped
    (`rollout/dynamic_filter/drop_<reason>`). On get (depends on the wait): a group whose oldest
    weight version lags `current_version` by more than --max-weight-staleness goes to the handler
    (`stale_groups_filtered`). Capacity: floor(--async-data-buffer-capacity-factor x
    --rollout-batch-size) groups; a put into a full buffer blocks until the trainer takes some."""

    def __init__(self, input: DataBufferConstructorInput):
        args = self.args = input.args
        self.capacity = max(1, int(args.async_data_buffer_capacity_factor * args.rollout_batch_size))
        self._handle_unused = input.unused_handler_fn
        self._dynamic_filter = filter_hub.load_dynamic_filter(args)
        self._entries: list[DataBufferInput] = []
        self._cond = threading.Condition()
        self._closed = False
        self._version: int | None = None
        self._aborted = self._stale = 0
        self._drops: dict[str, int] = {}

    def put(self, input: DataBufferInput) -> None:
        if any(s.status == Status.ABORTED.value for s in input.group):
            with self._cond:
                self._aborted += 1
            self._handle_unused(input)
            return
        out = filter_hub.call_dynamic_filter(self._dynamic_filter, self.args, input.group)
        if not out.keep:  # no usable gradient signal: dropped, never retried
            reason = out.reason or "unspecified"
            with self._cond:
                self._drops[reason] = self._drops.get(reason, 0) + 1
            return
        with self._cond:
            while len(self._entries) >= self.capacity and not self._closed:
                self._cond.wait()
            if self._closed:
                return
            self._entries.append(input)
            self._cond.notify_all()

    def get(self, num_groups: int, current_version: int | None = None) -> list[DataBufferInput]:
        if current_version is not None:
            self._version = current_version
        bound, out = self.args.max_weight_staleness, []
        while len(out) < num_groups:
            with self._cond:
                while not self._entries and not self._closed:
                    self._cond.wait()
                if self._closed:
                    raise BufferClosed("the fully async data buffer was closed")
                entry = self._entries.pop(0)
                self._cond.notify_all()  # a producer blocked on a full buffer
                lag = staleness(entry.group, current_version)
                stale = bound is not None and lag is not None and lag > bound
                self._stale += stale
            if stale:
                self._handle_unused(entry)
            else:
                out.append(entry)
        return out

    def get_metrics(self, trainer_model_id: str | None = None) -> dict[str, float]:
        with self._cond:
            lags = [x for e in self._entries if (x := staleness(e.group, self._version)) is not None]
            m = {
                PREFIX + "queue_size": float(len(self._entries)),
                PREFIX + "aborted_groups_filtered": float(self._aborted),
                PREFIX + "stale_groups_filtered": float(self._stale),
                PREFIX + "buffer_avg_staleness": sum(lags) / len(lags) if lags else 0.0,
                PREFIX + "buffer_max_staleness": float(max(lags, default=0)),
            }
            m.update({k: float(v) for k, v in filter_hub.drop_metrics(self._drops).items()})
            self._aborted = self._stale = 0
            self._drops = {}
        return m

    def state_dict(self) -> dict[str, Any]:
        with self._cond:
            return {"entries": [entry_to_json(e) for e in self._entries]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._cond:
            self._entries = [entry_from_json(e) for e in state.get("entries", [])]
            self._cond.notify_all()

    def stored_uids(self, state: dict[str, Any]) -> set[int]:
        return {int(e["uid"]) for e in state.get("entries", [])}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def staleness(group: list[Sample], current_version: int | None) -> int | None:
    """The engine version minus the group's oldest weight version (None without a version)."""
    if current_version is None or not group:
        return None
    return current_version - min(s.weight_version_start for s in group)


def record_of(group: list[Sample]) -> PromptRecord:
    """The prompt a group answers (as the data source handed it out)."""
    s = group[0]
    meta = {k: v for k, v in s.metadata.items() if k not in GENERATION_KEYS}
    pid = meta.pop("prompt_id", None)
    return PromptRecord(
        id=str(pid), prompt=s.prompt, label=s.label, metadata=meta, images=list(s.image_data or [])
    )


def entry_to_json(e: DataBufferInput) -> dict[str, Any]:
    """A buffered group as JSON (trainer_state.json): its prompt, uid and samples as shard rows."""
    rows = []
    for s in e.group:
        row = s.to_row()
        row.pop("image_png", None)  # diffusion only, never in a rollout group
        rows.append(row)
    return {"uid": e.uid, "prompt": dataclasses.asdict(e.prompt), "samples": rows}


def entry_from_json(d: dict[str, Any]) -> DataBufferInput:
    prompt = PromptRecord(**d["prompt"])
    group = [Sample.from_row(r) for r in d["samples"]]
    for s in group:  # a shard row names its images by hash; the prompt holds them (image prompts)
        s.image_data = list(prompt.images) or None
    return DataBufferInput(prompt=prompt, group=group, uid=int(d["uid"]))


def build_data_buffer(cfg, unused_handler_fn) -> DataBuffer:
    """The run's buffer: --custom-async-data-buffer-path's class, else DefaultDataBuffer."""
    cls = load_buffer_class(cfg) or DefaultDataBuffer
    return cls(DataBufferConstructorInput(args=cfg, unused_handler_fn=unused_handler_fn))


def load_buffer_class(cfg) -> type[DataBuffer] | None:
    """--custom-async-data-buffer-path: a DataBuffer subclass, checked (ConfigError naming the flag)."""
    path = getattr(cfg, "custom_async_data_buffer_path", None)
    if not path:
        return None
    from miles_platform.config import ConfigError
    from miles_platform.plugins import load_object

    flag = "--custom-async-data-buffer-path"
    cls = load_object(path, flag)
    if not (isinstance(cls, type) and issubclass(cls, DataBuffer)):
        raise ConfigError(
            f"{flag} {path!r}: expected a subclass of miles_platform.rollout.data_buffer.DataBuffer "
            f"(put / get / get_metrics / state_dict / load_state_dict), got {cls!r}"
        )
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise ConfigError(f"{flag} {path!r}: {cls.__name__} does not implement {', '.join(missing)}")
    return cls
