"""Append-only Parquet tables: policy_versions, evals, lineage, metrics, run_events, train_samples.

    <root>/tables/<table>/run=<run>/part-<time_ns>-<uuid>.parquet

Each `append_rows` call writes one new part file atomically (never rewrites an old one), so
concurrent writers cannot lose rows and readers see whole calls or nothing.
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from miles_platform.store.paths import StoragePaths
from miles_platform.store.remote import is_remote
from miles_platform.store.schemas import TABLE_SCHEMAS  # noqa: E402,F401 (re-exported)
from miles_platform.store.shards import refresh_catalog_after_first_file, write_parquet_atomic


def _check_rows(table: str, run: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    schema = TABLE_SCHEMAS[table]
    now = datetime.now(UTC)
    out = []
    for i, row in enumerate(rows):
        unknown = set(row) - set(schema.names)
        if unknown:
            raise ValueError(
                f"table {table!r} row {i}: unknown column(s) {sorted(unknown)}; columns: {schema.names}"
            )
        if row.get("run", run) != run:
            raise ValueError(f"table {table!r} row {i}: run {row['run']!r} differs from run {run!r}")
        out.append({**row, "run": run, "created_at": row.get("created_at") or now})
    return out


def append_rows(paths: StoragePaths, table: str, run: str, rows: list[dict[str, Any]]) -> str | None:
    """Append `rows` to `table` as one new atomic part file. Returns its path (None if no rows)."""
    if table not in TABLE_SCHEMAS:
        raise ValueError(f"unknown table {table!r}; known: {sorted(TABLE_SCHEMAS)}")
    if not rows:
        return None
    data = pa.Table.from_pylist(_check_rows(table, run, rows), schema=TABLE_SCHEMAS[table])
    first = not is_remote(paths.root) and not _has_rows_dir(paths.table_dir(table))  # remote: no catalog file
    path = f"{paths.table_dir(table, run)}/part-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet"
    write_parquet_atomic(data, path)
    if first:
        refresh_catalog_after_first_file(paths)
    return path


def _has_rows_dir(directory: str) -> bool:
    fs, root = fsspec.core.url_to_fs(directory)
    return fs.exists(root) and bool(fs.glob(f"{root}/run=*/*.parquet"))


def read_rows(paths: StoragePaths, table: str, run: str | None = None) -> list[dict[str, Any]]:
    """All rows of `table` (of one run, or all runs), in append order."""
    fs, root = fsspec.core.url_to_fs(paths.table_dir(table, run))
    if not fs.exists(root):
        return []
    pattern = f"{root}/part-*.parquet" if run else f"{root}/run=*/part-*.parquet"
    files = sorted(fs.glob(pattern), key=lambda p: p.rsplit("/", 1)[-1])
    rows: list[dict[str, Any]] = []
    for p in files:
        with fs.open(p, "rb") as f:
            rows += pq.read_table(f, schema=TABLE_SCHEMAS[table]).to_pylist()
    return rows
