"""A policy version read back from the store is the one the loop handed its reporter: what the
`runs_from_catalog` sensor and a Ray-job run report is what the `rl_training` op reports."""

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
