"""On-policy distillation through the whole loop (Ray, engines, a teacher engine the run starts itself):
--ci-test holds, the shard carries the teacher's scores, opd/* metrics are logged, and the policy
versions have a `distilled_from` lineage edge to the teacher checkpoint by content hash."""

from __future__ import annotations

import os

import pytest
from loop_helpers import small_run_config

from miles_platform.loop import train
from miles_platform.models.checkpoint import content_hash
from miles_platform.store.lineage import cli_main
from miles_platform.store.paths import StoragePaths
from miles_platform.store.shards import read_rollout_shard


@pytest.mark.parametrize("top_k", [0, 3], ids=["sampled-token", "top-k"])
def test_opd_run_with_ci_test_records_teacher_scores_metrics_and_lineage(
    tiny_hf_checkpoint, tmp_path, capsys, top_k
):
    # the teacher is the student's initial checkpoint: --ci-test's step-0 invariants must hold and the
    # first rollout's reverse KL is ~0 (fp32 engine vs trainer); pure OPD (no --rm-type): task reward 0
    cfg = small_run_config(tiny_hf_checkpoint, tmp_path, rm_type=None, use_opd=True, opd_type="sglang",
                           opd_teacher_hf_checkpoint=tiny_hf_checkpoint, opd_log_prob_top_k=top_k,
                           ci_test=True, check_weight_update_equal=True)  # fmt: skip
    res = train(cfg)
    assert res.ci_checks["step0_ppo_kl"] < 1e-9
    first, last = res.metrics[0], res.metrics[-1]
    assert abs(first["opd/reverse_kl"]) < 1e-4
    assert abs(last["opd/reverse_kl"]) > 10 * abs(
        first["opd/reverse_kl"]
    )  # the student moved off the teacher
    assert all(m["rollout/raw_reward"] == 0.0 for m in res.metrics)
    assert first["opd/teacher_log_probs"] < 0 if top_k == 0 else "opd/teacher_log_probs" not in first
    samples = read_rollout_shard(StoragePaths(cfg.storage_root), cfg.run_name, 0)
    for s in samples:
        if top_k == 0:
            assert s.opd_reverse_kl is None
            assert s.teacher_log_probs == pytest.approx(s.rollout_log_probs, abs=1e-4)
        else:
            assert s.teacher_log_probs is None and len(s.opd_reverse_kl) == s.response_length
            assert "opd_student_top_logprobs" not in s.metadata  # transient, not shard data
    key = res.versions[-1]["partition_key"]
    want = {"teacher": os.path.abspath(tiny_hf_checkpoint), "kind": "checkpoint",
            "content_hash": content_hash(tiny_hf_checkpoint)}  # fmt: skip
    assert res.versions[-1]["distilled_from"] == [want]
    capsys.readouterr()
    assert cli_main([key, "--storage-root", cfg.storage_root]) == 0
    out = capsys.readouterr().out
    assert f"distilled_from: {want['teacher']}" in out, out


def test_the_launchpad_runs_opd_and_policy_versions_name_the_teacher(tiny_hf_checkpoint, tmp_path):
    """The rl_training job takes the OPD flags as run config; each policy_versions materialization
    carries `distilled_from` (the teacher checkpoint and its content hash) in its metadata."""
    import dagster as dg
    from loop_helpers import small_run_kwargs

    from ops.training import rl_training
    from resources.storage import StorageRootResource

    kw = small_run_kwargs(tiny_hf_checkpoint, tmp_path, num_rollout=1, rm_type="none", use_opd=True,
                          opd_type="sglang", opd_teacher_hf_checkpoint=tiny_hf_checkpoint)  # fmt: skip
    # rm_type is required in the Launchpad: `none` = no built-in reward (pure OPD here)
    kw.pop("storage_root")
    instance = dg.DagsterInstance.ephemeral()
    result = rl_training.execute_in_process(
        run_config={"ops": {"rl_training_op": {"config": kw}}}, instance=instance,
        resources={"storage": StorageRootResource(root=str(tmp_path / "root"))},
    )  # fmt: skip
    assert result.success
    flt = dg.AssetRecordsFilter(asset_key=dg.AssetKey("policy_versions"))
    (record,) = instance.fetch_materializations(flt, limit=5).records
    teachers = record.asset_materialization.metadata["distilled_from"].value
    assert teachers == [{"teacher": os.path.abspath(tiny_hf_checkpoint), "kind": "checkpoint",
                         "content_hash": content_hash(tiny_hf_checkpoint)}]  # fmt: skip
