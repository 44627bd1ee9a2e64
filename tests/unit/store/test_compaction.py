"""Tables that stay small (issue 51): a run's part files of each append-only table are merged into one
file (per run, under its lock, automatically when a run ends, or `miles-platform compact`), every
row kept in append order, the catalog answering the same queries; a crash at any step of a
compaction leaves readers seeing each row once, and running it again repairs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from store_builders import add_evals, build_run

from miles_platform.cli import main as cli_main
from miles_platform.config import RunConfig
from miles_platform.store import compaction, tables
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import TABLES, StoragePaths
from miles_platform.store.run_events import record_resume
from miles_platform.store.run_lock import RunLock, RunLocked, local_run_dir
from miles_platform.store.scoreboard import evals_part_names
from miles_platform.store.tables import append_rows, list_files, read_parts, read_rows

QUERIES = [
    *(f"SELECT * FROM {t} ORDER BY ALL" for t in TABLES),
    "SELECT run, status, count(*), max(version) FROM policy_versions GROUP BY ALL ORDER BY ALL",
    "SELECT run, status, name, sum(value) FROM metrics GROUP BY ALL ORDER BY ALL",
    "SELECT p.partition_key, m.name, m.value, m.status FROM policy_versions p JOIN metrics m "
    "ON p.run = m.run AND p.rollout_id = m.rollout_id ORDER BY ALL",
    "SELECT run, count(*) FROM rollouts GROUP BY ALL ORDER BY ALL",
    "SELECT child, parent, relation FROM lineage WHERE run = 'a' ORDER BY ALL",
]


def _metrics(rid: int, n: int = 3) -> list[dict]:
    return [{"rollout_id": rid, "step": rid, "name": f"train/m{i}", "value": rid + i / 10} for i in range(n)]


@pytest.fixture
def root(tiny_hf_checkpoint, tmp_path) -> StoragePaths:
    """Two runs written by the store's writers: versions, lineage, metrics, evals, and a resume of
    run a that abandoned its versions 3 and 4 (their status: abandoned) before training on."""
    paths = StoragePaths(str(tmp_path / "root"))
    build_run(paths, "a", tiny_hf_checkpoint, num_rollout=4)
    record_resume(paths, "a", rollout_id=1, version=2, highest=4, changes=[])
    for rid in (2, 3):
        append_rows(paths, "metrics", "a", _metrics(rid))
    add_evals(paths, "a", [(1, 0.25, "loop"), (2, 0.5, "asset")])
    build_run(paths, "b", tiny_hf_checkpoint, num_rollout=2)
    add_evals(paths, "b", [(1, 0.75, "loop")])
    return paths


def snapshot(paths: StoragePaths) -> dict:
    """What every reader sees: each table's rows (per run and all runs, in append order), the
    sensor's parts, the scoreboard's part names, and the catalog's answers."""
    out = {("rows", t, r): read_rows(paths, t, r) for t in TABLES for r in ("a", "b", None)}
    out["parts"] = [(p, rows) for p, rows in read_parts(paths, "policy_versions", "a")]
    out["evals_parts"] = evals_part_names(paths)
    catalog = Catalog(paths)
    out |= {q: catalog.query(q) for q in QUERIES}
    return out


def file_counts(paths: StoragePaths) -> dict:
    return {(t, r): len(list_files(paths, t, r)) for t in TABLES for r in ("a", "b")}


