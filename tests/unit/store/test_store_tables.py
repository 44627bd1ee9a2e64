import os
from datetime import UTC, datetime

import pytest

from miles_platform.store.paths import StoragePaths
from miles_platform.store.tables import TABLE_SCHEMAS, append_rows, read_rows


def test_append_is_one_part_per_call_and_reads_back_in_order(tmp_path):
    paths = StoragePaths(str(tmp_path))
    p1 = append_rows(
        paths, "metrics", "r1", [{"rollout_id": 0, "step": 0, "name": "train/loss", "value": 1.5}]
    )
    p2 = append_rows(
        paths,
        "metrics",
        "r1",
        [{"rollout_id": 1, "step": s, "name": "train/loss", "value": 1.0 - s} for s in range(2)],
    )
    append_rows(
        paths, "metrics", "r2", [{"rollout_id": 0, "step": 0, "name": "rollout/raw_reward", "value": 0.2}]
    )
    assert os.path.dirname(p1) == os.path.dirname(p2) == paths.table_dir("metrics", "r1")
    assert sorted(os.listdir(paths.table_dir("metrics", "r1"))) == sorted(
        [os.path.basename(p1), os.path.basename(p2)]
    )
    r1 = read_rows(paths, "metrics", "r1")
    assert [(r["rollout_id"], r["step"], r["value"]) for r in r1] == [(0, 0, 1.5), (1, 0, 1.0), (1, 1, 0.0)]
    assert all(r["run"] == "r1" and r["created_at"].tzinfo is not None for r in r1)
    assert len(read_rows(paths, "metrics")) == 4


def test_policy_version_row_has_every_column(tmp_path):
    paths = StoragePaths(str(tmp_path))
    ts = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    row = {
        "version": 1,
        "partition_key": "r.v000001",
        "parent_version": 0,
        "mean_reward": 0.5,
        "created_at": ts,
    }
    append_rows(paths, "policy_versions", "r", [row])
    (got,) = read_rows(paths, "policy_versions")
    assert set(got) == set(TABLE_SCHEMAS["policy_versions"].names)
    assert got["version"] == 1 and got["created_at"] == ts and got["checkpoint_path"] is None


def test_bad_rows_are_refused(tmp_path):
    paths = StoragePaths(str(tmp_path))
    with pytest.raises(ValueError, match=r"unknown column\(s\) \['score'\]"):
        append_rows(paths, "evals", "r", [{"metric": "pass@1", "score": 1.0}])
    with pytest.raises(ValueError, match="run 'other' differs"):
        append_rows(paths, "lineage", "r", [{"run": "other", "child": "r.v000001"}])
    with pytest.raises(ValueError, match="unknown table"):
        append_rows(paths, "nope", "r", [{}])
    assert append_rows(paths, "evals", "r", []) is None
    assert read_rows(paths, "evals") == []


def test_a_part_is_read_in_the_tables_layout_whatever_schema_wrote_it(tmp_path):
    """read_files takes each part with ParquetFile.read + conform (3x cheaper than read_table a small
    file): the same rows as `pq.read_table(f, schema=...)`, for a part written by this schema, by an
    older one (a column it lacks: null; another type: cast) and by a newer one (a column the table
    no longer has: dropped)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from miles_platform.store.schemas import SOURCE_PART
    from miles_platform.store.tables import list_files, read_files

    paths = StoragePaths(str(tmp_path))
    append_rows(paths, "metrics", "r", [{"rollout_id": 1, "step": 2, "name": "a", "value": 0.5}])
    d = paths.table_dir("metrics", "r")
    old = pa.table({"rollout_id": pa.array([3], pa.int32()), "name": ["b"], "value": [1.5], "gone": ["x"]})
    pq.write_table(old, f"{d}/part-{'9' * 20}-00000000.parquet")
    files = list_files(paths, "metrics", "r")
    got = read_files(paths, "metrics", files)
    schema = TABLE_SCHEMAS["metrics"].append(pa.field(SOURCE_PART, pa.string()))
    want = [pq.read_table(f, schema=schema).drop_columns([SOURCE_PART]).to_pylist()[0] for f in files]
    assert got.schema == schema
    assert got.drop_columns([SOURCE_PART]).to_pylist() == want
    assert want[1]["rollout_id"] == 3 and want[1]["step"] is None and "gone" not in want[1]


def _metric(rollout_id: int) -> dict:
    return {"rollout_id": rollout_id, "step": rollout_id, "name": "train/loss", "value": float(rollout_id)}


def test_buffered_parts_write_a_part_per_table_an_interval_not_one_per_append(tmp_path):
    """store/tables.BufferedParts: the recorder's and the trainer's rows, a part file per table
    every interval (each part costs ~1.5-2 ms of CPU); a flush or a close writes what is held now."""
    import time

    from miles_platform.store.tables import BufferedParts

    paths = StoragePaths(str(tmp_path))
    parts = BufferedParts(paths, interval_s=0.3)
    for r in range(5):
        parts.append("metrics", "r", [_metric(r)])
        parts.append("lineage", "r", [{"child": f"c{r}", "parent": "p", "relation": "trained_on"}])
    assert read_rows(paths, "metrics", "r") == []  # held, checked and stamped already
    stamped = time.time()
    deadline = time.monotonic() + 10
    while len(read_rows(paths, "lineage", "r")) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r["rollout_id"] for r in read_rows(paths, "metrics", "r")] == [0, 1, 2, 3, 4]
    assert len(os.listdir(paths.table_dir("metrics", "r"))) == 1  # one part for the five appends
    assert len(os.listdir(paths.table_dir("lineage", "r"))) == 1
    assert all(r["created_at"].timestamp() <= stamped for r in read_rows(paths, "metrics", "r"))
    parts.interval_s = 60.0
    parts.append("metrics", "r", [_metric(5)])
    order = []
    parts.call(lambda: order.append(len(read_rows(paths, "metrics", "r"))))  # on the thread, in order
    parts.flush()  # now, not in a minute
    assert order == [5] and [r["rollout_id"] for r in read_rows(paths, "metrics", "r")][-1] == 5
    parts.append("metrics", "r", [_metric(6)])
    parts.close()
    assert len(read_rows(paths, "metrics", "r")) == 7
    parts.append("metrics", "r", [_metric(7)])  # after a close: a new thread
    parts.flush()
    assert len(read_rows(paths, "metrics", "r")) == 8


def test_buffered_parts_refuse_bad_rows_at_once_and_raise_a_failed_write_at_the_next_call(tmp_path):
    from miles_platform.store.tables import BufferedParts

    paths = StoragePaths(str(tmp_path))
    parts = BufferedParts(paths, interval_s=60.0)
    with pytest.raises(ValueError, match="unknown table"):
        parts.append("nope", "r", [_metric(0)])
    with pytest.raises(ValueError, match="unknown column"):
        parts.append("metrics", "r", [{**_metric(0), "extra": 1}])
    (tmp_path / "tables").write_text("a file where the table dirs go")  # every write fails
    parts.append("metrics", "r", [_metric(0)])
    with pytest.raises(OSError):
        parts.flush()
    parts.flush()  # raised once
    parts.call(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        parts.flush()
