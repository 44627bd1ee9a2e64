"""The DuckDB catalog: `<root>/catalog.duckdb` with views over the Parquet under the root.

Views: rollouts, policy_versions, evals, lineage, metrics, run_events, train_samples (policy_versions,
metrics, evals and train_samples carry a `status` column: committed | abandoned, store/run_events.py). A view is `read_parquet` over an
absolute glob (hive partitioning, union_by_name) once its first file exists, and a typed
zero-row SELECT before that, so queries never fail and the DuckDB CLI opens the file as is. A
table's view has every column of its schema (store/schemas.py) even where its files predate one:
a column added later reads as null in older roots.

Each view carries a comment with the hash of its SQL: readers open read-only and only take a
short write connection when a view is missing or stale (e.g. its first file just appeared).

An object-store root (s3://...) has no catalog file (DuckDB cannot write one there): each query
builds the same views in an in-memory database that reads the Parquet through the root's fsspec
filesystem (`register_filesystem`: no httpfs extension, nothing downloaded), so every query sees
the files as they are on the store, from any host.
"""

from __future__ import annotations

import argparse
import csv
import glob
import hashlib
import io
import json
import os
import sys
import time
from typing import Any

import duckdb
import pyarrow as pa

from miles_platform.errors import MilesError
from miles_platform.store.paths import StoragePaths
from miles_platform.store.remote import filesystem, is_remote
from miles_platform.store.schemas import KEYED_BY, ROLLOUT_SCHEMA, SOURCE_PART, TABLE_SCHEMAS

VIEWS = ("rollouts", *TABLE_SCHEMAS)


class CatalogError(MilesError):
    """Catalog unavailable (remote root, lock held too long) or bad SQL."""


def _duck_type(t: pa.DataType) -> str:
    if pa.types.is_list(t):
        return _duck_type(t.value_type) + "[]"
    if pa.types.is_struct(t):
        return "STRUCT(" + ", ".join(f'"{f.name}" {_duck_type(f.type)}' for f in t) + ")"
    if pa.types.is_timestamp(t):
        return "TIMESTAMP WITH TIME ZONE" if t.tz else "TIMESTAMP"
    simple = {pa.string(): "VARCHAR", pa.int64(): "BIGINT", pa.int32(): "INTEGER", pa.float64(): "DOUBLE",
              pa.float32(): "FLOAT", pa.bool_(): "BOOLEAN", pa.binary(): "BLOB"}  # fmt: skip
    return simple[t]


def _empty_select(schema: pa.Schema) -> str:
    cols = ", ".join(f'CAST(NULL AS {_duck_type(f.type)}) AS "{f.name}"' for f in schema)
    return f"SELECT {cols} WHERE false"


# The catalog file's on-disk format: the newest the `duckdb` shell on PyPI (duckdb-cli 1.5.6, which
# reads storage versions up to 1.5) can open, so `duckdb -readonly <root>/catalog.duckdb` works
# beside our duckdb 2.x (whose default format it cannot read). DuckDB keeps a file's version when
# it reopens it.
CATALOG_STORAGE_VERSION = "v1.4.0"


