"""A policy version read back from the store is the one the loop handed its reporter: what the
`runs_from_catalog` sensor and a Ray-job run report is what the `rl_training` op reports."""

from pathlib import Path

from store_builders import build_run

from miles_platform.config import RunConfig
from miles_platform.data.sample import Sample
from miles_platform.models.checkpoint import content_hash
from miles_platform.store.paths import StoragePaths
from miles_platform.store.run_health import saved_run_config
from miles_platform.store.shards import write_rollout_shard
from miles_platform.store.tables import read_rows
from miles_platform.store.versions import PolicyVersion, read_policy_versions, record_policy_version


def _read_back(paths: StoragePaths, run: str) -> list[PolicyVersion]:
    rows = read_rows(paths, "policy_versions", run)
    return read_policy_versions(paths, run, rows, saved_run_config(paths, run, rows))


def test_versions_read_back_equal_what_the_loop_reported(tmp_path, tiny_hf_checkpoint):
    paths = StoragePaths(str(tmp_path / "root"))
    reported = build_run(paths, "r", tiny_hf_checkpoint, 3, eval_interval=2)
    assert _read_back(paths, "r") == reported
    assert [pv.final for pv in reported] == [False, False, True]
    assert reported[0].base_checkpoint == tiny_hf_checkpoint and reported[0].eval_interval == 2


def test_a_distilled_versions_teachers_come_back_from_its_lineage(tmp_path, tiny_hf_checkpoint):
    paths = StoragePaths(str(tmp_path / "root"))
    cfg = RunConfig(run_name="d", hf_checkpoint=tiny_hf_checkpoint, prompt_data="p.jsonl", num_rollout=5,
                    rm_type="math")  # fmt: skip
    shard = write_rollout_shard(paths, "d", 0, [Sample(run="d", rollout_id=0, prompt="1+1=", reward=1.0)])
    teachers = [("http://127.0.0.1:30000", "url", None), (tiny_hf_checkpoint, "checkpoint", "h")]
    pv = record_policy_version(cfg, paths, 1, 0, 0, shard, tiny_hf_checkpoint, None,
                               content_hash(tiny_hf_checkpoint), "data", teachers)  # fmt: skip
    (back,) = read_policy_versions(paths, "d", read_rows(paths, "policy_versions", "d"), cfg)
    assert back == pv and len(back.distilled_from) == 2 and not back.final


def test_a_row_without_its_lineage_or_config_still_reads_back(tmp_path, tiny_hf_checkpoint):
    """A run whose config is gone (its checkpoints deleted): no final flag, no eval interval."""
    paths = StoragePaths(str(tmp_path / "root"))
    (pv,) = build_run(paths, "r", tiny_hf_checkpoint, 1, eval_interval=1)
    (back,) = read_policy_versions(paths, "r", read_rows(paths, "policy_versions", "r"), None)
    assert back.row() == pv.row() and back.parent_partition_key == "r.v000000"
    assert (back.final, back.eval_interval, back.base_checkpoint) == (False, None, tiny_hf_checkpoint)


def test_a_version_records_the_code_that_made_it_and_older_rows_read_as_null(
    tmp_path, tiny_hf_checkpoint, capsys
):
    import subprocess
    from importlib import metadata

    import pyarrow as pa
    import pyarrow.parquet as pq

    from miles_platform.store.catalog import Catalog
    from miles_platform.store.code_version import SOURCE_ROOT
    from miles_platform.store.lineage import cli_main
    from miles_platform.store.schemas import TABLE_SCHEMAS

    paths = StoragePaths(str(tmp_path / "root"))
    # an older root: a part file written before the code columns existed
    old = TABLE_SCHEMAS["policy_versions"]
    old = pa.schema([f for f in old if f.name not in ("platform_version", "git_commit", "git_dirty")])
    row = {"run": "r", "version": 9, "partition_key": "old.v000009", "parent_version": 8, "rollout_id": 8}
    old_file = Path(paths.table_dir("policy_versions", "r"), "part-00000000000000000000-old.parquet")
    old_file.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([row], schema=old), old_file)
    catalog = Catalog(paths)
    sql = "SELECT version, git_commit, git_dirty FROM policy_versions ORDER BY version"
    assert catalog.query(sql)[1] == [(9, None, None)]  # no file has the columns yet: they read as null
    (v1,) = build_run(paths, "r", tiny_hf_checkpoint, 1)

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(SOURCE_ROOT), *args], capture_output=True, text=True
        ).stdout.strip()

    head = git("rev-parse", "HEAD") or None  # None: the tests run from a tree that is not a checkout
    assert v1.git_commit == head
    assert v1.git_dirty is (
        None if head is None else bool(git("status", "--porcelain", "--untracked-files=no"))
    )
    assert v1.platform_version == metadata.version("miles-platform")
    back = {pv.version: pv for pv in _read_back(paths, "r")}
    assert back[1] == v1
    assert (back[9].platform_version, back[9].git_commit, back[9].git_dirty) == (None, None, None)
    assert catalog.query(sql)[1] == [(1, v1.git_commit, v1.git_dirty), (9, None, None)]

    assert cli_main(["r.v000001", "--storage-root", paths.root]) == 0
    text = capsys.readouterr().out
    if head:
        assert f"git_commit={head[:12]}" in text and f"git_dirty={v1.git_dirty}" in text
    assert f"platform_version={v1.platform_version}" in text
