"""A run's state on disk across crashes: stale staging dirs, the config a checkpoint was made
with, and the highest version number any store knows. Called with the run lock held."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from miles_platform.config import RESUMABLE, ConfigError, RunConfig, config_changes, saved_config
from miles_platform.store.atomic import fsync_tree, replace_dir, write_atomic
from miles_platform.store.paths import RUN_CONFIG, StoragePaths

# staging names of the atomic writers (store/atomic.py, export, checkpoints, disk-delta publish)
_TMP = re.compile(r"^\..*\.tmp-[0-9a-f]+$|^\.tmp-.+-[0-9a-f]{8}$")


def remove_dead_writers_tmp(cfg: RunConfig, paths: StoragePaths, log: Callable[[str], None]) -> None:
    """Every `.tmp-*` under the run's dirs (checkpoint, HF export and publication staging of a
    killed writer) is garbage nothing can observe: remove it. Needs the run lock."""
    from miles_platform.store import remote

    pub = getattr(cfg, "update_weight_disk_dir", None)  # a diffusion run publishes no disk-delta
    if any(remote.is_remote(r) for r in (paths.root, cfg.save, pub)):
        remote.remove_dead_staging(log)  # object stores hold no temp names: uploads stage here
    seen = set()
    for root in (paths.run_dir(cfg.run_name), cfg.save, pub):
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


def recorded_max_version(cfg: RunConfig, paths: StoragePaths) -> int:
    """The highest version any store knows: catalog rows, HF exports (`hf/v000006`) and the
    disk-delta publication's LATEST. A run killed between publishing or exporting a version and
    recording it continues past it, so no number is reused and no export is overwritten."""
    from miles_platform.store import remote
    from miles_platform.store.tables import read_rows

    known = [int(r["version"]) for r in read_rows(paths, "policy_versions", cfg.run_name)]
    hf = paths.hf_export(cfg.run_name, 0).rsplit("/", 1)[0]
    if remote.is_remote(hf):  # any prefix, even an export whose upload died: never reused
        names = remote.listdir(hf)
    else:
        names = [d.name for d in Path(hf).iterdir()] if Path(hf).is_dir() else []
    known += [int(m.group(1)) for n in names if (m := re.match(r"v(\d+)", n))]
    pub = getattr(cfg, "update_weight_disk_dir", None)  # a diffusion run publishes no disk-delta
    if getattr(cfg, "update_weight_transfer_mode", None) == "disk-delta" and pub:
        from miles_platform.weights.delta_format import read_latest

        latest = read_latest(pub) if remote.is_remote(pub) or Path(pub).is_dir() else None
        known += [latest] if latest is not None else []
    return max(known, default=0)


def save_hf_copy(cfg: RunConfig, rollout_id: int, hf_dir: str) -> None:
    """--save-hf: a copy of the saved policy in HF layout (the template may use {rollout_id})."""
    dest = cfg.save_hf.format(rollout_id=rollout_id)
    if cfg.uses_lora:  # `hf_dir` is the version's adapter: the merged model, as Miles' --save-hf
        from miles_platform.training.lora import export_merged_hf_dir

        export_merged_hf_dir(cfg.hf_checkpoint, hf_dir, dest)
        return
    tmp = f"{dest}.tmp-{os.getpid()}"
    shutil.copytree(hf_dir, tmp)
    fsync_tree(tmp)
    replace_dir(tmp, dest)


def note_resume(
    cfg, paths: StoragePaths, reporter, state: dict | None, highest: int, changes: list[str]
) -> str | None:
    """A launch of `train` that finds a checkpoint (`state`), or rows of a run that stopped before
    its first one: record the resume event, log what it abandons, flag those versions to the
    reporter. Returns the saved config hash when --allow-config-change let flags change (the next
    version's lineage edge `config_changed_from`), else None. A first launch records nothing."""
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
