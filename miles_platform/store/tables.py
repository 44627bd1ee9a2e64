"""Append-only Parquet tables: policy_versions, evals, lineage, metrics, run_events, train_samples.

    <root>/tables/<table>/run=<run>/part-<time_ns>-<uuid>.parquet
    <root>/tables/<table>/run=<run>/part-<time_ns>-<uuid>.c<time_ns>.parquet   (compacted)

Each `append_rows` call writes one new part file atomically (never rewrites an old one), so
concurrent writers cannot lose rows and readers see whole calls or nothing.

Compaction (store/compaction.py) rewrites a run's parts as one file whose rows carry the part
each was appended in (`_source_part`), then deletes the parts. Between those two steps (or after
a crash there) a part's rows are in two files: readers take each part's rows from one file only,
the greatest file name holding them (`read_table` here, the same rule in the catalog's views),
so no reader sees a row twice or misses one. A compacted file is named after the last part it
holds (sorting just before it): the newest part name is still the newest row's.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from miles_platform.store.paths import StoragePaths
from miles_platform.store.remote import is_remote
from miles_platform.store.schemas import SOURCE_PART, TABLE_SCHEMAS  # noqa: F401 (re-exported)
from miles_platform.store.shards import has_parquet, refresh_catalog_after_first_file, write_parquet_atomic

_COMPACTED = re.compile(r"^(part-.+)\.c\d+\.parquet$")
_READ_ATTEMPTS = 7  # listings retried (_relisting) when a file listed was removed meanwhile


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
    _known(table)
    if not rows:
        return None
    return _write_part(paths, table, run, _check_rows(table, run, rows))


def _known(table: str) -> None:
    if table not in TABLE_SCHEMAS:
        raise ValueError(f"unknown table {table!r}; known: {sorted(TABLE_SCHEMAS)}")


def _write_part(paths: StoragePaths, table: str, run: str, rows: list[dict[str, Any]]) -> str:
    """Checked rows (`_check_rows`) as one new atomic part file of `table`; its path."""
    data = pa.Table.from_pylist(rows, schema=TABLE_SCHEMAS[table])
    # remote: no catalog file
    first = not is_remote(paths.root) and not has_parquet(paths.table_dir(table), "run=")
    path = f"{paths.table_dir(table, run)}/part-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet"
    write_parquet_atomic(data, path)
    if first:
        refresh_catalog_after_first_file(paths)
    return path


PART_INTERVAL_S = 1.0  # BufferedParts: a part file per table at most this often


class BufferedParts:
    """Rows of a run's tables appended as they come (checked, and stamped `created_at`, at once)
    and written on one background thread as one part file per (table, run) at most every
    `interval_s` seconds, not one per call: a part file costs ~1.5-2 ms of CPU (the Parquet
    encoding, the file, two fsyncs), and a train-async step of the demo appended five (its
    metrics, policy version and lineage rows on the driver, its train_samples rows on the
    trainer): ~8 ms of ~145 ms of CPU a step on 2 cores (2026-12-07), and a run's end then
    compacted 100 parts a table. `call(fn)` runs `fn` on the same thread, in order with the rows
    (a trainer builds its row dicts there). `flush()` returns once every row appended and every
    call made before it is on disk, raising the first failure of the thread's writes; a failure
    is also raised by the next `append`, `call` or `flush`.

    What a crash loses: the rows of the last `interval_s` seconds. Its owners flush before each
    checkpoint (the loops' saves, a trainer's save) and at a run's end, so a row of a rollout a
    checkpoint holds is always on disk; rollouts after the last checkpoint are made again by the
    relaunch (their versions, made by the run that stopped, are abandoned: store/run_events.py)."""

    def __init__(self, paths: StoragePaths, interval_s: float | None = None, name: str = "table-parts"):
        import threading
        from collections import deque

        self.paths, self.name = paths, name
        self.interval_s = PART_INTERVAL_S if interval_s is None else interval_s
        self._cv = threading.Condition()
        self._rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self._oldest: float | None = None  # monotonic time of the oldest row not yet taken
        self._jobs: deque = deque()
        self._asked = self._done = 0  # flush requests made and served
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def append(self, table: str, run: str, rows: list[dict[str, Any]]) -> None:
        _known(table)
        if not rows:
            return
        checked = _check_rows(table, run, rows)
        with self._cv:
            self._raise()
            self._rows.setdefault((table, run), []).extend(checked)
            if self._oldest is None:
                self._oldest = time.monotonic()
            self._wake()

    def call(self, fn: Callable[[], None]) -> None:
        with self._cv:
            self._raise()
            self._jobs.append(fn)
            self._wake()

    def flush(self) -> None:
        with self._cv:
            if self._thread is not None:
                self._asked += 1
                asked = self._asked
                self._cv.notify_all()
                while self._done < asked and self._thread.is_alive():
                    self._cv.wait()
            self._raise()

    def close(self) -> None:
        """`flush`, then the thread ends (an `append` after it starts another)."""
        try:
            self.flush()
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
                thread, self._thread = self._thread, None
            if thread is not None:
                thread.join()
            self._closed = False

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _wake(self) -> None:
        import threading

        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._cv.notify_all()

    def _next(self):
        """Under the lock: the next thing to do (a call, or rows with the flush request they serve),
        waiting for one; None when closed with nothing left."""
        while True:
            if self._jobs:
                return self._jobs.popleft(), None
            flushing = self._asked > self._done
            due = self._oldest is not None and time.monotonic() - self._oldest >= self.interval_s
            if flushing or due or (self._closed and self._rows):
                rows, self._rows, self._oldest = self._rows, {}, None
                return rows, self._asked
            if self._closed:
                return None
            wait = None if self._oldest is None else self.interval_s - (time.monotonic() - self._oldest)
            self._cv.wait(wait)

    def _run(self) -> None:
        while True:
            with self._cv:
                task = self._next()
            if task is None:
                return
            work, serves = task
            try:
                if callable(work):
                    work()
                else:
                    for (table, run), rows in work.items():
                        _write_part(self.paths, table, run, rows)
            except BaseException as e:  # noqa: BLE001 - kept for the owner's next call
                with self._cv:
                    self._error = self._error or e
            if serves is not None:
                with self._cv:
                    self._done = max(self._done, serves)
                    self._cv.notify_all()


def last_part(name: str) -> str:
    """The newest part a table file holds: itself, or the one a compacted file is named after."""
    m = _COMPACTED.match(name)
    return f"{m.group(1)}.parquet" if m else name


def is_compacted(name: str) -> bool:
    return bool(_COMPACTED.match(name))


def list_files(paths: StoragePaths, table: str, run: str | None = None) -> list[str]:
    """The table's files (of one run, or all runs): parts and compacted files, by name."""
    fs, root = fsspec.core.url_to_fs(paths.table_dir(table, run))
    if not fs.exists(root):
        return []
    pattern = f"{root}/part-*.parquet" if run else f"{root}/run=*/part-*.parquet"
    return sorted(fs.glob(pattern), key=lambda p: p.rsplit("/", 1)[-1])