def test_compact_keeps_every_row_and_the_catalog_answers_the_same(root):
    before = snapshot(root)
    assert any(n > 3 for n in file_counts(root).values())  # one file per append
    assert ("a", "abandoned", 2, 4) in before[QUERIES[len(TABLES)]][1]

    cursor = before["parts"][1][0]  # the runs_from_catalog sensor's: the newest part it handled
    newer = read_parts(root, "policy_versions", "a", after=cursor)
    assert [p for p, _ in newer] == [p for p, _ in before["parts"][2:]]

    assert cli_main(["compact", "--storage-root", root.root]) == 0
    assert read_parts(root, "policy_versions", "a", after=cursor) == newer
    assert file_counts(root) == {(t, r): 1 for t in TABLES for r in ("a", "b") if t != "run_events"} | {
        ("run_events", "a"): 1,
        ("run_events", "b"): 0,
        ("train_samples", "a"): 0,
        ("train_samples", "b"): 0,
    }  # fmt: skip (the root has no train_samples rows)
    assert snapshot(root) == before

    # appends after a compaction: merged with the compacted file by the next one, order kept
    append_rows(root, "metrics", "a", _metrics(4))
    append_rows(root, "metrics", "a", _metrics(5))
    grown = read_rows(root, "metrics", "a")
    assert grown[: len(before["rows", "metrics", "a"])] == before["rows", "metrics", "a"]
    assert [r["rollout_id"] for r in grown[-6:]] == [4, 4, 4, 5, 5, 5]
    assert cli_main(["compact", "--storage-root", root.root, "--run", "a"]) == 0
    assert len(list_files(root, "metrics", "a")) == 1 and read_rows(root, "metrics", "a") == grown
    # nothing left to do: no file rewritten
    files = {t: list_files(root, t, "a") for t in TABLES}
    assert (
        compaction.compact_tables(root, "a") == [] and {t: list_files(root, t, "a") for t in TABLES} == files
    )


class Crash(BaseException):
    """A process killed mid-step (BaseException: nothing in between catches it)."""


@pytest.mark.parametrize("step", ["while_writing", "after_writing", "mid_delete"])
def test_a_crash_at_any_step_shows_each_row_once_and_a_rerun_repairs(root, monkeypatch, step):
    before = snapshot(root)
    write, remove = compaction.write_parquet_atomic, compaction._remove

    def crash_write(data, path):
        if step == "while_writing":  # killed mid-write: its hidden temp file stays (and a live writer's)
            directory, _, name = path.rpartition("/")
            for tmp, age in ((f".{name}.tmp-0123456789ab", 7200), (".part-live.parquet.tmp-ba9876543210", 0)):
                Path(directory, tmp).write_bytes(b"PAR1")
                os.utime(Path(directory, tmp), (time.time() - age, time.time() - age))
            raise Crash
        return write(data, path)

    def crash_remove(paths, table, files):
        if step == "mid_delete" and len(files) > 2:
            remove(paths, table, files[1:3])  # some of the merged parts gone, the others left
        raise Crash

    monkeypatch.setattr(compaction, "write_parquet_atomic", crash_write)
    monkeypatch.setattr(compaction, "_remove", crash_remove)
    with pytest.raises(Crash):
        compaction.compact_run(root, "a")
    if step != "while_writing":  # the compacted file and (some of) the parts it merged, side by side
        names = [f.rsplit("/", 1)[1] for f in list_files(root, TABLES[0], "a")]  # the first compacted
        assert sum(tables.is_compacted(n) for n in names) == 1 and len(names) > 1
    assert snapshot(root) == before  # no reader sees a row twice, none misses one

    monkeypatch.undo()
    compaction.compact_run(root, "a")
    assert all(
        n == 1 for (t, r), n in file_counts(root).items() if r == "a" and t != "train_samples"
    )  # no rows
    assert snapshot(root) == before
    if step == "while_writing":  # the dead writer's temp file removed, the live one's left alone
        hidden = [p.name for p in Path(root.table_dir(TABLES[0], "a")).iterdir() if p.name.startswith(".")]
        assert hidden == [".part-live.parquet.tmp-ba9876543210"]


def test_a_reader_that_listed_the_parts_before_a_compaction_lists_again(root, monkeypatch):
    want = read_rows(root, "metrics", "a")
    real = tables.list_files
    calls = []

    def list_then_compact(paths, table, run=None):
        files = real(paths, table, run)
        if not calls:  # the compaction deletes what this reader just listed
            compaction.compact_table(paths, table, run)
        calls.append(len(files))
        return files

    monkeypatch.setattr(tables, "list_files", list_then_compact)
    assert read_rows(root, "metrics", "a") == want
    assert calls[0] > 1 and calls[1] == 1


