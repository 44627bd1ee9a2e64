"""The demo's GRPO run end to end on one GPU, separate and colocated (tests/gpu/ray_free_grpo.py:
the loop's components without Ray, which the GPU check machine does not have): 20 rollouts each,
the --ci-test step-0 checkers, the engine serving exactly the trainer's weights after every update,
the training reward going up, and the colocated run's peak device memory below the separate one's.
Without CUDA (MILES_GPU_CHECKS_ON_CPU=1) a 2-rollout run on the CPU proves the harness only."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def demo_base(tmp_path_factory):
    from ray_free_grpo import SFT_ITERS, build_base

    cuda = torch.cuda.is_available()
    return build_base(str(tmp_path_factory.mktemp("grpo")), SFT_ITERS if cuda else 10)


def test_grpo_run_on_one_gpu_separate_and_colocated(demo_base, device, record):
    from ray_free_grpo import run

    base, data = demo_base
    cuda = torch.device(device).type == "cuda"
    n = 20 if cuda else 2
    runs = {}
    for colocate in (False, True):
        res = run(base, data["train"], device, n, colocate, log=lambda msg: None)
        runs["colocated" if colocate else "separate"] = res
    sep, col = runs["separate"], runs["colocated"]
    record(
        **{f"{k}_{f}": v[f] for k, v in runs.items() for f in ("seconds", "peak_mem_mb", "reward_first_half",
                                                              "reward_second_half", "engine_dtype")},
        ci_checks=sep["ci_checks"], rewards_separate=[r["raw_reward"] for r in sep["rollouts"]],
        rewards_colocated=[r["raw_reward"] for r in col["rollouts"]], reward=sep["reward"],
        train_forward_dtype=sep["train_forward_dtype"],
    )  # fmt: skip
    record.ran_on(torch.device(sep["device"]).type)
    for res in (sep, col):  # rollout_checks raised on a failure; the weights held after every update
        assert len(res["rollouts"]) == n and all(r["weights_equal"] for r in res["rollouts"])
    if cuda:
        assert sep["reward_second_half"] > sep["reward_first_half"], sep["rollouts"]
        assert col["reward_second_half"] > col["reward_first_half"], col["rollouts"]
        assert col["peak_mem_mb"] < sep["peak_mem_mb"], (col["peak_mem_mb"], sep["peak_mem_mb"])
