"""The record of a new policy version: its `policy_versions` row and its lineage edges
(previous version or base checkpoint, rollout shard, prompt data, base checkpoint, and with
on-policy distillation the teacher: `distilled_from`, by content hash)."""

from __future__ import annotations

from miles_platform.config import RunConfig
from miles_platform.run_types import PolicyVersion
from miles_platform.store.paths import StoragePaths, absolute, partition_key


def is_final_version(cfg, rollout_id: int) -> bool:
    """A version trained at `rollout_id` is its run's last: no later rollout of --num-rollout
    updates the weights (every --update-weights-interval-th rollout does). A resume that raises
    --num-rollout makes a later one final too."""
    interval = getattr(cfg, "update_weights_interval", 1) or 1
    return bool(cfg.num_rollout) and rollout_id + interval >= cfg.num_rollout


def record_policy_version(
    cfg: RunConfig, paths: StoragePaths, version: int, parent_version: int, rollout_id: int,
    shard, hf_dir: str, ckpt: str | None, base_version: str | None, data_version: str | None,
    teachers: list[tuple[str, str, str | None]] = (), config_changed_from: str | None = None,
) -> PolicyVersion:  # fmt: skip
    """`config_changed_from`: the config hash of the checkpoint this version's run resumed from
    under --allow-config-change (an edge `config_changed_from`; the flags are in run_events)."""
    from miles_platform.models.checkpoint import content_hash
    from miles_platform.store.lineage import write_edges
    from miles_platform.store.tables import append_rows

    run = cfg.run_name
    # a LoRA version is its adapter dir + the frozen base (by content hash), never a merged copy
    lora = cfg.uses_lora
    adapter_dir, hf_dir = (hf_dir, None) if lora else (None, hf_dir)
    # one spelling per path (store/lineage.py): absolute, whatever the flags were typed as
    base, data = absolute(cfg.hf_checkpoint), absolute(cfg.prompt_data)
    ckpt, hf_dir, adapter_dir = absolute(ckpt), absolute(hf_dir), absolute(adapter_dir)
    pv = PolicyVersion(
        run=run, version=version, partition_key=partition_key(run, version), parent_version=parent_version,
        parent_partition_key=partition_key(run, parent_version), rollout_id=rollout_id, checkpoint_path=ckpt,
        hf_path=hf_dir, content_hash=content_hash(adapter_dir or hf_dir), config_hash=cfg.config_hash(),
        base_data_version=base_version, dataset_data_version=data_version, shard_path=absolute(shard.path),
        shard_rows=shard.rows, mean_reward=shard.mean_reward, base_checkpoint=base,
        prompt_data=data, eval_interval=cfg.eval_interval, adapter_path=adapter_dir,
        distilled_from=[{"teacher": t, "kind": k, "content_hash": h} for t, k, h in teachers],
        final=is_final_version(cfg, rollout_id),
    )  # fmt: skip
    append_rows(paths, "policy_versions", run, [pv.row()])
    first = parent_version == 0
    write_edges(
        paths, run, pv.partition_key, "policy_version",
        [
            (base if first else pv.parent_partition_key, "checkpoint" if first else "policy_version",
             "trained_from", base_version if first else None),
            (pv.shard_path, "rollout_shard", "trained_on", None),
            (data, "dataset", "prompt_data", data_version),
            (base, "checkpoint", "base_checkpoint", base_version),
            *([(adapter_dir, "lora_adapter", "adapter", pv.content_hash)] if lora else []),
            *((t, kind, "distilled_from", h) for t, kind, h in teachers),
            *([(f"config:{config_changed_from}", "run_config", "config_changed_from", config_changed_from)]
              if config_changed_from else []),
        ],
    )  # fmt: skip
    return pv
