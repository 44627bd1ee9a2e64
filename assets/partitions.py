"""Partitions shared by every domain: one dynamic partition per policy version `<run>.v<NNNNNN>`."""

import dagster as dg

policy_version_partitions = dg.DynamicPartitionsDefinition(name="policy_versions")

QUANT_FORMATS = ("fp8", "int4")

quantized_partitions = dg.MultiPartitionsDefinition(
    {
        "policy_version": policy_version_partitions,
        "format": dg.StaticPartitionsDefinition(list(QUANT_FORMATS)),
    }
)
