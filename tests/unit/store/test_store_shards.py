import os

import duckdb
import pyarrow.parquet as pq
import pytest

from miles_platform.data.sample import Sample
from miles_platform.store import shards
from miles_platform.store.paths import StoragePaths
from miles_platform.store.shards import (
    ROLLOUT_SCHEMA,
    list_rollout_shards,
    read_rollout_shard,
    shard_path,
    write_rollout_shard,
)


def make_samples(rollout_id=3, n=4, run="r1"):
    out = []
    for i in range(n):
        out.append(
            Sample(
                run=run,
                rollout_id=rollout_id,
                group_index=i // 2,
                index=i,
                prompt=f"{i}+1=",
                prompt_tokens=[5, 6, i],
                response=str(i + 1),
                response_tokens=[7 + i] * (i + 1),
                rollout_log_probs=[-0.1234567890123 * (j + 1) for j in range(i + 1)],
                loss_mask=[1] * (i + 1),
                label=str(i + 1),
                reward={"acc": 1.0, "fmt": 0.5} if i == 0 else float(i % 2),
                raw_reward=0.75 if i == 0 else None,
                status="truncated" if i == 3 else "completed",
                weight_version_start=2,
                weight_version_end=3 if i == 1 else 2,
                metadata={"rm_type": "math", "nested": {"k": [1, 2]}},
                remove_sample=i == 2,
            )
        )
    return out


def test_round_trip_exact_and_layout(tmp_path):
    paths = StoragePaths(str(tmp_path))
    samples = make_samples()
    info = write_rollout_shard(paths, "r1", 3, samples)
    assert info.path == f"{tmp_path}/rollouts/run=r1/rollout_id=000003/part-0.parquet"
    assert info.rows == 4 and info.bytes == os.path.getsize(info.path)
    assert info.mean_reward == pytest.approx((0.75 + 1 + 0 + 1) / 4)
    assert read_rollout_shard(paths, "r1", 3) == samples
    assert pq.read_schema(info.path).remove_metadata() == ROLLOUT_SCHEMA  # explicit types, lists typed
    assert os.listdir(os.path.dirname(info.path)) == ["part-0.parquet"]
    assert list_rollout_shards(paths, "r1") == [3]


def test_empty_lists_keep_their_types(tmp_path):
    paths = StoragePaths(str(tmp_path))
    write_rollout_shard(paths, "r", 0, [Sample(run="r", prompt="p")])
    assert (
        pq.read_schema(shard_path(paths, "r", 0)).field("rollout_log_probs").type
        == ROLLOUT_SCHEMA.field("rollout_log_probs").type
    )
    assert read_rollout_shard(paths, "r", 0) == [Sample(run="r", prompt="p")]


def test_rewrite_replaces(tmp_path):
    paths = StoragePaths(str(tmp_path))
    write_rollout_shard(paths, "r1", 3, make_samples(n=4))
    write_rollout_shard(paths, "r1", 3, make_samples(n=2))
    assert len(read_rollout_shard(paths, "r1", 3)) == 2
    assert os.listdir(paths.rollout_shard_dir("r1", 3)) == ["part-0.parquet"]


def test_sample_of_other_rollout_is_refused(tmp_path):
    with pytest.raises(ValueError, match="does not belong"):
        write_rollout_shard(StoragePaths(str(tmp_path)), "r1", 4, make_samples(rollout_id=3))


