"""The version bookkeeping of a run, one for every loop (`train`, `train-diffusion`): where a launch
resumes and which number its next version takes, the resume event, each version's record, each
rollout's metrics, and when a checkpoint is due.

Numbers: a new version continues past the highest any store knows (catalog rows, HF exports, the
disk-delta publication's LATEST, which the caller reads), branching from the checkpoint's version,
so a number a crashed process used is never reused and no export is overwritten. What a stopped run
made after its checkpoint is abandoned by the resume event (store/run_events.py).

The loop writes, in this order: the version's row (naming the checkpoint the rollout will save when
one is due), its eval, the rollout's metrics, the checkpoint last: a crash anywhere before the
checkpoint is complete leaves only rows the relaunch abandons. `cfg` is the run's config, either
loop's (`RunConfig`, `DiffusionRunConfig`)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_platform.run_types import PolicyVersion, Reporter, RunResult
from miles_platform.store.code_version import code_version
from miles_platform.store.paths import StoragePaths
from miles_platform.store.tables import BufferedParts


def recorded_max_version(paths: StoragePaths, run: str, published: int | None = None) -> int:
    """The highest version any store knows: catalog rows, HF exports (`hf/v000006`) and `published`
    (the disk-delta publication's LATEST). A run killed between publishing or exporting a version and
    recording it continues past it."""
    from miles_platform.store import remote
    from miles_platform.store.tables import read_rows

    known = [int(r["version"]) for r in read_rows(paths, "policy_versions", run)]
    hf = paths.hf_export(run, 0).rsplit("/", 1)[0]
    if remote.is_remote(hf):  # any prefix, even an export whose upload died: never reused
        names = remote.listdir(hf)
    else:
        names = [d.name for d in Path(hf).iterdir()] if Path(hf).is_dir() else []
    known += [int(m.group(1)) for n in names if (m := re.match(r"v(\d+)", n))]
    known += [published] if published is not None else []
    return max(known, default=0)


def note_resume(
    cfg, paths: StoragePaths, reporter: Reporter, state: dict | None, highest: int, changes: list[str]
) -> str | None:
    """A launch that finds a checkpoint (`state`), or rows of a run that stopped before its first
    one: record the resume event, log what it abandons, flag those versions to the reporter. Returns
    the saved config hash when --allow-config-change let flags change (the next version's lineage
    edge `config_changed_from`), else None. A first launch records nothing."""
    from miles_platform.store.paths import partition_key
    from miles_platform.store.run_events import record_resume
    from miles_platform.store.run_health import last_rollout_id

    run = cfg.run_name
    if state is not None:
        rid, version = int(state["rollout_id"]), int(state["weight_version"])
        where = f"from {cfg.load or cfg.save} rollout {rid}, v{version}"
    elif highest or last_rollout_id(paths, run) >= 0:  # rows, but no checkpoint: start over
        rid, version, where = -1, 0, "without a checkpoint"
    else:
        return None
    lost = record_resume(paths, run, rid, version, highest, changes)
    tail = f"; v{lost[0]}..v{lost[-1]}, made after it by a run that stopped, are abandoned" if lost else ""
    reporter.log(f"[resume] {where}{tail}")
    if lost:
        reporter.on_versions_abandoned([partition_key(run, v) for v in lost], rid, version)
    return (state.get("config_hash") or "unknown") if changes and state is not None else None


def close_quietly(rec: VersionRecorder, failed: bool, log: Callable[[str], None]) -> None:
    """A loop's end: the recorder's rows to disk. After a failure, a failure to write them is
    logged, not raised over the error that stopped the run."""
    try:
        rec.close()
    except Exception as e:
        if not failed:
            raise
        log(f"[record] rows of the last rollouts not written ({type(e).__name__}: {e})")


class VersionRecorder:
    """`resume` once (after the trainer loaded its checkpoint), then per rollout `next_version`,
    `record`, `finish_rollout` and `save_due`. `base_version` / `data_version`: content hashes of the
    base checkpoint and the prompt data (lineage); `log_keys`: the metrics of the per-rollout log
    line; `trackers`: the run's metric sinks (trackers.py; None: none); `teachers`: OPD teachers
    (lineage edges); `extra_metrics`: more of each rollout's metrics, added after its total time."""

    def __init__(
        self, cfg, paths: StoragePaths, reporter: Reporter, base_version: str | None, data_version: str | None,
        log_keys: tuple[str, ...], *, trackers=None, teachers: list[tuple[str, str, str | None]] = (),
        extra_metrics: Callable[[], dict[str, float]] | None = None,
    ):  # fmt: skip
        self.cfg, self.paths, self.reporter = cfg, paths, reporter
        self.base_version, self.data_version, self.log_keys = base_version, data_version, log_keys
        self.trackers, self.teachers, self.extra_metrics = trackers, list(teachers), extra_metrics
        self.highest = 0  # the highest version number any store knows (set by `resume`)
        self.config_changed_from: str | None = None  # the next version's `config_changed_from` edge
        self.code = code_version()  # the code this run started with, recorded with each version
        self.config_hash: str | None = None  # the run's, hashed at its first version (~3 ms each time)
        # the version, lineage and metrics rows: a part file per table a second (store/tables.py);
        # the loops `flush` before each checkpoint and `close` at the end, failed or not
        self.parts = BufferedParts(paths, name="table-parts")

    def flush(self) -> None:
        """Every row recorded so far on disk (before a checkpoint that names its rollout)."""
        self.parts.flush()

    def close(self) -> None:
        self.parts.close()

    def resume(self, state: dict | None, changes: list[str], published: int | None = None) -> tuple[int, int]:
        """The trainer's checkpoint state (None: none) -> (first rollout id, its weight version).
        `changes`: the flags --allow-config-change let differ; `published`: the disk-delta LATEST."""
        start = 0 if state is None else state["rollout_id"] + 1
        version = 0 if state is None else int(state["weight_version"])
        self.highest = max(version, recorded_max_version(self.paths, self.cfg.run_name, published))
        self.config_changed_from = note_resume(
            self.cfg, self.paths, self.reporter, state, self.highest, changes
        )
        if self.trackers is not None:  # TensorBoard drops what a crashed process logged from `start` on
            self.trackers.resume(start)
        return start, version

    def next_version(self, version: int) -> tuple[int, int]:
        """(parent, new): the new version numbers past every one known, branching from `version`."""
        self.highest = max(version, self.highest) + 1
        return version, self.highest

    def upcoming_version(self, version: int) -> int:
        """The number `next_version(version)` will give: the version the steps trained now make
        (with --update-weights-interval > 1, the next one published)."""
        return max(version, self.highest) + 1

    def save_due(self, rollout_id: int) -> bool:
        """A checkpoint after this rollout: the last one, every --save-interval-th (with --save),
        and any one while --save-trigger-sentinel's file exists (`save_requested`)."""
        c = self.cfg
        return bool(c.save) and (
            rollout_id + 1 == c.num_rollout
            or bool(c.save_interval and (rollout_id + 1) % c.save_interval == 0)
            or self.save_requested()
        )

    def save_requested(self) -> bool:
        """Miles' --save-trigger-sentinel: its file exists at this save point. The loop saves
        synchronously, then `save_request_done` removes it: "file gone" means "checkpoint durable",
        and a crash mid-save leaves the request for the next run."""
        path = getattr(self.cfg, "save_trigger_sentinel", None)  # train-diffusion has none
        return bool(path) and os.path.exists(path)

    def save_request_done(self, rollout_id: int) -> None:
        os.remove(self.cfg.save_trigger_sentinel)
        self.reporter.log(
            f"--save-trigger-sentinel {self.cfg.save_trigger_sentinel}: saved rollout {rollout_id}"
        )

    def record(
        self,
        result: RunResult,
        version: int,
        parent: int,
        rollout_id: int,
        shard,
        hf_dir: str,
        ckpt: str | None,
    ) -> PolicyVersion:
        """The version's `policy_versions` row and lineage (store/versions.py), to the reporter and
        the result. `ckpt`: the checkpoint this rollout will save, when one is due."""
        from miles_platform.store.versions import record_policy_version

        self.config_hash = self.config_hash or self.cfg.config_hash()
        pv = record_policy_version(self.cfg, self.paths, version, parent, rollout_id, shard, hf_dir, ckpt,
                                   self.base_version, self.data_version, self.teachers,
                                   config_changed_from=self.config_changed_from, code=self.code,
                                   config_hash=self.config_hash, append=self.parts.append)  # fmt: skip
        self.config_changed_from = None  # on the first version after the change only
        result.versions.append(pv.to_dict())
        self.reporter.on_policy_version(pv)
        result.final_hf_path = pv.hf_path
        return pv

    def finish_rollout(
        self, result: RunResult, rollout_id: int, metrics: dict[str, Any], t0: float, version: int
    ) -> None:
        """Metrics of one rollout: to the `metrics` table, the reporter, the trackers and the result."""
        metrics["perf/rollout_total_time"] = time.time() - t0
        if self.extra_metrics is not None:
            metrics.update(self.extra_metrics())
        step = int(metrics.get("train/step", 0))
        rows = [
            {"rollout_id": rollout_id, "step": step, "name": k, "value": float(v)} for k, v in metrics.items()
        ]
        self.parts.append("metrics", self.cfg.run_name, rows)
        self.reporter.on_rollout(rollout_id, metrics)
        # less what a custom log function took over
        logged = metrics if self.trackers is None else self.trackers.log(rollout_id, metrics)
        if rollout_id % self.cfg.log_interval == 0:
            shown = " ".join(f"{k}={logged[k]:.4g}" for k in self.log_keys if k in logged)
            self.reporter.log(f"rollout {rollout_id}: {shown}")
        result.metrics.append(metrics)
        result.last_rollout_id, result.final_version = rollout_id, version
