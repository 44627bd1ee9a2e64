"""What the viewer reads, all of it DuckDB queries on the catalog's views with a LIMIT: the runs, a
run's versions, one page of a filtered and sorted sample list, one sample with its group and its
`train_samples` row. Nothing loads a whole table.

Each request opens its own read-only connection (`ViewerStore.connection`) and closes it: a
connection held open would keep the run's writers from refreshing the catalog. On a local root the
connection reads nothing outside the root (`allowed_directories`, external access off, the
configuration locked) and a query runs at most QUERY_TIMEOUT_S. The user's `where` fragment is one
SQL expression over the `rollouts` view's columns (`check_where`), and it is the whole WHERE of a
SELECT on that view, which the list then filters further.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import duckdb

from miles_platform.errors import MilesError
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths

QUERY_TIMEOUT_S = 30.0
MAX_PAGE_SIZE = 200
MAX_WHERE_CHARS = 2000
MAX_GROUP = 64
TRAIN_SAMPLES = "train_samples"

# sort key -> SQL over the rollouts view; ties broken by (rollout_id, index)
SORTS = {
    "rollout": "rollout_id",
    "reward": "reward",
    "raw_reward": "raw_reward",
    "length": "response_length",
    "group": "group_index",
    "status": "status",
    "staleness": "weight_version_end - weight_version_start",
    "mean_logprob": "list_avg(rollout_log_probs)",
}
STATUSES = ("completed", "truncated", "aborted", "failed")
# truncated: the status says so, or a multi-turn episode's turn stopped at its length limit
TRUNCATED_SQL = (
    "(status = 'truncated' OR coalesce(list_bool_or(list_transform(turns, "
    "lambda t: t.finish_reason = 'length')), false))"
)
# the list's columns: the long texts cut, no token lists, no images (a sort would read them all)
LIST_COLUMNS = (
    'run, rollout_id, group_index, "index", reward, raw_reward, status, response_length, '
    "weight_version_start, weight_version_end, left(prompt, 200) AS prompt, "
    "left(response, 300) AS response, list_avg(rollout_log_probs) AS mean_logprob, "
    "len(turns) AS turns"
)


class ViewerError(MilesError):
    """A request the viewer refuses (HTTP 400 / 404): the message names the parameter."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class SampleQuery:
    """The sample list's filters, sort and page, as the page's form sends them."""

    run: str = ""
    version: int | None = None  # the rollout that trained this policy version
    rollout_from: int | None = None
    rollout_to: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    status: str = ""  # one of STATUSES, or "" for any
    truncated: str = ""  # "yes" | "no" | ""
    min_len: int | None = None
    max_len: int | None = None
    where: str = ""  # one SQL expression over the rollouts view's columns
    sort: str = "rollout"
    desc: bool = False
    page: int = 1
    page_size: int = 50

    @classmethod
    def from_params(cls, params: dict[str, str]) -> SampleQuery:
        """Parse query-string values; an empty value is unset. Errors name the parameter."""
        out: dict[str, Any] = {}
        for f in fields(cls):
            raw = params.get(f.name, "").strip()
            if not raw:
                continue
            kind = f.type.split(" |")[0] if isinstance(f.type, str) else f.type
            try:
                if kind == "int":
                    out[f.name] = int(raw)
                elif kind == "float":
                    out[f.name] = float(raw)
                elif kind == "bool":
                    out[f.name] = raw.lower() in ("1", "true", "yes", "on", "desc")
                else:
                    out[f.name] = raw
            except ValueError:
                raise ViewerError(f"{f.name}={raw!r}: expected a {kind}") from None
        q = cls(**out)
        q.check()
        return q

    @classmethod
    def lenient(cls, params: dict[str, str]) -> SampleQuery:
        """The query less the parameters it refuses, to show the form again after an error."""
        params = dict(params)
        for _ in fields(cls):
            try:
                return cls.from_params(params)
            except ViewerError as e:
                params.pop(str(e).split("=")[0].split(":")[0], None)
        return cls(run=params.get("run", ""))

    def check(self) -> None:
        if self.sort not in SORTS:
            raise ViewerError(f"sort={self.sort!r}: one of {', '.join(SORTS)}")
        if self.status and self.status not in STATUSES:
            raise ViewerError(f"status={self.status!r}: one of {', '.join(STATUSES)} (or empty for any)")
        if self.truncated not in ("", "yes", "no"):
            raise ViewerError(f"truncated={self.truncated!r}: yes, no or empty")
        if self.page < 1:
            raise ViewerError(f"page={self.page}: pages count from 1")
        if not 1 <= self.page_size <= MAX_PAGE_SIZE:
            raise ViewerError(f"page_size={self.page_size}: 1 to {MAX_PAGE_SIZE}")
        if len(self.where) > MAX_WHERE_CHARS:
            raise ViewerError(f"where: at most {MAX_WHERE_CHARS} characters")

    def params(self, **change: Any) -> dict[str, str]:
        """The set parameters (with `change` applied), for links to other pages of the list."""
        values = {f.name: getattr(self, f.name) for f in fields(self)} | change
        defaults = {f.name: f.default for f in fields(self)}
        return {
            k: ("1" if v is True else str(v)) for k, v in values.items() if v != defaults[k] and v is not None
        }


