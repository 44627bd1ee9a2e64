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

import time
from typing import Any

from miles_platform.config import RunConfig
from miles_platform.store.paths import StoragePaths
from miles_platform.store.remote import exists  # a local path or an object-store URI
from miles_platform.training.ci_checks import check_weights_equal, weight_check_on


def _trainer_weights(s) -> dict:
    from miles_platform.run_services import call_trainers

    return call_trainers(s.cfg, s.trainers, "get_hf_weights")


def export_policy(weights: dict, cfg: RunConfig, out_dir: str, previous: str | None = None) -> str:
    """The version's policy as an HF dir: the trainer's dense weights, so no quantization_config
    (a quantized --hf-checkpoint's is the served copy's: `served_weights`). `previous`: the version
    before's export, whose copies of the template's files are linked (`export_hf_dir`'s link_from)."""
    from miles_platform.models.checkpoint import quantization
    from miles_platform.training.export import export_hf_dir

    dense = {"quantization_config": None} if quantization(cfg.hf_checkpoint) else None  # else config as is
    return export_hf_dir(weights, cfg.hf_checkpoint, out_dir, dense, link_from=previous)


def served_weights(cfg: RunConfig, weights: dict, hf_dir: str | None) -> tuple[dict, str | None, dict]:
    """(what the engines get, the HF dir holding it, the dense weights they then serve). A quantized
    --hf-checkpoint (fp8 / int4, weights/rollout_quant.py): the trainer's weights quantized as it is,
    written beside the export (`<export>-<fmt>`); a dense one: the weights and the export as they are."""
    from miles_platform.store.paths import served_path
    from miles_platform.weights.rollout_quant import dense_from_update, rollout_quant, write_served_checkpoint

    rq = rollout_quant(cfg.hf_checkpoint)
    if rq is None:
        return weights, hf_dir, weights
    served = rq.quantize(weights)
    if hf_dir is not None:
        hf_dir = write_served_checkpoint(served, cfg.hf_checkpoint, served_path(hf_dir, rq.fmt))
    return served, hf_dir, dense_from_update(served)[0]


def initial_sync(cfg: RunConfig, paths: StoragePaths, s, version: int, resumed: bool, base_version) -> None:
    """`s`: the run's RunServices (trainers, engines, session)."""
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
    if resumed and (delta or cfg.use_fault_tolerance):  # what engines (a replacement) load from disk
        if not exists(f"{hf_dir}/model.safetensors"):
            hf_dir = export_policy(weights, cfg, hf_dir)
    has_export = exists(f"{hf_dir}/model.safetensors")
    served, served_dir, dense = served_weights(cfg, weights, hf_dir if has_export else None)
    if snapshot:
        s.session.transport.snapshot_base(served, version)
    elif published:  # engines hold v0 = --hf-checkpoint; the next version goes on top of LATEST
        s.session.transport.load_export(cfg.hf_checkpoint, version)
    elif delta:  # resumed: never republish a version
        s.session.transport.load_export(served_dir, version)
    else:
        s.session.update(served, version, served_dir)
    if resumed and weight_check_on(cfg):
        check_weights_equal(cfg, s.engines, dense, version)


def publish_version(
    cfg: RunConfig, paths: StoragePaths, s, version: int, base_version, weights: dict | None = None
) -> tuple[str, dict[str, Any]]:
    """-> (the version's policy dir: its HF export, or a LoRA run's adapter dir; update metrics).
    `weights`: the trainer's, as its train call returned them (train-async's pipeline); None: asked
    of the trainer now."""
    if cfg.uses_lora:
        from miles_platform.weights.lora_publish import publish_adapter

        return publish_adapter(cfg, paths, s, version, base_version)
    if s.monitor is not None:  # --use-fault-tolerance: replace dead engines first
        s.monitor.check_once()
    timed = {}  # the driver's share of a version beside the engines' update (perf/update_weights_*)
    if weights is None:  # given: the trainer timed its own gather (perf/get_weights_time in its metrics)
        t0 = time.time()
        weights = _trainer_weights(s)
        timed["perf/get_weights_time"] = time.time() - t0
    t1 = time.time()
    hf_dir = export_policy(
        weights, cfg, paths.hf_export(cfg.run_name, version), paths.hf_export(cfg.run_name, version - 1)
    )
    timed["perf/export_hf_time"] = time.time() - t1
    if s.session is None:  # train-only (Miles' SFT): no engine to load it
        return hf_dir, timed
    served, served_dir, dense = served_weights(cfg, weights, hf_dir)
    metrics = {**timed, **s.session.update(served, version, served_dir)}
    if weight_check_on(cfg):
        check_weights_equal(cfg, s.engines, dense, version)
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