def _create(path: str) -> None:
    """A new, empty catalog file in CATALOG_STORAGE_VERSION (written beside it, then renamed in)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    for f in (tmp, f"{tmp}.wal"):
        if os.path.exists(f):
            os.remove(f)
    con = duckdb.connect(":memory:")
    try:
        con.execute(f"ATTACH '{tmp}' AS new_catalog (STORAGE_VERSION '{CATALOG_STORAGE_VERSION}')")
        con.execute("DETACH new_catalog")
    finally:
        con.close()
    try:
        os.link(tmp, path)  # never replaces a catalog another process created meanwhile
    except FileExistsError:
        pass
    except OSError:  # a filesystem without hard links
        if not os.path.exists(path):
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _connect(path: str, read_only: bool, attempts: int = 40) -> duckdb.DuckDBPyConnection:
    """Connect, retrying briefly while another process holds the file lock."""
    for i in range(attempts):
        try:
            return duckdb.connect(path, read_only=read_only)
        except duckdb.Error as e:
            if i == attempts - 1:
                raise CatalogError(f"cannot open {path} ({'read' if read_only else 'write'}): {e}") from None
            time.sleep(0.05)
    raise AssertionError("unreachable")


def _stored_signatures(con: duckdb.DuckDBPyConnection) -> dict[str, str]:
    """{view name: the signature its comment holds} in the catalog `con` is open on."""
    return dict(con.execute("SELECT view_name, comment FROM duckdb_views() WHERE NOT internal").fetchall())


_QUERY_ATTEMPTS = 3


class _FileVanished(Exception):
    """A file the query listed was gone when it read it."""


def _vanished(e: duckdb.Error) -> bool:
    text = str(e)
    return (isinstance(e, duckdb.IOException) and ("No such file" in text or "No files found" in text)) or (
        "FileNotFoundError" in text
    )


def _table_view(lit: str, schema: pa.Schema, hive_types: str) -> str:
    """An append-only table's rows: every column of its schema (one no file has yet reads as null),
    and each part's rows from one file only, the greatest file name holding them: a compaction
    between writing its file and deleting the parts it merged shows no row twice (store/tables.py)."""
    typed = schema.append(pa.field(SOURCE_PART, pa.string())).append(pa.field("_file", pa.string()))
    files = (
        f"{_empty_select(typed)} UNION ALL BY NAME SELECT * FROM read_parquet('{lit}', filename = '_file', "
        f"hive_partitioning = true, union_by_name = true, hive_types = {{{hive_types}}})"
    )
    part = f"coalesce({SOURCE_PART}, parse_filename(_file))"
    return (
        f"SELECT * EXCLUDE (_file, {SOURCE_PART}, _holder) FROM (SELECT *, max(_file) OVER "
        f"(PARTITION BY run, {part}) AS _holder FROM ({files})) WHERE _file = _holder"
    )


class Catalog:
    """The DuckDB views over a storage root's Parquet (module docstring): `query(sql)` read-only,
    `refresh()` recreates stale views under a short write lock (`connect()` first, when stale); an object-store
    root builds the same views in memory per query."""

    def __init__(self, paths: StoragePaths):
        self.paths = paths
        self.remote = is_remote(paths.root)  # in-memory views per query, no catalog file
        self.path = paths.catalog

    # ------------------------------------------------------------- views
    def _sources(self) -> dict[str, tuple[str, pa.Schema, str]]:
        """view -> (glob of its part files, schema, hive_types)."""
        out = {
            "rollouts": (
                f"{self.paths.rollouts}/*/*/*.parquet",
                ROLLOUT_SCHEMA,
                "'run': VARCHAR, 'rollout_id': BIGINT",
            )
        }
        for table, schema in TABLE_SCHEMAS.items():
            out[table] = (f"{self.paths.table_dir(table)}/*/*.parquet", schema, "'run': VARCHAR")
        return out

    def view_sql(self) -> dict[str, str]:
        views = {}
        fs = filesystem(self.paths.root)[0] if self.remote else None
        for name, (pattern, schema, hive_types) in self._sources().items():
            if fs.glob(filesystem(pattern)[1]) if fs is not None else glob.glob(pattern):
                lit = pattern.replace("'", "''")
                if name in TABLE_SCHEMAS:
                    views[name] = _table_view(lit, schema, hive_types)
                else:
                    views[name] = (
                        f"SELECT * FROM read_parquet('{lit}', hive_partitioning = true, "
                        f"union_by_name = true, hive_types = {{{hive_types}}})"
                    )
            else:
                views[name] = _empty_select(schema)
        # status: 'abandoned' for rows a resume left behind (past its checkpoint, made before it),
        # else 'committed' -- the rule of store/run_events.py, in SQL
        events = views["run_events"]
        for name, key in KEYED_BY.items():
            views[name] = (
                f"SELECT t.*, CASE WHEN EXISTS (SELECT 1 FROM ({events}) e WHERE e.event = 'resume' "
                f"AND e.run = t.run AND t.{key} > e.{key} AND t.created_at < e.created_at) "
                f"THEN 'abandoned' ELSE 'committed' END AS status FROM ({views[name]}) t"
            )
        return views

    @staticmethod
    def _signature(sql: str) -> str:
        return hashlib.sha256(sql.encode()).hexdigest()[:16]

    def is_fresh(self) -> bool:
        if self.remote:
            return True  # nothing stored: views are built per query
        if not os.path.exists(self.path):
            return False
        try:
            con = duckdb.connect(self.path, read_only=True)
        except duckdb.Error:
            return False
        try:
            return self._views_match(con)
        finally:
            con.close()

    def _views_match(self, con: duckdb.DuckDBPyConnection) -> bool:
        """The catalog `con` is open on holds every view as view_sql() would make it now."""
        have = _stored_signatures(con)
        return all(have.get(n) == self._signature(s) for n, s in self.view_sql().items())

    def refresh(self, best_effort: bool = False) -> bool:
        """(Re)create every view whose SQL changed under one short write connection. Returns False
        if skipped.

        best_effort: if another process holds the catalog, skip instead of raising (writers
        of shards and tables call it this way: data on disk is the truth, views are derived).
        """
        if self.remote:
            return False
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        if not os.path.exists(self.path):
            _create(self.path)
        try:
            con = _connect(self.path, read_only=False, attempts=5 if best_effort else 40)
        except CatalogError:
            if best_effort:
                return False
            raise
        try:
            con.execute("BEGIN TRANSACTION")
            have = _stored_signatures(con)
            for name, sql in self.view_sql().items():
                sig = self._signature(sql)
                if have.get(name) == sig:  # the same SQL: DuckDB would bind it (read the files) again
                    continue
                con.execute(f'CREATE OR REPLACE VIEW "{name}" AS {sql}')
                con.execute(f"COMMENT ON VIEW \"{name}\" IS '{sig}'")
            con.execute("COMMIT")
        finally:
            con.close()
        return True

    # ------------------------------------------------------------- queries
    def connect(self) -> duckdb.DuckDBPyConnection:
        """A connection to run several queries on (close it soon: while it is open, writers of the
        catalog wait): read-only on the catalog file, or in memory over an object-store root."""
        if self.remote:
            return self._remote_connection()
        if os.path.exists(self.path):
            # the freshness check on the connection the queries then use: one DuckDB open per
            # query, not two (~20-45 ms each on 2 cores, 2026-12-06), when the views are current
            con = _connect(self.path, read_only=True)
            try:
                if self._views_match(con):
                    return con
            except duckdb.Error:
                pass
            con.close()
            self.refresh(best_effort=True)  # stale: rebuilt, unless another process holds it
        else:
            self.refresh()
        return _connect(self.path, read_only=True)

    def query(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run read-only SQL against the views: (column names, rows). A table file that a compaction
        deleted between the query's listing and its read (store/compaction.py): asked again."""
        for attempt in range(_QUERY_ATTEMPTS):
            try:
                return self._query_once(sql)
            except _FileVanished as e:
                if attempt == _QUERY_ATTEMPTS - 1:
                    raise CatalogError(str(e)) from None
        raise AssertionError("unreachable")

    def _query_once(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        con = self.connect()
        try:
            cur = con.execute(sql)
            columns = [d[0] for d in cur.description] if cur.description else []
            rows = cur.fetchall() if cur.description else []
        except duckdb.Error as e:
            msg = " ".join(str(e).split("\n")[0].split())
            if _vanished(e):
                raise _FileVanished(msg) from None
            raise CatalogError(msg) from None
        finally:
            con.close()
        return columns, rows

    def _remote_connection(self) -> duckdb.DuckDBPyConnection:
        """An in-memory database with the views over the object store's Parquet."""
        con = duckdb.connect(":memory:")
        try:
            con.register_filesystem(filesystem(self.paths.root)[0])
            for name, sql in self.view_sql().items():
                con.execute(f'CREATE VIEW "{name}" AS {sql}')
        except Exception as e:  # the store's (botocore, aiohttp) errors: one line naming the root
            con.close()
            raise CatalogError(
                f"cannot read storage root {self.paths.root} ({type(e).__name__}: {e}); check "
                "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION"
            ) from None
        return con


# ----------------------------------------------------------------- CLI
def _cell(v: Any) -> str:
    return "NULL" if v is None else str(v)


def format_result(columns: list[str], rows: list[tuple], fmt: str = "table") -> str:
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(columns)
        w.writerows([["" if v is None else v for v in r] for r in rows])
        return buf.getvalue().rstrip("\n")
    if fmt == "json":
        return json.dumps([dict(zip(columns, r)) for r in rows], default=str, indent=1)
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines)


def cli_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="miles-platform query", description="run SQL against the DuckDB catalog"
    )
    ap.add_argument("sql", help=f"SQL over the views {', '.join(VIEWS)}")
    ap.add_argument("--storage-root", default=os.environ.get("MILES_STORAGE_ROOT", ".miles"))
    ap.add_argument("--format", choices=("table", "csv", "json"), default="table")
    args = ap.parse_args(argv)
    paths = StoragePaths(args.storage_root)
    error = paths.missing_root_error("miles-platform query")
    if error:
        print(error, file=sys.stderr)
        return 2
    try:
        columns, rows = Catalog(paths).query(args.sql)
    except CatalogError as e:
        print(f"miles-platform query: error: {e}", file=sys.stderr)
        return 2
    print(format_result(columns, rows, args.format))
    return 0
