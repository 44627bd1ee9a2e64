import json

import duckdb
import pytest

from miles_platform import cli
from miles_platform.data.sample import Sample
from miles_platform.store.catalog import VIEWS, Catalog, CatalogError
from miles_platform.store.paths import StoragePaths
from miles_platform.store.schemas import KEYED_BY
from miles_platform.store.shards import ROLLOUT_SCHEMA, write_rollout_shard
from miles_platform.store.tables import TABLE_SCHEMAS, append_rows


def test_empty_root_has_typed_empty_views(tmp_path):
    cat = Catalog(StoragePaths(str(tmp_path)))
    cols, rows = cat.query("SELECT * FROM rollouts")
    assert cols == ROLLOUT_SCHEMA.names and rows == []
    for table, schema in TABLE_SCHEMAS.items():  # + the derived status (committed | abandoned)
        status = ["status"] if table in KEYED_BY else []
        assert cat.query(f"SELECT * FROM {table}") == (schema.names + status, [])
    # typed: arithmetic and list functions work on the empty views too
    assert cat.query("SELECT avg(reward), max(len(response_tokens)) FROM rollouts")[1] == [(None, None)]


def test_views_follow_new_files_and_join(tmp_path):
    paths = StoragePaths(str(tmp_path))
    cat = Catalog(paths)
    cat.refresh()
    for rid in (1, 2):
        samples = [
            Sample(
                run="r",
                rollout_id=rid,
                index=i,
                reward=float(i + rid),
                weight_version_start=rid - 1,
                weight_version_end=rid - 1,
            )
            for i in range(2)
        ]
        write_rollout_shard(paths, "r", rid, samples)
        append_rows(paths, "policy_versions", "r", [{"version": rid, "rollout_id": rid}])
    cols, rows = cat.query(
        "SELECT p.version, avg(r.reward) AS mean_reward FROM rollouts r "
        "JOIN policy_versions p ON p.run = r.run AND p.rollout_id = r.rollout_id GROUP BY 1 ORDER BY 1"
    )
    assert cols == ["version", "mean_reward"] and rows == [(1, 1.5), (2, 2.5)]
    # views hold absolute paths: the catalog opened from anywhere, read-only, sees the same
    con = duckdb.connect(paths.catalog, read_only=True)
    try:
        assert sorted(
            v for (v,) in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()
        ) == sorted(VIEWS)
        assert con.execute("SELECT count(*) FROM policy_versions").fetchall() == [(2,)]
    finally:
        con.close()


def test_bad_sql_is_one_line_error(tmp_path):
    with pytest.raises(CatalogError) as e:
        Catalog(StoragePaths(str(tmp_path))).query("SELEC nonsense")
    assert "\n" not in str(e.value) and "syntax error" in str(e.value).lower()


@pytest.fixture
def root_with_rollouts(tmp_path):
    paths = StoragePaths(str(tmp_path))
    write_rollout_shard(
        paths,
        "r",
        0,
        [Sample(run="r", rollout_id=0, index=i, response=f"resp {i}", reward=0.5 * i) for i in range(3)],
    )
    return str(tmp_path)


SQL = "SELECT index, response, reward FROM rollouts ORDER BY index"


def test_query_cli_table(root_with_rollouts, capsys):
    assert cli.main(["query", SQL, "--storage-root", root_with_rollouts]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "index  response  reward",
        "-----  --------  ------",
        "0      resp 0    0.0",
        "1      resp 1    0.5",
        "2      resp 2    1.0",
        "(3 rows)",
    ]


