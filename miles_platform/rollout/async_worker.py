"""Fully async rollout (`--fully-async`): generation never waits for training.

A background thread keeps prompt groups in flight against the router and puts each finished,
scored group into the run's data buffer (rollout/data_buffer.py: `DefaultDataBuffer`, or
--custom-async-data-buffer-path); the trainer gets `--rollout-batch-size` groups per rollout from
it. In flight: `--rollout-batch-size` groups, or `--async-max-concurrent-samples // n` with that
flag. `--rollout-submission-granularity` decides what frees a submission slot: `sample` (the
default here) frees one per finished trajectory, and a new group goes out once n are free;
`group` holds the group's n slots until the whole group returns. On the embedded engines the groups
that can go out together are one streamed request (each sample's result sent as it finishes): one
HTTP request and one prefill, not one per sample. A full buffer blocks the
worker (no new submissions) until the trainer takes groups. Weight updates pause the engines
(`--pause-generation-mode retract|in_place`), so a group can span versions; its staleness is the
engine version minus the oldest `weight_version_start` in it.

A checkpoint records the data-source position with the prompts in flight (served first on
resume: regenerated), the buffer's state and the groups generated but not yet accepted by it
(restored as they are: a buffered group is never generated twice). Metrics follow Miles'
`rollout/fully_async/*` names.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from typing import Any

from miles_platform.data.dataset import PromptRecord
from miles_platform.data.sample import Sample
from miles_platform.rollout.data_buffer import (
    PREFIX,
    DataBufferInput,
    build_data_buffer,
    entry_from_json,
    entry_to_json,
)
from miles_platform.rollout.manager import RolloutManager


class _Stopped(Exception):
    pass


class AsyncRolloutWorker:
    def __init__(self, manager: RolloutManager, state: dict[str, Any] | None = None):
        self.m, self.cfg = manager, manager.cfg
        c = self.cfg
        self.n = c.n_samples_per_prompt
        self.max_inflight_groups = (
            max(1, c.async_max_concurrent_samples // self.n)
            if c.async_max_concurrent_samples is not None
            else c.rollout_batch_size
        )
        self.granularity = c.rollout_submission_granularity or "sample"
        self._stop = threading.Event()
        self._lock = threading.Lock()  # in-flight / finished bookkeeping and the data source
        self._error: BaseException | None = None
        self.drops: dict[str, int] = {}  # --rollout-max-prompt-len rejects
        self._thread = threading.Thread(target=self._run, name="async-rollout", daemon=True)
        self._seq = 0
        self._inflight: dict[int, PromptRecord] = {}  # uid -> prompt being generated
        self._finished: dict[int, DataBufferInput] = {}  # generated, not accepted by the buffer yet
        self.buffer = build_data_buffer(c, self._unused)
        if state:
            self.load_state_dict(state)

    def start(self) -> AsyncRolloutWorker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.buffer.close()
        self._thread.join(timeout=60)

    # ------------------------------------------------------------------ checkpoint
    def checkpoint_state(self) -> tuple[dict, dict]:
        """(data-source state, worker state) at one instant: the position with the prompts in flight;
        the buffer's state; the finished groups it does not hold yet; the group counter."""
        with self._lock:
            buf = self.buffer.state_dict()
            stored = self.buffer.stored_uids(buf)
            finished = [entry_to_json(e) for uid, e in sorted(self._finished.items()) if uid not in stored]
            ds = self.m.data_source.state_dict(list(self._inflight.values()))
            return ds, {"buffer": buf, "finished": finished, "seq": self._seq}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state.get("buffer", {}))
        self._seq = int(state.get("seq", 0))
        self._finished = {e.uid: e for e in map(entry_from_json, state.get("finished", []))}

    def _unused(self, entry: DataBufferInput) -> None:
        """--async-unused-samples-handler on an aborted or too stale group: drop it, or retry (its
        prompt back into the data source), in one step with the bookkeeping a checkpoint reads."""
        with self._lock:
            self._finished.pop(entry.uid, None)
            if self.cfg.async_unused_samples_handler == "retry":
                self.m.data_source.put_back([entry.prompt])

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except _Stopped:
            pass
        except BaseException as e:  # surfaced to the trainer in get_rollout
            self._error = e
            self.buffer.close()

    async def _main(self) -> None:
        n, tasks, streams = self.n, set(), set()
        self._free = self.max_inflight_groups * n  # submission slots, in trajectories
        self._freed = asyncio.Event()
        for uid in sorted(self._finished):  # restored from a checkpoint: offered first
            await self._put(self._finished[uid])
        try:
            while not self._stop.is_set():
                ready = []
                while self._free >= n and not self._stop.is_set():
                    ready.append(self._next_prompt())
                    self._free -= n
                if ready and self.granularity == "sample" and self.m.streams:
                    tasks |= self._stream_groups(ready, streams)
                else:
                    tasks |= {asyncio.create_task(self._generate(uid, rec)) for uid, rec in ready}
                self._freed.clear()
                waiter = asyncio.create_task(self._freed.wait())
                done, _ = await asyncio.wait(
                    {*tasks, waiter}, timeout=0.2, return_when=asyncio.FIRST_COMPLETED
                )
                waiter.cancel()
                for t in done - {waiter}:
                    tasks.discard(t)
                    await self._put(t.result())  # a full buffer blocks submission here
        except _Stopped:
            pass
        finally:
            for t in tasks | streams:
                t.cancel()

    def _next_prompt(self) -> tuple[int, PromptRecord]:
        """The next prompt within --rollout-max-prompt-len (longer ones counted as drop_prompt_too_long)."""
        limit, tried = self.cfg.rollout_max_prompt_len, 0
        with self._lock:
            while True:
                rec = self.m.data_source.get_samples(1)[0]
                if not limit or self.m.prompt_len(rec) <= limit:
                    break
                self.drops["prompt_too_long"] = self.drops.get("prompt_too_long", 0) + 1
                tried += 1
                if tried > 2 * len(self.m.data_source):
                    raise RuntimeError(
                        f"every prompt of the data is longer than --rollout-max-prompt-len {limit} tokens"
                    )
            self._seq += 1
            self._inflight[self._seq] = rec
            return self._seq, rec

    def _release(self, slots: int) -> None:
        self._free += slots
        self._freed.set()

    def _stream_groups(self, ready: list[tuple[int, PromptRecord]], streams: set) -> set:
        """`sample` on the embedded engines: the groups that can go out now as one streamed request
        (prefilled together), a slot freed as each sample finishes; one task per group, done when
        its n samples are in (then scored, as `_generate`'s)."""
        m, n, loop = self.m, self.n, asyncio.get_running_loop()
        recs = [rec for _, rec in ready]
        seeds = [[_seed(self.cfg.seed, uid, k) for k in range(n)] for uid, _ in ready]
        groups: list[list] = [[None] * n for _ in ready]
        left, done = [n] * len(ready), [loop.create_future() for _ in ready]

        def on_sample(gi: int, k: int, sample: Sample) -> None:
            groups[gi][k] = sample
            left[gi] -= 1
            self._release(1)
            if not left[gi] and not done[gi].done():  # (cancelled with its group task: stopping)
                done[gi].set_result(groups[gi])

        async def stream() -> None:
            try:
                await m.agenerate_groups_streamed(recs, [m._prompt_ids(r) for r in recs], seeds, on_sample)
            except BaseException as e:  # every group still waiting fails with it (the worker's error)
                for f in done:
                    if not f.done():
                        f.set_exception(e if isinstance(e, Exception) else _Stopped())
                raise
            finally:
                self._release(sum(left))  # the slots of samples that never came

        task = asyncio.create_task(stream())
        streams.add(task)
        task.add_done_callback(lambda t: (streams.discard(t), t.cancelled() or t.exception()))

        async def group(uid: int, rec: PromptRecord, fut: asyncio.Future) -> DataBufferInput:
            return await self._entry(uid, rec, await fut)

        return {asyncio.create_task(group(uid, rec, f)) for (uid, rec), f in zip(ready, done, strict=True)}

    async def _generate(self, uid: int, rec: PromptRecord) -> DataBufferInput:
        """One group: `sample` frees a slot as each sample finishes (n requests: a generate function
        or SGLang engines; the embedded ones stream: `_stream_groups`), `group` frees the n slots
        when the whole group returns."""
        m, n = self.m, self.n
        prompt_ids = m._prompt_ids(rec)  # images: their pads expanded
        seeds = [_seed(self.cfg.seed, uid, k) for k in range(n)]
        if self.granularity == "sample":

            async def one(seed: int) -> Sample:
                try:
                    return (await m.agenerate_groups([rec], [prompt_ids], [[seed]]))[0][0]
                finally:
                    self._release(1)

            group = list(await asyncio.gather(*(one(s) for s in seeds)))
        else:
            try:
                group = (await m.agenerate_groups([rec], [prompt_ids], [seeds]))[0]
            finally:
                self._release(n)
        return await self._entry(uid, rec, group)

    async def _entry(self, uid: int, rec: PromptRecord, group: list[Sample]) -> DataBufferInput:
        """A generated group, scored and numbered, moved from in flight to finished."""
        for k, s in enumerate(group):  # provisional index (group order) until the trainer numbers them
            s.index = uid * self.n + k
        await asyncio.to_thread(self.m._score, group)  # an agent's own reward stays
        entry = DataBufferInput(prompt=rec, group=group, uid=uid)
        with self._lock:  # finished and no longer in flight in one step (a checkpoint sees it once)
            self._inflight.pop(uid, None)
            self._finished[uid] = entry
        return entry

    async def _put(self, entry: DataBufferInput) -> None:
        await self._threaded(self.buffer.put, entry)
        with self._lock:
            self._finished.pop(entry.uid, None)

    async def _threaded(self, fn, *args) -> Any:
        """`fn(*args)` in a daemon thread (a put blocked on a full buffer must not hold the
        interpreter at exit), waited on until the worker stops."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(result=None, error=None) -> None:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(result)

        def run() -> None:
            try:
                r, e = fn(*args), None
            except BaseException as ex:  # surfaced in the worker
                r, e = None, ex
            try:
                loop.call_soon_threadsafe(settle, r, e)
            except RuntimeError:  # the loop is gone: the worker stopped
                pass

        threading.Thread(target=run, name="async-rollout-put", daemon=True).start()
        while not fut.done():
            if self._stop.is_set():
                raise _Stopped
            await asyncio.wait({fut}, timeout=0.2)
        return fut.result()

    # ------------------------------------------------------------------ trainer side
    def get_rollout(self, rollout_id: int, engine_version: int) -> tuple[list[Sample], dict[str, float]]:
        """`--rollout-batch-size` groups from the buffer (blocking), in generation order."""
        t0, want = time.time(), self.cfg.rollout_batch_size
        entries = self._wait_for(self.buffer.get, want, engine_version)
        if len(entries) != want or any(len(e.group) != self.n for e in entries):
            raise RuntimeError(
                f"the data buffer's get({want}) returned {[len(e.group) for e in entries]} (group sizes): "
                f"expected {want} groups of --n-samples-per-prompt={self.n}"
            )
        groups = [e.group for e in sorted(entries, key=lambda e: e.uid)]
        samples = self.m.finalize(rollout_id, groups)
        with self._lock:
            drops, self.drops = self.drops, {}
        metrics = self.m._metrics(samples, drops, time.time() - t0)
        metrics |= self.buffer.get_metrics(None)
        metrics |= group_staleness(groups, engine_version)
        return samples, metrics

    def _wait_for(self, fn, *args) -> Any:
        """`fn(*args)` (the buffer's blocking get) while watching the worker: its error fails the step."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = fn(*args)
            except BaseException as e:
                box["error"] = e

        t = threading.Thread(target=run, name="async-rollout-get", daemon=True)
        t.start()
        while t.is_alive():
            t.join(timeout=0.5)
            if self._error is not None:
                raise RuntimeError(f"async rollout worker failed: {self._error}") from self._error
        if "error" in box:
            raise box["error"]
        return box["result"]


def group_staleness(groups: list[list[Sample]], version: int) -> dict[str, float]:
    """Miles' staleness metrics of the groups trained on (the buffer reports the rest)."""
    oldest = [version - min(x.weight_version_start for x in g) for g in groups]
    newest = [version - max(x.weight_version_end for x in g) for g in groups]
    span = [o - w for o, w in zip(oldest, newest, strict=True)]
    tokens = [sum(len(s.response_tokens) for s in g) for g in groups]
    return {
        PREFIX + "avg_staleness": sum(oldest) / len(oldest),
        PREFIX + "max_staleness": float(max(oldest)),
        PREFIX + "avg_post_generation_staleness": sum(newest) / len(newest),
        PREFIX + "max_post_generation_staleness": float(max(newest)),
        PREFIX + "avg_generation_version_span": sum(span) / len(span),
        PREFIX + "max_generation_version_span": float(max(span)),
        PREFIX + "token_weighted_staleness": sum(o * t for o, t in zip(oldest, tokens)) / max(sum(tokens), 1),
    }


def _seed(run_seed: int, seq: int, k: int) -> int:
    """Sample k of the seq-th group: stable across processes (no PYTHONHASHSEED-dependent hash)."""
    digest = hashlib.blake2b(f"{run_seed}/async/{seq}/{k}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % (2**31)
