"""Materialization metadata, read and written the same way everywhere in the Dagster layer.

`latest_materialization` / `latest_metadata` / `metadata_text` are the one lookup of what an asset's
newest materialization (of a partition, or of the asset) says: the `path` of the latest
`base_checkpoint` or `prompt_dataset`, a version's `hf_path` and `eval_config`, the scoreboard's
`evals_signature`. `image_markdown` shows a PNG inline on an asset page.
"""

from __future__ import annotations

import base64
from typing import Any

import dagster as dg


def latest_materialization(
    instance: dg.DagsterInstance, key: str, partition: str | None = None
) -> dg.AssetMaterialization | None:
    """The newest materialization of asset `key` (of `partition` when given); None before any."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(
            asset_key=dg.AssetKey(key), asset_partitions=[partition] if partition else None
        ),
        limit=1,
    ).records
    return records[0].asset_materialization if records else None


def metadata_text(mat: dg.AssetMaterialization | None, name: str) -> str | None:
    """Metadata entry `name` of `mat` as text; None when absent or empty."""
    value = None if mat is None else mat.metadata.get(name)
    return None if value is None or value.value in (None, "") else str(value.value)


def latest_metadata(instance: dg.DagsterInstance, key: str, partition: str | None = None) -> dict[str, Any]:
    """{name: value} of the newest materialization of `key` (of `partition`); {} before any."""
    mat = latest_materialization(instance, key, partition)
    return {} if mat is None else {k: v.value for k, v in mat.metadata.items()}


def latest_path(instance: dg.DagsterInstance, key: str) -> str | None:
    """The `path` metadata of the newest materialization of `key`: where the asset is."""
    return metadata_text(latest_materialization(instance, key), "path")


def image_markdown(png: bytes, caption: str = "") -> dg.MetadataValue:
    """A PNG inline in the asset page (markdown with a data URI)."""
    b64 = base64.b64encode(png).decode()
    return dg.MetadataValue.md(f"{caption}\n\n![{caption}](data:image/png;base64,{b64})")