def check_where(con: duckdb.DuckDBPyConnection, fragment: str) -> None:
    """Refuse a `where` that is not one SQL expression over the rollouts view: `;`, a subquery
    (it could read other tables or files), or text that closes the WHERE and adds clauses. DuckDB's
    own parser decides (json_serialize_sql), not a regex."""
    if ";" in fragment:
        raise ViewerError("where: one SQL expression over the rollouts columns; ';' is not allowed")
    sql = f"SELECT 1 FROM rollouts WHERE (\n{fragment}\n)"  # newlines: a -- comment ends before ')'
    tree = json.loads(con.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()[0])
    if tree.get("error"):
        raise ViewerError(f"where: {tree.get('error_message', 'not valid SQL')}")
    statements = tree["statements"]
    node = statements[0]["node"] if len(statements) == 1 else {}
    table = node.get("from_table") or {}
    plain = (
        node.get("type") == "SELECT_NODE"
        and not node.get("modifiers")
        and not (node.get("cte_map") or {}).get("map")
        and not node.get("group_expressions")
        and node.get("having") is None
        and node.get("qualify") is None
        and table.get("type") == "BASE_TABLE"
        and table.get("table_name") == "rollouts"
        and len(node.get("select_list") or []) == 1
    )
    if not plain:
        raise ViewerError("where: one SQL expression over the rollouts columns, not more SQL")
    if _has_subquery(node.get("where_clause")):
        raise ViewerError("where: subqueries are not allowed (filter on the rollouts columns only)")


def _has_subquery(tree: Any) -> bool:
    if isinstance(tree, dict):
        return tree.get("class") == "SUBQUERY" or any(_has_subquery(v) for v in tree.values())
    if isinstance(tree, list):
        return any(_has_subquery(v) for v in tree)
    return False


