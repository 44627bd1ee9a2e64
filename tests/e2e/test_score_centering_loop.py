"""--loss-type score_centering through the whole loop (Ray, the embedded engine, shards, the trainer):
the shard carries each sample's [n][K] candidates, DuckDB reads them, and the train/sc_* metrics are
logged; at rollout 0 the trainer is the sampler, so the centering coefficients vanish."""

from __future__ import annotations

import pytest
from loop_helpers import small_run_config

from miles_platform.loop import train
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths
from miles_platform.store.shards import read_rollout_shard


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [-1, 4], ids=["selected", "support"])
def test_a_score_centering_run_records_candidates_and_logs_its_metrics(tiny_hf_checkpoint, tmp_path, top_k):
    cfg = small_run_config(
        tiny_hf_checkpoint, tmp_path, loss_type="score_centering", rollout_top_logprobs_num=4,
        use_rollout_logprobs=True, rollout_top_k=top_k, rollout_temperature=0.8, ci_test=True,
        disable_grpo_std_normalization=True, calculate_per_token_loss=True, score_centering_is="tis",
    )  # fmt: skip
    res = train(cfg)
    first = res.metrics[0]
    for key in ("sc_correction", "sc_train_head_mass", "sc_rollout_head_mass", "sc_tail_ratio",
                "sc_importance_weight", "train_rollout_logprob_abs_diff"):  # fmt: skip
        assert f"train/{key}" in first, sorted(first)
    assert first["train/sc_correction"] < 1e-4 and first["train/train_rollout_logprob_abs_diff"] < 1e-5
    samples = read_rollout_shard(StoragePaths(cfg.storage_root), cfg.run_name, 0)
    for s in samples:
        assert len(s.rollout_topk_token_ids) == len(s.rollout_topk_log_probs) == s.response_length
        assert all(len(row) == 4 for row in s.rollout_topk_token_ids)
    _, rows = Catalog(StoragePaths(cfg.storage_root)).query(
        "select len(rollout_topk_token_ids[1]), rollout_topk_log_probs[1][1] from rollouts where rollout_id = 0"
    )
    assert {r[0] for r in rows} == {4} and all(r[1] < 0 for r in rows)
