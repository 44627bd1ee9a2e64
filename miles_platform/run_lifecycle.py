"""What every run starts inside, whatever it trains (`train`'s RunServices, `train-diffusion`'s loop):
one writer per run and per checkpoint dir (a lock file; on an object store also a renewed lease), a
dead writer's staging dirs removed, the resume config checked (and recorded in the checkpoint dir),
Ray with the project's settings, the trackers, the --ci-fault-hooks. Up in that order after validation, down in reverse whatever failed;
a run that ends without an error compacts its table files (store/compaction.py) before its lock goes.

    with RunLifecycle(cfg, paths, reporter.log) as life:
        life.stack.callback(stop_my_actor)         # the vertical's own processes, torn down first
        state = ...                                 # its trainer's checkpoint
        start, version = VersionRecorder(...).resume(state, life.config_changes)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from miles_platform.config import RESUMABLE, ConfigError, config_changes, saved_config
from miles_platform.store.atomic import write_atomic
from miles_platform.store.paths import RUN_CONFIG, StoragePaths

# staging names of the atomic writers (store/atomic.py, export, checkpoints, disk-delta publish)
_TMP = re.compile(r"^\..*\.tmp-[0-9a-f]+$|^\.tmp-.+-[0-9a-f]{8}$")


class RunLifecycle(contextlib.AbstractContextManager):
    """`resumable`: the flags a resume may change (config.RESUMABLE, or diffusion.config's);
    `cpus_needed`: a run without an LLM placement plan says how many CPUs its actors take
    (cluster/ray_cluster.init_ray); `trackers`: start the config's trackers (`train`'s flags).
    `stack`: where the run's own processes register their teardown (run before this one's)."""

    def __init__(
        self, cfg, paths: StoragePaths, log: Callable[[str], None], *, resumable: frozenset[str] = RESUMABLE,
        cpus_needed: float | None = None, trackers: bool = True,
    ):  # fmt: skip
        from miles_platform.fault_hooks import FaultHooks, parse_fault_hooks
        from miles_platform.trackers import Trackers

        self.cfg, self.paths, self.log = cfg, paths, log
        self.resumable, self.cpus_needed, self._with_trackers = resumable, cpus_needed, trackers
        self.hooks = FaultHooks(parse_fault_hooks(cfg.ci_fault_hooks), log)
        self.trackers = Trackers()  # none until started
        self.config_changes: list[str] = []  # flags a resume changed under --allow-config-change
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> RunLifecycle:
        try:
            self._start()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc) -> bool:
        return bool(self.stack.__exit__(*exc))

    def _start(self) -> None:
        from miles_platform.cluster.ray_cluster import init_ray, shutdown_ray
        from miles_platform.store.run_lock import RunLock, local_run_dir, local_save_dir
        from miles_platform.trackers import Trackers

        cfg, s = self.cfg, self.stack
        # one writer per run, taken after validation (an object-store root: on this host only)
        lock = RunLock(local_run_dir(self.paths, cfg.run_name), cfg.run_name).acquire()
        s.callback(lock.release)
        if cfg.save:  # and one writer per checkpoint dir: two runs sharing --save clobbered each other
            save_lock = RunLock(local_save_dir(cfg.save), cfg.run_name, f"--save {cfg.save}").acquire()
            s.callback(save_lock.release)
        self._take_leases()
        # the run lock is held: a `.tmp-*` staging dir (checkpoint, export) is a dead writer's
        remove_dead_writers_tmp(cfg, self.paths, self.log)
        # a resume trains what the checkpoint's run trained, or says which flags changed
        self.config_changes = check_resume_config(cfg, self.log, self.resumable)
        need = {} if self.cpus_needed is None else {"cpus_needed": self.cpus_needed}  # None: the plan's
        ray_ctx = init_ray(cfg, **need)
        # down: the run's table files merged, one per table, under the lock and beside Ray's shutdown
        # (after a failure: left for the relaunch's end or `miles-platform compact`)
        s.push(lambda et, *_: self._compact_beside(lambda: shutdown_ray(ray_ctx), et is None))
        if self._with_trackers:
            self.trackers = Trackers(cfg, self.paths, self.log)
            s.push(lambda et, *_: self.trackers.close(failed=et is not None))

    def _compact_beside(self, shutdown: Callable[[], None], compact: bool) -> None:
        """Ray's shutdown (~0.5 s, mostly waiting for its processes to exit) with the compaction
        (~0.5 s of parquet reads and writes, nothing of Ray's) on a thread beside it: both done
        before the run lock goes. `compact` False (the run failed): Ray's shutdown only."""
        import threading

        t = threading.Thread(target=self._compact, name="compact", daemon=True) if compact else None
        if t is not None:
            t.start()
        try:
            shutdown()
        finally:
            if t is not None:
                t.join()

    def _compact(self) -> None:
        """Compact the run's append-only tables (store/compaction.py); a failure is only logged."""
        from miles_platform.store.compaction import compact_tables

        try:
            compact_tables(self.paths, self.cfg.run_name, self.log)
        except Exception as e:  # the rows are all there either way: never fail a finished run
            self.log(f"[compact] run {self.cfg.run_name!r}: not compacted ({type(e).__name__}: {e}); "
                     "`miles-platform compact` retries it")  # fmt: skip

    def _take_leases(self) -> None:
        """On an object store, one writer per run (and per --save) across hosts and cache dirs: a
        lease object (store/run_lock.py); a writer whose lease another took stops like a Ctrl-C."""
        import _thread

        from miles_platform.store.remote import is_remote
        from miles_platform.store.run_lock import ObjectStoreLease

        cfg = self.cfg

        def lost(msg: str) -> None:
            self.log(msg)
            _thread.interrupt_main()

        for url, what in ((self.paths.run_dir(cfg.run_name), None), (cfg.save, f"--save {cfg.save}")):
            if url and is_remote(url):
                lease = ObjectStoreLease(url, cfg.run_name, what, on_lost=lost).acquire()
                self.stack.callback(lease.release)


def remove_dead_writers_tmp(cfg, paths: StoragePaths, log: Callable[[str], None]) -> None:
    """Every `.tmp-*` under the run's dirs (checkpoint, HF export and publication staging of a
    killed writer; the part a trainer's background row writer was writing in its `train_samples`
    partition, which only the run's trainers write) is garbage nothing can observe: remove it.
    Needs the run lock. (The other tables' partitions take writers outside the lock, an eval asset:
    compaction removes their old temp files, store/compaction.py.)"""
    from miles_platform.store import remote

    pub = getattr(cfg, "update_weight_disk_dir", None)  # a diffusion run publishes no disk-delta
    if any(remote.is_remote(r) for r in (paths.root, cfg.save, pub)):
        remote.remove_dead_staging(log)  # object stores hold no temp names: uploads stage here
    seen = set()
    for root in (paths.run_dir(cfg.run_name), cfg.save, pub, paths.table_dir("train_samples", cfg.run_name)):
        if not root or "://" in root or not os.path.isdir(root) or root in seen:
            continue
        seen.add(root)
        # at any depth (a diffusion eval grid stages in runs/<run>/evals/v000003/); hidden dirs that
        # are not staging are not entered
        for d, dirs, files in os.walk(root):
            for name in [*files, *dirs]:
                if _TMP.match(name):
                    p = Path(d) / name
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                    log(f"[startup] removed {p} (left by a writer that died)")
            dirs[:] = [n for n in dirs if not n.startswith(".")]


def check_resume_config(cfg, log: Callable[[str], None], resumable: frozenset[str] = RESUMABLE) -> list[str]:
    """A resume must train what the saved run trained: differing flags (other than schedule, eval,
    logging and placement ones, `resumable`: config.RESUMABLE, or diffusion.config's for
    train-diffusion) are refused unless --allow-config-change. The checkpoint dir then records
    this run's config. Returns the changes allowed (`--lr a -> b`)."""
    from miles_platform.store import remote
    from miles_platform.training.checkpoint import read_latest

    src = cfg.load or cfg.save
    changes: list[str] = []
    if not src:
        return changes
    if remote.is_remote(src):
        saved = remote.read_bytes(remote.join(src, RUN_CONFIG))
    else:
        rec = Path(src) / RUN_CONFIG
        saved = rec.read_bytes() if rec.is_file() else None
    owner = json.loads(saved).get("run_name") if saved is not None else None
    if owner not in (None, cfg.run_name) and src == cfg.save:
        raise ConfigError(
            f"--save {cfg.save} holds the checkpoints of run {owner!r}, not {cfg.run_name!r}: a second run "
            "writing there would take over its checkpoints and its run_config.json. Give this run its own "
            f"--save, or --run-name {owner} to resume that run"
        )
    if read_latest(src) is not None and saved is not None:
        changes = config_changes(json.loads(saved), cfg, resumable)
        if changes and not cfg.allow_config_change:
            raise ConfigError(
                f"resuming run {cfg.run_name!r} from {src} with a different config: {'; '.join(changes)}. "
                "Relaunch with the saved flags, a new --run-name, or --allow-config-change"
            )
        if changes:
            log(f"[resume] --allow-config-change: {'; '.join(changes)}")
    if cfg.save and remote.is_remote(cfg.save):
        remote.write_bytes(remote.join(cfg.save, RUN_CONFIG), saved_config(cfg))  # one PUT: atomic
    elif cfg.save:
        Path(cfg.save).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(cfg.save) / RUN_CONFIG, saved_config(cfg))
    return changes


def published_version(cfg) -> int | None:
    """The disk-delta publication's LATEST (a version a run published and may not have recorded),
    or None: numbering continues past it (store/recorder.py)."""
    from miles_platform.store import remote

    pub = getattr(cfg, "update_weight_disk_dir", None)  # a diffusion run publishes no disk-delta
    if getattr(cfg, "update_weight_transfer_mode", None) != "disk-delta" or not pub:
        return None
    from miles_platform.weights.delta_format import read_latest

    return read_latest(pub) if remote.is_remote(pub) or Path(pub).is_dir() else None
