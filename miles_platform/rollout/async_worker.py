"""Fully async rollout (`--fully-async`): generation never waits for training.

A background thread keeps up to `--rollout-batch-size` prompt groups in flight against the
router and puts each finished, scored, filtered group into a bounded buffer. The trainer
drains `--rollout-batch-size` groups per step. Weight updates pause the engines
(`--pause-generation-mode retract|in_place`), so a group can span versions; its staleness is
the engine version minus the oldest `weight_version_start` in it, and
`--max-weight-staleness` filters groups that lag more; `--async-unused-samples-handler` drops
them (default) or puts their prompts back into the data source for regeneration (`retry`).

A checkpoint records the data-source position plus every prompt taken but not trained yet (in
flight, queued, buffered), which a resume serves first: no prompt is lost or trained twice.
Metrics follow Miles' `rollout/fully_async/*` names.
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
import threading
import time

from miles_platform.data.sample import Sample
from miles_platform.rollout import filter_hub
from miles_platform.rollout.manager import RolloutManager, record_of


class AsyncRolloutWorker:
    def __init__(self, manager: RolloutManager, capacity: int | None = None):
        self.m, self.cfg = manager, manager.cfg
        self.finished: queue.Queue[list[Sample]] = queue.Queue(
            maxsize=capacity or 2 * self.cfg.rollout_batch_size
        )
        self._stop = threading.Event()
        self._lock = threading.Lock()  # data source is shared with checkpointing
        self._error: BaseException | None = None
        self.drops: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="async-rollout", daemon=True)
        self._seq = 0
        self._inflight: dict[int, object] = {}  # seq -> PromptRecord being generated

    def start(self) -> AsyncRolloutWorker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def data_source_state(self) -> dict:
        """Position + every prompt taken and not trained (in flight, queued, in the buffer)."""
        with self._lock, self.finished.mutex:
            queued = [record_of(g) for g in self.finished.queue]
            unfinished = [*self._inflight.values(), *queued, *self.m.unfinished_records()]
            return self.m.data_source.state_dict(unfinished)

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # surfaced to the trainer in get_rollout
            self._error = e

    async def _main(self) -> None:
        inflight = max(1, self.cfg.rollout_batch_size)
        tasks: set[asyncio.Task] = set()
        while not self._stop.is_set():
            while len(tasks) < inflight and not self._stop.is_set():
                tasks.add(asyncio.create_task(self._one_group()))
            done, tasks = await asyncio.wait(tasks, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()
        for t in tasks:
            t.cancel()

    async def _one_group(self) -> None:
        """One group = one batched request (the run's connection pool, `RolloutManager.client`)."""
        with self._lock:
            rec = self.m.data_source.get_samples(1)[0]
            self._seq += 1
            seq = self._seq
            self._inflight[seq] = rec
        try:
            await self._generate(seq, rec)
        finally:
            with self._lock:
                self._inflight.pop(seq, None)

    async def _generate(self, seq: int, rec) -> None:
        prompt_ids = self.m.tok.encode(rec.prompt, add_special_tokens=False)
        seeds = [_seed(self.cfg.seed, seq, k) for k in range(self.cfg.n_samples_per_prompt)]
        group = (await self.m.agenerate_groups([rec], [prompt_ids], [seeds]))[0]
        for k, s in enumerate(group):  # provisional index until the trainer assigns rollout ids
            s.index = seq * len(group) + k
        await asyncio.to_thread(self.m._score, group)  # an agent's own reward stays
        kept, drops = filter_hub.apply_dynamic_filter(self.cfg, [group])
        for k, v in drops.items():
            self.drops[k] = self.drops.get(k, 0) + v
        while kept and not self._stop.is_set():
            try:
                # queued and no longer in flight in one step (a checkpoint sees it exactly once)
                await asyncio.to_thread(self._put, seq, group)
                return
            except queue.Full:
                continue

    def _put(self, seq: int, group) -> None:
        """Queue the group and retire it from in-flight atomically (under the checkpoint lock);
        raises queue.Full after ~0.5 s of a full queue."""
        deadline = time.monotonic() + 0.5
        while True:
            with self._lock:
                try:
                    self.finished.put_nowait(group)
                    self._inflight.pop(seq, None)
                    return
                except queue.Full:
                    if time.monotonic() > deadline:
                        raise
            time.sleep(0.02)

    # ------------------------------------------------------------------ trainer side
    def get_rollout(self, rollout_id: int, engine_version: int) -> tuple[list[Sample], dict[str, float]]:
        """Drain `--rollout-batch-size` fresh-enough groups (blocking)."""
        t0, want, groups, stale = time.time(), self.cfg.rollout_batch_size, [], 0
        max_stale = self.cfg.max_weight_staleness
        oldest, newest, span = [], [], []
        while len(groups) < want:
            if self._error is not None:
                raise RuntimeError(f"async rollout worker failed: {self._error}") from self._error
            self._drain_into_buffer()
            for g in self.m.take_from_buffer(rollout_id, want - len(groups)):
                lo = min(x.weight_version_start for x in g)
                hi = max(x.weight_version_end for x in g)
                if max_stale is not None and engine_version - lo > max_stale:
                    stale += 1
                    if self.cfg.async_unused_samples_handler == "retry":
                        with self._lock:
                            self.m.data_source.put_back([record_of(g)])
                    continue
                oldest.append(engine_version - lo)
                newest.append(engine_version - hi)
                span.append(hi - lo)
                groups.append(g)
        samples = self.m.finalize(rollout_id, groups)
        drops = dict(self.drops)
        if stale:
            drops["staleness"] = drops.get("staleness", 0) + stale
        self.drops = {}
        metrics = self.m._metrics(samples, drops, time.time() - t0)
        tokens = [sum(len(s.response_tokens) for s in g) for g in groups]
        buffered = [engine_version - min(x.weight_version_start for x in g) for g in self.m.buffer]
        f = "rollout/fully_async/"
        metrics |= {
            f + "queue_size": float(self.finished.qsize() + len(self.m.buffer)),
            f + "stale_groups_filtered": float(stale),
            f + "avg_staleness": sum(oldest) / len(oldest),
            f + "max_staleness": float(max(oldest)),
            f + "avg_post_generation_staleness": sum(newest) / len(newest),
            f + "max_post_generation_staleness": float(max(newest)),
            f + "avg_generation_version_span": sum(span) / len(span),
            f + "max_generation_version_span": float(max(span)),
            f + "token_weighted_staleness": sum(o * t for o, t in zip(oldest, tokens)) / max(sum(tokens), 1),
            f + "buffer_avg_staleness": sum(buffered) / len(buffered) if buffered else 0.0,
            f + "buffer_max_staleness": float(max(buffered, default=0)),
        }
        return samples, metrics

    def _drain_into_buffer(self) -> None:
        """Move finished groups from the worker's queue into the manager's buffer (waits for one if empty)."""
        if not self.m.buffer:
            try:
                self.m.buffer.append(self.finished.get(timeout=0.5))
            except queue.Empty:
                return
        while True:
            try:
                self.m.buffer.append(self.finished.get_nowait())
            except queue.Empty:
                return


def _seed(run_seed: int, seq: int, k: int) -> int:
    """Sample k of the seq-th group: stable across processes (no PYTHONHASHSEED-dependent hash)."""
    digest = hashlib.blake2b(f"{run_seed}/async/{seq}/{k}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % (2**31)