def _dicts(cur: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


class ViewerStore:
    """The viewer's reads of one storage root. One request's queries at a time (a lock): the
    machines it runs on are small, and DuckDB parallelizes each query itself."""

    def __init__(self, root: str):
        self.paths = StoragePaths(root)
        self.catalog = Catalog(self.paths)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def connection(self) -> Iterator[duckdb.DuckDBPyConnection]:
        with self._lock:
            con = self.catalog.connect()
            try:
                if (
                    not self.catalog.remote
                    and not con.execute("SELECT current_setting('lock_configuration')").fetchone()[0]
                ):
                    root = self.paths.root.replace("'", "''")
                    con.execute(f"SET allowed_directories = ['{root}/']")
                    con.execute("SET enable_external_access = false")
                    con.execute("SET lock_configuration = true")
                yield con
            finally:
                con.close()

    @contextlib.contextmanager
    def _timeout(self, con: duckdb.DuckDBPyConnection) -> Iterator[None]:
        timer = threading.Timer(QUERY_TIMEOUT_S, con.interrupt)
        timer.start()
        try:
            yield
        except duckdb.InterruptException:
            raise ViewerError(f"the query ran over {QUERY_TIMEOUT_S:.0f} s; narrow the filters") from None
        finally:
            timer.cancel()

    # ------------------------------------------------------------------ runs and versions
    def runs(self, con: duckdb.DuckDBPyConnection, limit: int = 500) -> list[dict[str, Any]]:
        cur = con.execute(
            "SELECT run, count(*) AS samples, count(DISTINCT rollout_id) AS rollouts, "
            "min(rollout_id) AS first_rollout, max(rollout_id) AS last_rollout "
            "FROM rollouts GROUP BY run ORDER BY run LIMIT ?",
            [limit],
        )
        return _dicts(cur)

    def has_images(self, con: duckdb.DuckDBPyConnection, run: str) -> bool:
        """A diffusion run: its samples are images (one row read, not the run's images)."""
        return bool(
            con.execute(
                "SELECT count(*) FROM (SELECT 1 FROM rollouts WHERE run = ? AND image_png IS NOT NULL LIMIT 1)",
                [run],
            ).fetchone()[0]
        )

    def versions(self, con: duckdb.DuckDBPyConnection, run: str, limit: int = 1000) -> list[dict[str, Any]]:
        """The run's committed versions, newest first: version, the rollout that trained it, mean reward."""
        cur = con.execute(
            "SELECT version, arg_max(rollout_id, created_at) AS rollout_id, "
            "arg_max(mean_reward, created_at) AS mean_reward FROM policy_versions "
            "WHERE run = ? AND status = 'committed' GROUP BY version ORDER BY version DESC LIMIT ?",
            [run, limit],
        )
        return _dicts(cur)

    def version_rollout(self, con: duckdb.DuckDBPyConnection, run: str, version: int) -> int:
        row = con.execute(
            "SELECT arg_max(rollout_id, created_at) FROM policy_versions "
            "WHERE run = ? AND version = ? AND status = 'committed'",
            [run, version],
        ).fetchone()
        if row is None or row[0] is None:
            raise ViewerError(f"run {run!r} has no committed policy version {version}", 404)
        return int(row[0])

    # ------------------------------------------------------------------ the sample list
    def _source(self, con: duckdb.DuckDBPyConnection, q: SampleQuery) -> str:
        """The rollouts view, or a SELECT on it with the user's `where` as its whole WHERE: whatever
        the fragment holds (`1) OR (1`), it cannot reach past that SELECT to the filters around it."""
        if not q.where:
            return "rollouts"
        check_where(con, q.where)
        return f"(SELECT * FROM rollouts WHERE (\n{q.where}\n))"

    def _filters(self, con: duckdb.DuckDBPyConnection, q: SampleQuery) -> tuple[str, list[Any]]:
        clauses, args = ["run = ?"], [q.run]
        lo, hi = q.rollout_from, q.rollout_to
        if q.version is not None:
            lo = hi = self.version_rollout(con, q.run, q.version)
        for sql, value in (
            ("rollout_id >= ?", lo), ("rollout_id <= ?", hi),
            ("reward >= ?", q.min_reward), ("reward <= ?", q.max_reward),
            ("response_length >= ?", q.min_len), ("response_length <= ?", q.max_len),
            ("status = ?", q.status or None),
        ):  # fmt: skip
            if value is not None:
                clauses.append(sql)
                args.append(value)
        if q.truncated:
            clauses.append(TRUNCATED_SQL if q.truncated == "yes" else f"NOT {TRUNCATED_SQL}")
        return " AND ".join(clauses), args

    def samples(self, con: duckdb.DuckDBPyConnection, q: SampleQuery) -> tuple[int, list[dict[str, Any]]]:
        """(how many samples match, the rows of page `q.page`)."""
        if not q.run:
            raise ViewerError("run: pick a run")
        source = self._source(con, q)
        where, args = self._filters(con, q)
        order = "DESC" if q.desc else "ASC"
        sql = (
            f"SELECT {LIST_COLUMNS} FROM {source} WHERE {where} "
            f'ORDER BY {SORTS[q.sort]} {order} NULLS LAST, rollout_id, "index" LIMIT ? OFFSET ?'
        )
        with self._timeout(con):
            try:
                total = con.execute(f"SELECT count(*) FROM {source} WHERE {where}", args).fetchone()[0]
                cur = con.execute(sql, [*args, q.page_size, (q.page - 1) * q.page_size])
            except duckdb.InterruptException:
                raise
            except duckdb.Error as e:
                if not q.where:
                    raise
                raise ViewerError(f"where: {str(e).splitlines()[0]}") from None
            return int(total), _dicts(cur)

    # ------------------------------------------------------------------ one sample
    def sample(self, con: duckdb.DuckDBPyConnection, run: str, rollout_id: int, index: int) -> dict[str, Any]:
        cur = con.execute(
            "SELECT * EXCLUDE (image_png), image_png IS NOT NULL AS has_image FROM rollouts "
            'WHERE run = ? AND rollout_id = ? AND "index" = ? LIMIT 1',
            [run, rollout_id, index],
        )
        rows = _dicts(cur)
        if not rows:
            raise ViewerError(f"no sample run={run!r} rollout_id={rollout_id} index={index}", 404)
        return rows[0]

    def group(
        self, con: duckdb.DuckDBPyConnection, run: str, rollout_id: int, group_index: int
    ) -> list[dict]:
        """The samples of one prompt's group: its n responses and rewards."""
        cur = con.execute(
            'SELECT "index", reward, raw_reward, status, response_length, left(response, 400) AS response, '
            "image_png IS NOT NULL AS has_image FROM rollouts "
            'WHERE run = ? AND rollout_id = ? AND group_index = ? ORDER BY "index" LIMIT ?',
            [run, rollout_id, group_index, MAX_GROUP],
        )
        return _dicts(cur)

    def neighbours(self, con: duckdb.DuckDBPyConnection, run: str, rollout_id: int, index: int) -> tuple:
        """The indices before and after `index` in its rollout (None at either end)."""
        return con.execute(
            'SELECT max("index") FILTER (WHERE "index" < ?), min("index") FILTER (WHERE "index" > ?) '
            "FROM rollouts WHERE run = ? AND rollout_id = ?",
            [index, index, run, rollout_id],
        ).fetchone()

    def image(self, con: duckdb.DuckDBPyConnection, run: str, rollout_id: int, index: int) -> bytes:
        row = con.execute(
            'SELECT image_png FROM rollouts WHERE run = ? AND rollout_id = ? AND "index" = ? LIMIT 1',
            [run, rollout_id, index],
        ).fetchone()
        if row is None or row[0] is None:
            raise ViewerError(f"no image for run={run!r} rollout_id={rollout_id} index={index}", 404)
        return bytes(row[0])

    # ------------------------------------------------------------------ what the trainer saw
    def train_source(self, con: duckdb.DuckDBPyConnection) -> str | None:
        """The catalog's `train_samples` view (store/schemas.py; empty on a root without train-side
        rows); None on a catalog made before the table existed."""
        exists = con.execute(
            "SELECT count(*) FROM duckdb_views() WHERE view_name = ? AND NOT internal", [TRAIN_SAMPLES]
        ).fetchone()[0]
        return TRAIN_SAMPLES if exists else None

    def train_sample(
        self, con: duckdb.DuckDBPyConnection, run: str, rollout_id: int, index: int
    ) -> tuple[dict[str, Any] | None, int]:
        """The sample's first committed `train_samples` row (lowest step) and how many it has."""
        source = self.train_source(con)
        if source is None:
            return None, 0
        cur = con.execute(
            f'SELECT *, count(*) OVER () AS n_rows FROM {source} WHERE run = ? AND rollout_id = ? AND "index" = ? '
            "ORDER BY status = 'abandoned', step NULLS LAST LIMIT 1",  # a resumed run's committed row
            [run, rollout_id, index],
        )
        rows = _dicts(cur)
        if not rows:
            return None, 0
        row = rows[0]
        return row, int(row.pop("n_rows"))

    # ------------------------------------------------------------------ the run's tokenizer
    def hf_checkpoint(self, con: duckdb.DuckDBPyConnection, run: str) -> str | None:
        """A local HF dir of the run with its tokenizer: a version's export, else --hf-checkpoint
        from the run's saved config."""
        row = con.execute(
            "SELECT hf_path FROM policy_versions WHERE run = ? AND hf_path IS NOT NULL ORDER BY version LIMIT 1",
            [run],
        ).fetchone()
        candidates = [row[0]] if row else []
        config = os.path.join(self.paths.checkpoints(run), "run_config.json")
        if not self.catalog.remote and os.path.isfile(config):
            with contextlib.suppress(ValueError, OSError):
                with open(config) as f:
                    candidates.append(json.load(f).get("hf_checkpoint"))
        return next((c for c in candidates if c and os.path.isdir(c)), None)
