"""Compaction of the append-only tables: a run's part files of a table rewritten as one file.

    miles-platform compact --storage-root ROOT [--run RUN]

One `append_rows` call is one part file, so a long run (or an `s3://` root, one request per file)
pays for thousands of small files. Compacting (table, run) takes the run's lock (one writer per run:
store/run_lock.py), reads its rows in append order, each part's rows once (store/tables.py
`read_files`), writes them as one file (atomic: temp name + rename, or one PUT) whose rows carry
the part each was appended in, then deletes the files it read. Readers take each part's rows from
one file only, so at no step (and after a crash at any step) is a row seen twice or missed; running
it again merges what a crash left into one file. A train run compacts its tables when it ends
(run_lifecycle.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import fsspec

from miles_platform.store.paths import TABLES, StoragePaths
from miles_platform.store.remote import is_remote
from miles_platform.store.schemas import SOURCE_PART
from miles_platform.store.shards import write_parquet_atomic
from miles_platform.store.tables import last_part, list_files, read_files


@dataclass(frozen=True)
class Compacted:
    table: str
    run: str
    files: int  # the files it replaced
    rows: int
    path: str  # the one file left


def compact_table(paths: StoragePaths, table: str, run: str) -> Compacted | None:
    """Merge the files of (table, run) into one (None: one file or none, nothing to do).
    The caller holds the run's lock (`compact_run` takes it)."""
    _remove_stale_staging(paths.table_dir(table, run))
    files = list_files(paths, table, run)
    if len(files) <= 1:
        return None
    data = read_files(paths, table, files)  # each part once, in append order, with its part name
    parts = data.column(SOURCE_PART)
    newest = parts[len(parts) - 1].as_py() if len(parts) else last_part(files[-1].rsplit("/", 1)[-1])
    # named after the newest part it holds (sorting just before it): the newest part name stays
    # the newest row's (the runs_from_catalog sensor's cursor)
    name = f"{newest.removesuffix('.parquet')}.c{time.time_ns():020d}.parquet"
    path = f"{paths.table_dir(table, run)}/{name}"
    write_parquet_atomic(data, path)
    _remove(paths, table, files)
    return Compacted(table, run, len(files), len(data), path)


def _remove(paths: StoragePaths, table: str, files: list[str]) -> None:
    """Delete the files the compacted one replaced (after a crash halfway: the next compaction)."""
    fs = fsspec.core.url_to_fs(paths.table_dir(table))[0]
    for f in files:
        fs.rm(f)


STALE_STAGING_S = 3600.0  # a temp file this old is a dead writer's (a live one renames it in seconds)


def _remove_stale_staging(directory: str) -> None:
    """The hidden temp files a writer killed mid-write left (write_parquet_atomic's `.<name>.tmp-*`;
    an object store has none). Only old ones: a writer outside the run lock (an eval asset) may be
    writing one now."""
    if is_remote(directory) or not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        p = os.path.join(directory, name)
        if name.startswith(".") and ".tmp-" in name and time.time() - os.path.getmtime(p) > STALE_STAGING_S:
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)


def compact_tables(paths: StoragePaths, run: str, log: Callable[[str], None] = print) -> list[Compacted]:
    """Every table of `run`, compacted; the caller holds the run's lock. The catalog's views are
    made current first, so a DuckDB shell on an older catalog never reads a row twice."""
    _refresh_catalog(paths)
    done = [c for c in (compact_table(paths, t, run) for t in TABLES) if c is not None]
    if done:
        log(
            f"[compact] run {run!r}: "
            + ", ".join(f"{c.table} {c.files} files -> 1 ({c.rows} rows)" for c in done)
        )
    return done


def _refresh_catalog(paths: StoragePaths) -> None:
    if is_remote(paths.root) or not os.path.exists(paths.catalog):
        return  # an object store's views are built per query; no catalog yet: built when first read
    from miles_platform.store.catalog import Catalog

    catalog = Catalog(paths)
    if not catalog.is_fresh():
        catalog.refresh()


def table_runs(paths: StoragePaths) -> list[str]:
    """The runs that have rows in some table."""
    runs = set()
    for table in TABLES:
        fs, root = fsspec.core.url_to_fs(paths.table_dir(table))
        if fs.exists(root):
            runs |= {p.rstrip("/").rsplit("/run=", 1)[1] for p in fs.glob(f"{root}/run=*")}
    return sorted(runs)


def compact_run(paths: StoragePaths, run: str, log: Callable[[str], None] = print) -> list[Compacted]:
    """Take the run's lock (refused while a run writes it: store/run_lock.RunLocked), compact."""
    from miles_platform.store.run_lock import ObjectStoreLease, RunLock, local_run_dir

    with RunLock(local_run_dir(paths, run), run):
        if is_remote(paths.root):
            with ObjectStoreLease(paths.run_dir(run), run):
                return compact_tables(paths, run, log)
        return compact_tables(paths, run, log)


def cli_main(argv: list[str]) -> int:
    from miles_platform.store.run_lock import RunLocked

    ap = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="miles-platform compact",
        description="merge each run's part files of the append-only tables (metrics, lineage, "
        "policy_versions, evals, run_events) into one file per table, rows unchanged",
    )
    ap.add_argument("--storage-root", default=os.environ.get("MILES_STORAGE_ROOT", ".miles"))
    ap.add_argument("--run", help="only this run (default: every run with table rows)")
    args = ap.parse_args(argv)
    paths = StoragePaths(args.storage_root)
    error = paths.missing_root_error("miles-platform compact")
    if error:
        print(error, file=sys.stderr)
        return 2
    runs = [args.run] if args.run else table_runs(paths)
    busy = []
    for run in runs:
        try:
            compact_run(paths, run)
        except RunLocked as e:
            if args.run:
                raise
            busy.append(run)
            print(f"[compact] skipped run {run!r}: {e}", file=sys.stderr)
    print(f"[compact] {len(runs) - len(busy)} run(s) compacted" + (f", {len(busy)} busy" if busy else ""))
    return 1 if busy else 0