def read_table(paths: StoragePaths, table: str, run: str | None = None, after: str | None = None) -> pa.Table:
    """The rows of `table` (one run, or all runs) in append order, each part's rows once, with a
    `_source_part` column (the part each row was appended in). `after`: only the parts whose
    names sort after it. A file a compaction removed after it was listed: listed again."""
    return _relisting(lambda: read_files(paths, table, list_files(paths, table, run), after))


def _relisting(read: Callable[[], Any]) -> Any:
    """`read()` (a listing and what it reads), again while a file it listed was removed meanwhile:
    _READ_ATTEMPTS tries, 0.05 s apart doubling to 1 s (a compaction deleting its parts, or a newer
    one replacing an older compacted file, is done within these ~3 s in all)."""
    for attempt in range(_READ_ATTEMPTS):
        try:
            return read()
        except FileNotFoundError:
            if attempt == _READ_ATTEMPTS - 1:
                raise
            time.sleep(min(0.05 * 2**attempt, 1.0))
    raise AssertionError("unreachable")


def conform(t: pa.Table, schema: pa.Schema) -> pa.Table:
    """`t` as `schema` lays it out, as `pq.read_table(f, schema=schema)` reads a file: its columns in
    the schema's order and types, a column the file lacks (written before it existed) all null, one
    the schema lacks dropped. `pq.ParquetFile(f).read()` + this: 0.33 ms a small part file against
    0.95 ms for `read_table` (its dataset machinery), which a run's end-of-run compaction paid ~400
    times (~1 s of the run's teardown)."""
    cols = []
    for field in schema:
        if field.name in t.column_names:
            col = t.column(field.name)
            cols.append(col if col.type == field.type else col.cast(field.type))
        else:
            cols.append(pa.nulls(len(t), field.type))
    return pa.Table.from_arrays(cols, schema=schema)