def test_a_reader_that_listed_mid_compaction_needs_no_part_the_compaction_deletes(root, monkeypatch):
    """Listed after the compacted file was written, before its parts were deleted (which happens
    right after the listing): the compacted file is read first and the parts it holds are not opened,
    so the stale listing reads in one go (before: FileNotFoundError, relisted, and under load a
    Dagster run's reconcile failed when every relisting met another deletion; seen 2026-12-05)."""
    want = read_rows(root, "metrics", "a")
    real = tables.list_files
    calls = []

    def list_mid_compaction(paths, table, run=None):
        if not calls:
            parts = real(paths, table, run)
            monkeypatch.setattr(compaction, "_remove", lambda *a: None)  # the c-file, parts still there
            compaction.compact_table(paths, table, run)
            files = real(paths, table, run)
            for p in parts:  # the compaction's deletion, just after this listing
                os.remove(p)
        else:
            files = real(paths, table, run)
        calls.append(len(files))
        return files

    monkeypatch.setattr(tables, "list_files", list_mid_compaction)
    assert read_rows(root, "metrics", "a") == want
    assert len(calls) == 1 and calls[0] > 2  # one listing: the compacted file and the deleted parts


def test_a_run_being_written_is_not_compacted(root, capsys):
    with RunLock(local_run_dir(root, "a"), "a"):
        with pytest.raises(RunLocked, match="run 'a' is being written"):
            compaction.compact_run(root, "a")
        assert cli_main(["compact", "--storage-root", root.root]) == 1  # b done, a skipped
        assert cli_main(["compact", "--storage-root", root.root, "--run", "a"]) == 2
    err = capsys.readouterr().err
    assert "skipped run 'a'" in err and "miles-platform compact: error: run 'a' is being written" in err
    assert len(list_files(root, "metrics", "a")) > 1 and len(list_files(root, "metrics", "b")) == 1


def test_a_run_compacts_its_tables_when_it_ends_not_when_it_fails(tmp_path, monkeypatch):
    import miles_platform.cluster.ray_cluster as rc
    from miles_platform.run_lifecycle import RunLifecycle

    monkeypatch.setattr(rc, "init_ray", lambda cfg, **kw: None)
    monkeypatch.setattr(rc, "shutdown_ray", lambda ctx: None)
    paths = StoragePaths(str(tmp_path / "root"))
    lines = []
    for run, fails in (("ok", False), ("failed", True)):
        cfg = RunConfig(run_name=run, storage_root=paths.root)
        with pytest.raises(RuntimeError) if fails else _nothing(), RunLifecycle(cfg, paths, lines.append):
            for rid in range(3):
                append_rows(paths, "metrics", run, _metrics(rid))
            if fails:
                raise RuntimeError("trainer died")
    assert len(list_files(paths, "metrics", "ok")) == 1 and len(read_rows(paths, "metrics", "ok")) == 9
    assert len(list_files(paths, "metrics", "failed")) == 3
    assert any("[compact] run 'ok': metrics 3 files -> 1 (9 rows)" in m for m in lines), lines


