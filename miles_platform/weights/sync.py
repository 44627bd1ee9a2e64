"""The loop's weight steps: the engines' first sync, each new version's publication, --save-hf.

`initial_sync`: engines start from --hf-checkpoint (v0); a resumed run pushes its policy to them
first, a disk-delta run publishes its v0 snapshot (or, started over after a crash, appends to
the publication it finds), a LoRA run loads its adapter.

`publish_version`: the trainer's weights as the run's next version, through the run's transport
(HF export first, so a replacement engine or a reader can load it), with the `--ci-test` /
`--check-weight-update-equal` check after it. A train-only run (Miles' SFT: no engines) writes the
HF export (a LoRA run: the adapter dir) and stops there.

`save_hf_copy`: with a checkpoint, the version's policy as an HF dir (--save-hf).
"""

from __future__ import annotations

from typing import Any

from miles_platform.config import RunConfig
from miles_platform.store.paths import StoragePaths
from miles_platform.store.remote import exists  # a local path or an object-store URI
from miles_platform.training.ci_checks import check_weights_equal, weight_check_on


def _trainer_weights(s) -> dict:
    from miles_platform.run_services import call_trainers

    return call_trainers(s.cfg, s.trainers, "get_hf_weights")


def initial_sync(cfg: RunConfig, paths: StoragePaths, s, version: int, resumed: bool, base_version) -> None:
    """`s`: the run's RunServices (trainers, engines, session)."""
    from miles_platform.training.export import export_hf_dir
    from miles_platform.weights.delta_format import read_latest

    if (
        cfg.uses_lora
    ):  # the engines serve the base: load the run's adapter (v0: B = 0, or --lora-adapter-path)
        from miles_platform.weights.lora_publish import publish_adapter

        publish_adapter(cfg, paths, s, version, base_version)
        return
    delta = cfg.uses_disk_delta
    # a run started over (no checkpoint) after a crash may find its publication begun: append to it
    published = delta and not resumed and read_latest(cfg.update_weight_disk_dir) is not None
    snapshot = delta and not resumed and not published
    if not (snapshot or resumed or published):
        return  # engines already hold v0
    weights = _trainer_weights(s)
    hf_dir = paths.hf_export(cfg.run_name, version)
    if snapshot:
        s.session.transport.snapshot_base(weights, version)
    elif published:  # engines hold v0 = --hf-checkpoint; the next version goes on top of LATEST
        s.session.transport.load_export(cfg.hf_checkpoint, version)
    elif delta:  # resumed: never republish a version
        if not exists(f"{hf_dir}/model.safetensors"):
            hf_dir = export_hf_dir(weights, cfg.hf_checkpoint, hf_dir)
        s.session.transport.load_export(hf_dir, version)
    else:
        if cfg.use_fault_tolerance and not exists(f"{hf_dir}/model.safetensors"):
            hf_dir = export_hf_dir(weights, cfg.hf_checkpoint, hf_dir)  # what a replacement loads
        s.session.update(weights, version, hf_dir if exists(f"{hf_dir}/model.safetensors") else None)
    if resumed and weight_check_on(cfg):
        check_weights_equal(cfg, s.engines, weights, version)


def publish_version(
    cfg: RunConfig, paths: StoragePaths, s, version: int, base_version
) -> tuple[str, dict[str, Any]]:
    """-> (the version's policy dir: its HF export, or a LoRA run's adapter dir; update metrics)."""
    from miles_platform.training.export import export_hf_dir

    if cfg.uses_lora:
        from miles_platform.weights.lora_publish import publish_adapter

        return publish_adapter(cfg, paths, s, version, base_version)
    if s.monitor is not None:  # --use-fault-tolerance: replace dead engines first
        s.monitor.check_once()
    weights = _trainer_weights(s)
    hf_dir = export_hf_dir(weights, cfg.hf_checkpoint, paths.hf_export(cfg.run_name, version))
    if s.session is None:  # train-only (Miles' SFT): no engine to load it
        return hf_dir, {}
    metrics = s.session.update(weights, version, hf_dir)
    if weight_check_on(cfg):
        check_weights_equal(cfg, s.engines, weights, version)
    return hf_dir, metrics


def save_hf_copy(cfg: RunConfig, rollout_id: int, hf_dir: str) -> None:
    """--save-hf: a copy of the saved policy in HF layout (the template may use {rollout_id})."""
    import os
    import shutil

    from miles_platform.store.atomic import fsync_tree, replace_dir

    dest = cfg.save_hf.format(rollout_id=rollout_id)
    if cfg.uses_lora:  # `hf_dir` is the version's adapter: the merged model, as Miles' --save-hf
        from miles_platform.training.lora import export_merged_hf_dir

        export_merged_hf_dir(cfg.hf_checkpoint, hf_dir, dest)
        return
    tmp = f"{dest}.tmp-{os.getpid()}"
    shutil.copytree(hf_dir, tmp)
    fsync_tree(tmp)
    replace_dir(tmp, dest)
