"""Assets materialized by the `rl_training` op, one partition per policy version `<run>.v<NNNNNN>`.

They are declared here as specs (the op, not Dagster, computes them) so the asset graph shows
their lineage: prompt data + base checkpoint -> rollout shards -> policy versions -> evals,
publications, quantized weights.
"""

import math
import os
from typing import Any

import dagster as dg

from assets.partitions import policy_version_partitions

DATA_VERSION_TAG = "dagster/data_version"

rollout_shards = dg.AssetSpec(
    "rollout_shards",
    partitions_def=policy_version_partitions,
    deps=["prompt_dataset", "base_checkpoint"],
    group_name="training",
    description="Parquet shard of the rollout that trained this policy version (one row per sample). "
    "Query all of them with the DuckDB `rollouts` view.",
    kinds={"parquet", "duckdb"},
)

lora_adapters = dg.AssetSpec(
    "lora_adapters",
    partitions_def=policy_version_partitions,
    deps=["rollout_shards", "base_checkpoint"],
    group_name="training",
    description="A LoRA run's policy version (--lora-rank > 0): the PEFT adapter dir (lora_A / lora_B "
    "only, loadable by peft.PeftModel.from_pretrained) trained on the rollout shard, applied to the "
    "frozen base checkpoint it names by content hash. Never a merged copy.",
    kinds={"pytorch", "safetensors"},
)

policy_versions = dg.AssetSpec(
    "policy_versions",
    partitions_def=policy_version_partitions,
    deps=["rollout_shards", "base_checkpoint", "lora_adapters"],
    group_name="training",
    description="A policy version: HF export of the trained weights after one weight update, with lineage "
    "metadata (parent version, shard, dataset and base checkpoint data versions, config hash).",
    kinds={"pytorch", "safetensors"},
)


# ------------------------------------------------------------------ their materializations
# One policy version (`PolicyVersion.to_dict()`) -> the events the rl_training op logs and the
# `runs_from_catalog` sensor reports for runs trained outside Dagster: the same metadata either way.


def rollout_shard_event(info: dict[str, Any], extra: dict[str, Any] | None = None) -> dg.AssetMaterialization:
    return dg.AssetMaterialization(
        asset_key="rollout_shards",
        partition=info["partition_key"],
        metadata={
            **_lineage(info),
            "path": dg.MetadataValue.path(info["shard_path"]),
            "rows": info["shard_rows"],
            "mean_reward": float(info["mean_reward"] or 0.0),
            **shard_summary(info["shard_path"]),
            **(extra or {}),
        },
    )


PREVIEW_ROWS = 3


def shard_summary(path: str) -> dict[str, Any]:
    """What the asset page shows of a shard without a query: reward std, truncation share, response
    lengths, and the first samples (prompt, response, reward, status) as a small table."""
    import fsspec
    import pyarrow.parquet as pq

    cols = ["prompt", "response", "reward", "raw_reward", "status", "response_length"]
    try:
        with fsspec.open(path, "rb") as f:
            rows = pq.read_table(f, columns=cols).to_pylist()
    except Exception as e:  # a preview must never fail the version's materialization
        return {"preview": dg.MetadataValue.text(f"preview unavailable: {type(e).__name__}: {e}")}
    if not rows:
        return {}
    rewards = [float(r["raw_reward"] if r["raw_reward"] is not None else r["reward"] or 0.0) for r in rows]
    mean = sum(rewards) / len(rewards)
    lens = [int(r["response_length"] or 0) for r in rows]

    def cell(text: Any, n: int = 80) -> str:
        t = str(text).replace("|", "\\|").replace("\n", "\\n")
        return t if len(t) <= n else t[: n - 1] + "…"

    table = ["| prompt | response | reward | status |", "| --- | --- | --- | --- |"]
    table += [
        f"| {cell(r['prompt'])} | {cell(r['response'])} | {rw:.3g} | {r['status']} |"
        for r, rw in zip(rows[:PREVIEW_ROWS], rewards, strict=False)
    ]
    return {
        "reward_std": math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards)),
        "truncated": sum(r["status"] == "truncated" for r in rows) / len(rows),
        "response_len_mean": sum(lens) / len(lens),
        "response_len_max": max(lens),
        "preview": dg.MetadataValue.md("\n".join(table)),
    }


