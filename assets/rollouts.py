"""Assets materialized by the `rl_training` op, one partition per policy version `<run>.v<NNNNNN>`.

They are declared here as specs (the op, not Dagster, computes them) so the asset graph shows
their lineage: prompt data + base checkpoint -> rollout shards -> policy versions -> evals,
publications, quantized weights. Their materializations are built in one place,
ops/version_events.py, whoever reports a version (the op, the `runs_from_catalog` sensor).
"""

import dagster as dg

from assets.partitions import policy_version_partitions

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
