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