def read_files(paths: StoragePaths, table: str, files: list[str], after: str | None = None) -> pa.Table:
    """`read_table` of these files (module docstring: each part's rows from one file only)."""
    fs = fsspec.core.url_to_fs(paths.table_dir(table))[0]
    schema = TABLE_SCHEMAS[table].append(pa.field(SOURCE_PART, pa.string()))
    pieces, holder = [], {}  # holder: (dir, part) -> the greatest file name holding its rows
    # compacted files first (newest first): a part one of them holds is not opened again, so a part
    # file the compaction deletes after this listing is never needed (its rows are the same there)
    compacted = {p for p in files if is_compacted(p.rpartition("/")[2])}
    for p in sorted(compacted, reverse=True) + [p for p in files if p not in compacted]:
        directory, _, name = p.rpartition("/")
        if after is not None and last_part(name) <= after:
            continue  # holds no part after `after`
        if (directory, name) in holder:  # a part file whose rows a compacted file gave already
            continue
        with fs.open(p, "rb") as f:
            t = conform(pq.ParquetFile(f).read(use_threads=False), schema)
        if not is_compacted(name):
            t = t.set_column(
                t.schema.get_field_index(SOURCE_PART), SOURCE_PART, pa.array([name] * len(t), pa.string())
            )
        for part in t.column(SOURCE_PART).unique().to_pylist():
            holder[directory, part] = max(holder.get((directory, part), name), name)
        pieces.append((directory, name, t))
    mine: dict[tuple[str, str], list[str]] = {}  # (dir, file name) -> the parts read from it
    for (directory, part), name in holder.items():
        mine.setdefault((directory, name), []).append(part)
    kept = []
    for directory, name, t in pieces:
        part_col = t.column(SOURCE_PART)
        mask = pc.is_in(part_col, pa.array(mine.get((directory, name), []), pa.string()))
        if after is not None:
            mask = pc.and_(mask, pc.greater(part_col, after))
        kept.append(t.filter(mask))
    if not kept:
        return schema.empty_table()
    out = pa.concat_tables(kept)
    order = pc.sort_indices(
        out.append_column("_pos", pa.array(range(len(out)), pa.int64())),
        sort_keys=[(SOURCE_PART, "ascending"), ("_pos", "ascending")],
    )
    return out.take(order)


def read_parts(
    paths: StoragePaths, table: str, run: str, after: str | None = None
) -> list[tuple[str, list[dict]]]:
    """(part name, its rows) of one run, oldest first; `after`: only the parts after that name."""
    out: list[tuple[str, list[dict]]] = []
    for row in read_table(paths, table, run, after).to_pylist():
        part = row.pop(SOURCE_PART)
        if not out or out[-1][0] != part:
            out.append((part, []))
        out[-1][1].append(row)
    return out


def part_names(paths: StoragePaths, table: str) -> list[str]:
    """The names of every part appended to `table` (all runs), oldest first, whether a compaction
    merged it or not: what changes when rows are appended, and only then."""

    def read() -> list[str]:
        names: set[str] = set()
        fs = fsspec.core.url_to_fs(paths.table_dir(table))[0]
        for p in list_files(paths, table):
            name = p.rsplit("/", 1)[-1]
            if not is_compacted(name):
                names.add(name)
                continue
            with fs.open(p, "rb") as f:
                names.update(pq.read_table(f, columns=[SOURCE_PART]).column(0).unique().to_pylist())
        return sorted(names)

    return _relisting(read)


def read_rows(paths: StoragePaths, table: str, run: str | None = None) -> list[dict[str, Any]]:
    """All rows of `table` (of one run, or all runs), in append order."""
    return read_table(paths, table, run).drop_columns([SOURCE_PART]).to_pylist()