def test_crash_before_rename_leaves_no_visible_shard(tmp_path, monkeypatch):
    paths = StoragePaths(str(tmp_path))

    def crash(fs, src, dst):
        raise OSError("simulated crash mid-write")

    monkeypatch.setattr(shards, "_replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        write_rollout_shard(paths, "r1", 3, make_samples())
    shard_dir = paths.rollout_shard_dir("r1", 3)
    assert os.listdir(shard_dir) == []  # neither part file nor temp file
    assert list_rollout_shards(paths, "r1") == []


def test_crash_during_rewrite_keeps_previous_shard(tmp_path, monkeypatch):
    paths = StoragePaths(str(tmp_path))
    old = make_samples(n=4)
    write_rollout_shard(paths, "r1", 3, old)
    monkeypatch.setattr(shards.pq, "write_table", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        write_rollout_shard(paths, "r1", 3, make_samples(n=2))
    monkeypatch.undo()
    assert read_rollout_shard(paths, "r1", 3) == old
    assert os.listdir(paths.rollout_shard_dir("r1", 3)) == ["part-0.parquet"]


def test_duckdb_file_queries_rollouts_after_first_shard(tmp_path):
    paths = StoragePaths(str(tmp_path))
    write_rollout_shard(paths, "r1", 3, make_samples())
    write_rollout_shard(paths, "r1", 4, make_samples(rollout_id=4, n=2))
    con = duckdb.connect(paths.catalog)  # a plain DuckDB client, no refresh by us
    try:
        rows = con.execute(
            "SELECT rollout_id, count(*), sum(response_length) FROM rollouts GROUP BY 1 ORDER BY 1"
        ).fetchall()
    finally:
        con.close()
    assert rows == [(3, 4, 1 + 2 + 3 + 4), (4, 2, 1 + 2)]


def test_fsspec_uri_root_round_trip(tmp_path):
    """A URI root goes through fsspec end to end (memory:// stands in for s3://)."""
    import fsspec

    paths = StoragePaths("memory://miles-test-root")
    try:
        info = write_rollout_shard(paths, "r1", 3, make_samples())
        assert info.path == "memory://miles-test-root/rollouts/run=r1/rollout_id=000003/part-0.parquet"
        assert read_rollout_shard(paths, "r1", 3) == make_samples()
        assert list_rollout_shards(paths, "r1") == [3]
    finally:
        fsspec.filesystem("memory").rm("/miles-test-root", recursive=True)


def test_image_samples_record_each_image_content_hash(tmp_path):
    """A vision-language sample's shard row names its images by content hash (not their bytes)."""
    import base64

    from miles_platform.data.images import image_hash

    paths = StoragePaths(str(tmp_path))
    samples = make_samples(n=2)
    uris = ["data:image/png;base64," + base64.b64encode(b).decode() for b in (b"\x89PNG-a", b"\x89PNG-b")]
    samples[0].image_data = uris
    info = write_rollout_shard(paths, "r1", 3, samples)
    rows = pq.read_table(info.path).to_pylist()
    assert rows[0]["image_hashes"] == [image_hash(b"\x89PNG-a"), image_hash(b"\x89PNG-b")]
    assert rows[1]["image_hashes"] is None  # a text sample
    back = read_rollout_shard(paths, "r1", 3)
    assert back[0].image_data is None and back[1] == samples[1]  # the images live in the prompt dataset
    hashes = duckdb.sql(f"select image_hashes from read_parquet('{info.path}') where index = 0").fetchall()[
        0
    ][0]
    assert hashes == rows[0]["image_hashes"]


def test_has_parquet_finds_a_file_where_the_catalog_reads_one(tmp_path):
    """The first-file check of shards (any depth) and table parts (`run=*/` directly)."""
    d = tmp_path / "t"
    assert not shards.has_parquet(str(d)) and not shards.has_parquet(str(d), "run=")  # absent
    (d / "run=a").mkdir(parents=True)
    (d / "run=a" / ".part-1.parquet.tmp-0123").write_bytes(b"")  # a write in progress
    (d / "other").mkdir()
    (d / "other" / "x.parquet").write_bytes(b"")  # not a run's directory
    (d / "run=a" / "deeper").mkdir()
    (d / "run=a" / "deeper" / "y.parquet").write_bytes(b"")  # below a run's files
    assert not shards.has_parquet(str(d), "run=")
    assert shards.has_parquet(str(d))  # at any depth
    (d / "run=a" / "part-1.parquet").write_bytes(b"")
    assert shards.has_parquet(str(d), "run=")
    # a run's directory linked from another disk counts (fsspec's glob did not follow the link, so every
    # write into such a root refreshed the catalog again); a link loop ends
    elsewhere = tmp_path / "disk2" / "run=b"
    elsewhere.mkdir(parents=True)
    (elsewhere / "part-2.parquet").write_bytes(b"")
    linked = tmp_path / "linked"
    (linked / "run=b").parent.mkdir()
    (linked / "run=b").symlink_to(elsewhere)
    assert shards.has_parquet(str(linked), "run=") and shards.has_parquet(str(linked))
    (tmp_path / "loop").mkdir()
    (tmp_path / "loop" / "self").symlink_to(tmp_path / "loop")
    assert not shards.has_parquet(str(tmp_path / "loop"))


def test_writing_a_shard_or_a_part_does_not_list_every_file_of_the_root(tmp_path, monkeypatch):
    """Each shard and table part first asks whether it is the catalog's first file: that check
    stops at the first file found. It listed every shard and part directory of the root (an
    fsspec glob), so a run's step grew with its rollouts (rollout 400 of the bench recipe: the
    shard write 6 -> 30 ms, the version's rows 8 -> 21 ms)."""
    from miles_platform.store.tables import append_rows

    paths = StoragePaths(str(tmp_path))
    for rid in range(60):
        write_rollout_shard(paths, "r1", rid, make_samples(rid, n=1))
        append_rows(paths, "metrics", "r1", [{"rollout_id": rid, "step": rid, "name": "x", "value": 1.0}])
    listed = []
    real = os.scandir

    def scandir(path="."):
        listed.append(str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    write_rollout_shard(paths, "r1", 60, make_samples(60, n=1))
    append_rows(paths, "metrics", "r1", [{"rollout_id": 60, "step": 60, "name": "x", "value": 1.0}])
    assert len(listed) <= 6, listed


def test_the_column_wise_table_is_the_row_wise_one(tmp_path):
    """samples_to_table builds columns (1.49 -> ~0.6 ms for 128 samples): the same table as a row
    per `Sample.to_row`, for every kind of field: dict and float rewards, a non-string label,
    images, routes, turns, candidates, diffusion steps, all-None and mixed columns."""
    import base64

    import pyarrow as pa

    from miles_platform.data.sample import Status

    samples = make_samples(n=4)
    samples[0].label = {"answer": 3}  # JSON text in the row
    samples[1].status = Status.ABORTED  # an Enum: its value
    samples[1].image_data = ["data:image/png;base64," + base64.b64encode(b"\x89PNG-a").decode()]
    samples[2].rollout_routed_experts = [[[1, 2]], [[0, 3]]]
    samples[2].rollout_topk_token_ids, samples[2].rollout_topk_log_probs = [[4, 5]], [[-0.5, -1.5]]
    samples[3].teacher_log_probs, samples[3].diffusion_steps = [-0.1, -0.2, -0.3, -0.4], [1, 2]
    samples[3].turns = [{"role": "assistant", "text": "x", "start": 0, "end": 1, "finish_reason": "stop",
                         "tool_calls": [{"name": "f", "arguments": "{}", "result": "1", "error": None}]}]  # fmt: skip
    samples[3].image_png = b"\x89PNG"
    rows = pa.Table.from_pylist([shards._row(s) for s in samples], schema=ROLLOUT_SCHEMA)
    assert shards.samples_to_table(samples).equals(rows)
    assert shards.samples_to_table([]).equals(pa.Table.from_pylist([], schema=ROLLOUT_SCHEMA))
