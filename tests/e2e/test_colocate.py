"""--colocate on CPU: the offload / onload schedule (trainer offload, engine release / resume) and
the shared-memory weight hand-off run in the loop, and change nothing that is trained: the same seed
trains the same weights as a run with separate placement."""

from __future__ import annotations

import torch
from loop_helpers import small_run_config
from safetensors.torch import load_file

from miles_platform.loop import Reporter, train


def _run(ckpt, tmp_path, name, **kw):
    (tmp_path / name).mkdir()
    cfg = small_run_config(
        ckpt, tmp_path / name, run_name=name, num_rollout=3, ci_test=True, rollout_seed=7,
        custom_rm_path="loop_helpers.first_token_parity_rm", rm_type=None, **kw,
    )  # fmt: skip
    res = train(cfg, Reporter())
    return res, load_file(f"{res.final_hf_path}/model.safetensors")


def test_a_colocated_run_trains_the_same_weights_as_a_separate_one(tiny_hf_checkpoint, tmp_path):
    sep, w_sep = _run(tiny_hf_checkpoint, tmp_path, "separate")
    col, w_col = _run(tiny_hf_checkpoint, tmp_path, "colocated", colocate=True)
    assert sep.final_version == col.final_version == 3
    assert sorted(w_sep) == sorted(w_col)
    assert all(torch.equal(w_sep[k], w_col[k]) for k in w_sep)
    for a, b in zip(sep.metrics, col.metrics, strict=True):
        assert a["rollout/raw_reward"] == b["rollout/raw_reward"] and a["train/loss"] == b["train/loss"]
    m = col.metrics[-1]
    # the schedule ran: trainer parked, engines released and resumed, weights through shared memory
    assert m["perf/offload_train_time"] > 0 and m["perf/offload_rollout_time"] > 0
    assert m["perf/onload_rollout_time"] > 0 and m["perf/update_weights_shared_memory_bytes"] > 0
    assert "perf/offload_train_time" not in sep.metrics[-1]
