"""Fully async rollout (`--fully-async`): generation never waits for training.

A background thread keeps up to `--rollout-batch-size` prompt groups in flight against the
router and puts each finished, scored, filtered group into a bounded buffer. The trainer
drains `--rollout-batch-size` groups per step. Weight updates pause the engines
(`--pause-generation-mode retract|in_place`), so a group can span versions; its staleness is
the engine version minus the oldest `weight_version_start` in it, and
`--max-weight-staleness` drops groups that lag more.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time

from miles_platform.data.sample import Sample
from miles_platform.rollout import filter_hub, rm_hub
from miles_platform.rollout.manager import RolloutManager


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

    def start(self) -> AsyncRolloutWorker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def data_source_state(self) -> dict:
        with self._lock:
            return self.m.data_source.state_dict()

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
        prompt_ids = self.m.tok.encode(rec.prompt, add_special_tokens=False)
        seeds = [
            hash((self.cfg.seed, "async", self._seq, k)) % (2**31)
            for k in range(self.cfg.n_samples_per_prompt)
        ]
        group = (await self.m.agenerate_groups([rec], [prompt_ids], [seeds]))[0]
        for k, s in enumerate(group):  # provisional index until the trainer assigns rollout ids
            s.index = self._seq * len(group) + k
        await asyncio.to_thread(rm_hub.compute_rewards, self.cfg, group)
        kept, drops = filter_hub.apply_dynamic_filter(self.cfg, [group])
        for k, v in drops.items():
            self.drops[k] = self.drops.get(k, 0) + v
        while kept and not self._stop.is_set():
            try:
                await asyncio.to_thread(self.finished.put, group, True, 0.5)
                return
            except queue.Full:
                continue

    # ------------------------------------------------------------------ trainer side
    def get_rollout(self, rollout_id: int, engine_version: int) -> tuple[list[Sample], dict[str, float]]:
        """Drain `--rollout-batch-size` fresh-enough groups (blocking)."""
        t0, want, groups, stale = time.time(), self.cfg.rollout_batch_size, [], 0
        max_stale = self.cfg.max_weight_staleness
        staleness = []
        while len(groups) < want:
            if self._error is not None:
                raise RuntimeError(f"async rollout worker failed: {self._error}") from self._error
            self._drain_into_buffer()
            for g in self.m.take_from_buffer(rollout_id, want - len(groups)):
                s = engine_version - min(x.weight_version_start for x in g)
                if max_stale is not None and s > max_stale:
                    stale += 1
                    continue
                staleness.append(s)
                groups.append(g)
        samples = self.m.finalize(rollout_id, groups)
        drops = dict(self.drops)
        if stale:
            drops["staleness"] = drops.get("staleness", 0) + stale
        self.drops = {}
        metrics = self.m._metrics(samples, drops, time.time() - t0)
        metrics["rollout/staleness/mean"] = sum(staleness) / len(staleness)
        metrics["rollout/staleness/max"] = float(max(staleness))
        metrics["rollout/async_buffer_size"] = float(self.finished.qsize() + len(self.m.buffer))
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