def test_the_compaction_runs_beside_rays_shutdown_and_ends_before_the_run_lock_goes(tmp_path, monkeypatch):
    """Ray's shutdown mostly waits for its processes: the compaction runs on a thread beside it (the
    shutdown here returns only once the compaction has started, which a serial order never does),
    and the run lock is released after both."""
    import threading

    import miles_platform.cluster.ray_cluster as rc
    import miles_platform.store.compaction as compaction
    from miles_platform.run_lifecycle import RunLifecycle
    from miles_platform.store.run_lock import RunLock

    started, seen, order = threading.Event(), threading.Event(), []
    real = compaction.compact_tables

    def compact(*a, **kw):
        started.set()
        seen.wait(5)
        out = real(*a, **kw)
        order.append("compacted")
        return out

    def shutdown(ctx):
        order.append(f"shutdown saw the compaction started: {started.wait(5)}")
        seen.set()

    release = RunLock.release
    monkeypatch.setattr(RunLock, "release", lambda self: (order.append("lock released"), release(self)))
    monkeypatch.setattr(compaction, "compact_tables", compact)
    monkeypatch.setattr(rc, "init_ray", lambda cfg, **kw: None)
    monkeypatch.setattr(rc, "shutdown_ray", shutdown)
    paths = StoragePaths(str(tmp_path / "root"))
    cfg = RunConfig(run_name="ok", storage_root=paths.root)
    with RunLifecycle(cfg, paths, lambda m: None):
        for rid in range(3):
            append_rows(paths, "metrics", "ok", _metrics(rid))
    assert order == ["shutdown saw the compaction started: True", "compacted", "lock released"], order
    assert len(list_files(paths, "metrics", "ok")) == 1


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_an_object_store_root_is_compacted_the_same(s3_server, monkeypatch, tmp_path):
    pytest.importorskip("moto.server", reason="moto[server] not installed")
    from store_builders import point_s3_at

    from miles_platform.store import remote

    point_s3_at(monkeypatch, s3_server)
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))
    fs, _ = remote.filesystem("s3://compaction")
    if not fs.exists("compaction"):
        fs.mkdir("compaction")
    paths = StoragePaths("s3://compaction/root")
    for rid in range(3):
        append_rows(paths, "metrics", "r", _metrics(rid, 2))
        append_rows(paths, "lineage", "r", [{"child": f"r.v{rid + 1:06d}", "parent": f"r.v{rid:06d}",
                                             "relation": "trained_from"}])  # fmt: skip
    queries = ["SELECT * FROM metrics ORDER BY ALL", "SELECT child, parent FROM lineage ORDER BY ALL"]
    before = [read_rows(paths, "metrics", "r"), read_rows(paths, "lineage")]
    before += [Catalog(paths).query(q) for q in queries]

    def crash_remove(paths, table, files):
        raise Crash

    monkeypatch.setattr(compaction, "_remove", crash_remove)
    with pytest.raises(Crash):
        compaction.compact_run(paths, "r")
    monkeypatch.setattr(compaction, "_remove", _real_remove)
    mid = [read_rows(paths, "metrics", "r"), read_rows(paths, "lineage")]
    assert mid + [Catalog(paths).query(q) for q in queries] == before
    assert len(list_files(paths, "lineage", "r")) == 4  # compacted first (TABLES order), then the crash

    assert cli_main(["compact", "--storage-root", paths.root]) == 0
    assert len(list_files(paths, "metrics", "r")) == len(list_files(paths, "lineage", "r")) == 1
    after = [read_rows(paths, "metrics", "r"), read_rows(paths, "lineage")]
    assert after + [Catalog(paths).query(q) for q in queries] == before


_real_remove = compaction._remove


def test_a_query_whose_file_vanished_under_it_is_asked_again(tmp_path, monkeypatch):
    """DuckDB lists a view's files, then opens them: a compaction deleting one in between fails
    that query with an IO error, and the catalog asks it again (a bad path of the user's: an error)."""
    import duckdb

    from miles_platform.store import catalog as catalog_mod

    paths = StoragePaths(str(tmp_path / "root"))
    append_rows(paths, "metrics", "r", _metrics(0))
    cat, real, calls = Catalog(paths), Catalog._query_once, []

    def vanished_once(self, sql):
        calls.append(sql)
        if len(calls) == 1:
            raise catalog_mod._FileVanished("IO Error: Cannot open file: No such file or directory")
        return real(self, sql)

    monkeypatch.setattr(Catalog, "_query_once", vanished_once)
    assert cat.query("SELECT count(*) FROM metrics") == (["count_star()"], [(3,)]) and len(calls) == 2
    monkeypatch.undo()
    try:
        duckdb.connect().execute(f"SELECT * FROM read_parquet('{tmp_path}/gone/part-1.parquet')")
    except duckdb.Error as e:
        assert catalog_mod._vanished(e)
    with pytest.raises(catalog_mod.CatalogError, match="No files found"):
        cat.query(f"SELECT * FROM read_parquet('{tmp_path}/gone/part-1.parquet')")
