"""Assets materialized by the `rl_training` op, one partition per policy version `<run>.v<NNNNNN>`.

They are declared here as specs (the op, not Dagster, computes them) so the asset graph shows
their lineage: prompt data + base checkpoint -> rollout shards -> policy versions -> evals,
publications, quantized weights.
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

policy_versions = dg.AssetSpec(
    "policy_versions",
    partitions_def=policy_version_partitions,
    deps=["rollout_shards", "base_checkpoint"],
    group_name="training",
    description="A policy version: HF export of the trained weights after one weight update, with lineage "
    "metadata (parent version, shard, dataset and base checkpoint data versions, config hash).",
    kinds={"pytorch", "safetensors"},
)