def lora_adapter_event(info: dict[str, Any], extra: dict[str, Any] | None = None) -> dg.AssetMaterialization:
    return dg.AssetMaterialization(
        asset_key="lora_adapters",
        partition=info["partition_key"],
        metadata={
            **_lineage(info),
            "path": dg.MetadataValue.path(info["adapter_path"]),
            "base_checkpoint": dg.MetadataValue.path(info["base_checkpoint"]),
            "shard_path": dg.MetadataValue.path(info["shard_path"]),
            "content_hash": info["content_hash"],
            "size_bytes": _dir_bytes(info["adapter_path"]),
            **(extra or {}),
        },
        tags={DATA_VERSION_TAG: info["content_hash"]},
    )


def policy_version_event(
    info: dict[str, Any],
    metrics: dict[str, float],
    eval_config: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> dg.AssetMaterialization:
    """`metrics`: the training metrics of the rollout that made the version (plotted);
    `eval_config`: the `eval_results` config that evaluates it (read by the eval sensor)."""
    return dg.AssetMaterialization(
        asset_key="policy_versions",
        partition=info["partition_key"],
        metadata={
            **_lineage(info),
            # a LoRA version points at its adapter and the base, not at a merged copy
            "path": dg.MetadataValue.path(info["hf_path"] or info["adapter_path"]),
            "hf_path": dg.MetadataValue.path(info["hf_path"] or ""),
            **_lora_metadata(info),
            "checkpoint_path": dg.MetadataValue.path(info["checkpoint_path"] or ""),
            "content_hash": info["content_hash"],
            "shard_path": dg.MetadataValue.path(info["shard_path"]),
            "mean_reward": float(info["mean_reward"] or 0.0),
            "eval_config": dg.MetadataValue.json(eval_config),  # eval_results' run config
            **_plottable(metrics),
            **(extra or {}),
        },
        tags={DATA_VERSION_TAG: info["content_hash"]},
    )


def _plottable(metrics: dict[str, Any]) -> dict[str, Any]:
    """A rollout's metrics as float metadata (the asset's Plots tab draws one line per key);
    a non-finite value stays visible as text instead of breaking the plot."""
    out: dict[str, Any] = {}
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[name] = float(value) if math.isfinite(value) else dg.MetadataValue.text(str(value))
    return out


def _lora_metadata(info: dict[str, Any]) -> dict[str, Any]:
    if not info.get("adapter_path"):
        return {}
    return {"adapter_path": dg.MetadataValue.path(info["adapter_path"]),
            "base_checkpoint": dg.MetadataValue.path(info["base_checkpoint"])}  # fmt: skip


def _dir_bytes(path: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())


def _lineage(info: dict[str, Any]) -> dict[str, Any]:
    """Metadata both training assets carry. Identifiers are text: numbers would be plotted."""
    lineage: dict[str, Any] = {
        "run": info["run"],
        "version": dg.MetadataValue.text(str(info["version"])),
        "rollout_id": dg.MetadataValue.text(str(info["rollout_id"])),
        "parent_version": dg.MetadataValue.text(info["parent_partition_key"]),
        "config_hash": info["config_hash"],
        "base_data_version": info["base_data_version"] or "",
        "dataset_data_version": info["dataset_data_version"] or "",
    }
    teachers = info.get("distilled_from") or []
    if teachers:  # on-policy distillation: the teacher checkpoint(s), by content hash
        lineage["distilled_from"] = dg.MetadataValue.json(teachers)
    if info.get("eval_interval"):  # read by the eval_on_new_policy sensor
        lineage["eval_interval"] = dg.MetadataValue.text(str(int(info["eval_interval"])))
    if info.get("final"):  # the run's last version: the eval sensor always evaluates it
        lineage["final"] = dg.MetadataValue.text("true")
    return lineage
