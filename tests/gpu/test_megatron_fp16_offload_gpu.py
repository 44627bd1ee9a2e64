"""--fp16 and --optimizer-cpu-offload on the megatron backend on CUDA: tests/megatron_fp16_cases.py's
report (one rank, the trainer on the GPU, megatron-core without the CPU shims), judged as
tests/unit/training/test_megatron_fp16_offload.py judges it on the CPU, where the trainer's device
is the host. Here the offloaded shards must be on the GPU and their copies, gradients and optimizer
state on the host (HybridDeviceOptimizer's pinned copies, CUDA streams); the fp16 step uses CUDA's
fp16 kernels (transformer-engine's layers when it imports)."""

from __future__ import annotations

import pytest
from megatron_fp16_cases import SCALE, STEP_RTOL, run

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def report(tiny_hf_checkpoint, tmp_path_factory):
    return run(tiny_hf_checkpoint, tmp_path_factory.mktemp("fp16_offload_gpu") / "out")


def test_megatron_fp16_step_and_loss_scaling_on_the_device(report, record):
    record.ran_on(report["offload_trainer_device"].split(":")[0])
    record(step_rel_diff=report["step_rel_diff"], scaler_after_inf=report["scaler_after_inf"],
           scaler_after_window=report["scaler_after_window"], export_dtypes=report["export_dtypes"])  # fmt: skip
    assert report["dtypes"] == ["torch.float16"] and report["main_dtypes"] == ["torch.float32"]
    assert 0 < report["step_rel_diff"] < STEP_RTOL
    assert report["inf"]["train/loss_scale_skipped_steps"] == 1 and not report["inf_moved_main"]
    assert (
        report["scaler_after_inf"]["scale"] == SCALE / 2 and report["scaler_after_window"]["scale"] == SCALE
    )
    assert report["scaler_loaded"] == report["scaler_after_clean"]
    assert report["d_inf"]["train/loss_scale_skipped_steps"] == 1 and report["d_clean_moved"]
    assert report["d_scaler_loaded"] == report["d_scaler_saved"]
    assert report["export_dtypes"] == ["torch.float16"]


@pytest.mark.parametrize("case", ["offload", "overlap", "trio"])
def test_megatron_optimizer_cpu_offload_on_the_device(report, record, case):
    """trio: Miles' --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer,
    the fp32 masters in the host optimizer only (CUDA streams, pinned copies: megatron-core unshimmed)."""
    where = report[f"{case}_placement"]
    record.ran_on(report[f"{case}_trainer_device"].split(":")[0])
    record(
        placement=where,
        step_diff=report[f"{case}_step_diff"],
        resumed_diff=report["trio_resumed_diff" if case == "trio" else "offload_resumed_diff"],
    )
    assert (
        all(d.startswith("cuda") for d in where["param"])
        if report[f"{case}_trainer_device"] != "cpu"
        else True
    )
    assert where["host_copy"] == where["host_grad"] == where["state"] == ["cpu"]
    assert where["offloaded"] > 0 and where["shared"] == 0 and where["device_optimizers"] == 0
    assert report[f"{case}_step_diff"] <= 1e-6
    # GPU kernels may reduce in another order between two runs of a step: 1e-6, not bit-equality
    resumed = "trio" if case == "trio" else "offload"
    assert report[f"{resumed}_loaded"] and report[f"{resumed}_load_diff"] == 0.0
    assert report[f"{resumed}_resumed_diff"] <= 1e-6
    assert (
        report[f"{resumed}_reloaded_off_model"] == 0.0
    )  # --no-load-optim: the loaded weights are the masters
    if case == "trio":
        assert where["master"] == ["cpu"] and where["main_shards"] == 0
        assert where["dtypes"] == ["bfloat16 -> float32"]