def test_query_cli_csv_and_json(root_with_rollouts, capsys):
    assert cli.main(["query", SQL, "--storage-root", root_with_rollouts, "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "index,response,reward",
        "0,resp 0,0.0",
        "1,resp 1,0.5",
        "2,resp 2,1.0",
    ]
    assert (
        cli.main(["query", SQL + " LIMIT 1", "--storage-root", root_with_rollouts, "--format", "json"]) == 0
    )
    assert json.loads(capsys.readouterr().out) == [{"index": 0, "response": "resp 0", "reward": 0.0}]


def test_query_cli_errors_exit_2(root_with_rollouts, tmp_path, capsys):
    assert cli.main(["query", "SELECT * FROM no_such_view", "--storage-root", root_with_rollouts]) == 2
    err = capsys.readouterr().err
    assert err.startswith("miles-platform query: error:") and "no_such_view" in err and err.count("\n") == 1
    assert cli.main(["query", "SELECT 1", "--storage-root", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_query_while_another_reader_holds_the_catalog(root_with_rollouts):
    paths = StoragePaths(root_with_rollouts)
    cat = Catalog(paths)
    cat.refresh()
    other = duckdb.connect(paths.catalog, read_only=True)  # e.g. someone's DuckDB session
    try:
        assert cat.query("SELECT count(*) FROM rollouts")[1] == [(3,)]
    finally:
        other.close()


def test_the_duckdb_shell_opens_the_catalog_as_the_readme_shows(root_with_rollouts):
    """`duckdb -readonly <root>/catalog.duckdb "<sql>"`: the pinned duckdb-cli shell reads the file
    our duckdb 2.x writes (it is created in CATALOG_STORAGE_VERSION), views and all, also after
    the writers have reopened and refreshed it."""
    import subprocess
    import sys
    from pathlib import Path

    shell = Path(sys.executable).with_name("duckdb")
    assert shell.exists(), "duckdb-cli is a dependency: `make install` puts the shell in .venv/bin"
    paths = StoragePaths(root_with_rollouts)
    append_rows(paths, "metrics", "r", [{"rollout_id": 0, "step": 0, "name": "train/loss", "value": 0.5}])
    Catalog(paths).refresh()  # the writers' reopen + CREATE OR REPLACE keeps the file's format
    out = subprocess.run([str(shell), "-readonly", "-csv", paths.catalog, SQL + "; SELECT name FROM metrics"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["index,response,reward", "0,resp 0,0.0", "1,resp 1,0.5", "2,resp 2,1.0",
                                       "name", "train/loss"]  # fmt: skip


def test_a_query_on_current_views_opens_the_catalog_once_and_stale_views_are_rebuilt(
    root_with_rollouts, monkeypatch
):
    """One DuckDB open per query when the views are current (the freshness check runs on the
    connection the query then uses: an open costs ~20-45 ms on 2 cores); a catalog whose views are
    stale is still rebuilt before the query reads it."""
    import miles_platform.store.catalog as catalog_module

    cat = Catalog(StoragePaths(root_with_rollouts))
    cat.refresh()
    opens = []
    real = duckdb.connect
    monkeypatch.setattr(catalog_module.duckdb, "connect", lambda *a, **kw: opens.append(kw) or real(*a, **kw))
    assert cat.query("select count(*) from rollouts")[1] == [(3,)]
    assert len(opens) == 1 and opens[0].get("read_only") is True
    # a stale view (another version's SQL): rebuilt under a write connection, then read
    con = real(cat.path)
    con.execute("COMMENT ON VIEW rollouts IS 'stale'")
    con.close()
    opens.clear()
    assert cat.query("select count(*) from rollouts")[1] == [(3,)]
    assert [kw.get("read_only") for kw in opens] == [True, False, True]
    assert cat.is_fresh()


def test_a_refresh_recreates_only_the_views_whose_sql_changed(root_with_rollouts, monkeypatch):
    """DuckDB binds a view when it is created (it reads the files' metadata): a refresh leaves the
    views whose SQL is unchanged alone. A table's first file changes its own view only."""
    import miles_platform.store.catalog as catalog_module

    paths = StoragePaths(root_with_rollouts)
    Catalog(paths).refresh()
    created = []
    real = catalog_module._connect

    class Recording:
        def __init__(self, con):
            self.con = con

        def execute(self, sql, *args):
            if sql.startswith("CREATE OR REPLACE VIEW"):
                created.append(sql.split('"')[1])
            return self.con.execute(sql, *args)

        def __getattr__(self, name):
            return getattr(self.con, name)

    monkeypatch.setattr(catalog_module, "_connect", lambda *a, **kw: Recording(real(*a, **kw)))
    assert Catalog(paths).refresh() and created == []
    append_rows(paths, "metrics", "r", [{"rollout_id": 0, "step": 0, "name": "train/loss", "value": 1.0}])
    assert created == ["metrics"]  # the table's first file: its view now reads the files
    assert Catalog(paths).query("select count(*) from metrics")[1] == [(1,)] and created == ["metrics"]
