"""--fp16 on the megatron backend (training/megatron_precision.py): fp16 weights and forward, fp32 main
parameters, megatron-core's grad scaler around the actor's step, with and without the distributed
optimizer; --optimizer-cpu-offload (training/megatron_distopt.py): megatron-core's HybridDeviceOptimizer
under the distributed optimizer, with --use-precision-aware-optimizer its fp32 master copies. One gloo rank runs every case (tests/megatron_fp16_cases.py); the
tests assert on its report. tests/gpu/test_megatron_fp16_offload_gpu.py judges the same on CUDA.
"""

from __future__ import annotations

import pytest
from megatron_fp16_cases import SCALE, STEP_RTOL, run


@pytest.fixture(scope="module")
def report(tiny_hf_checkpoint, tmp_path_factory):
    return run(tiny_hf_checkpoint, tmp_path_factory.mktemp("fp16_offload") / "out")


def test_fp16_step_is_the_fp32_step_within_fp16_rounding(report):
    assert report["dtypes"] == ["torch.float16"] and report["main_dtypes"] == ["torch.float32"]
    assert 0 < report["step_rel_diff"] < STEP_RTOL
    m32, m16 = report["fp32"], report["fp16"]
    assert m16["train/grad_norm"] == pytest.approx(m32["train/grad_norm"], rel=STEP_RTOL)
    assert m16["train/loss_scale"] == SCALE and m16["train/loss_scale_skipped_steps"] == 0
    assert report["scaler_after_step"] == {"scale": SCALE, "growth_tracker": 1, "hysteresis_tracker": 1}


def test_an_inf_gradient_skips_the_step_and_halves_the_scale(report):
    m = report["inf"]
    assert m["train/loss_scale_skipped_steps"] == 1 and m["train/nonfinite_steps"] == 0
    assert not report["inf_moved_main"] and not report["inf_moved_model"]
    assert (
        report["scaler_after_inf"]["scale"] == SCALE / 2 and report["scaler_after_inf"]["growth_tracker"] == 0
    )
    # the distributed optimizer: megatron's own prepare_grads unscales, checks and updates its scaler
    assert report["d_inf"]["train/loss_scale_skipped_steps"] == 1 and not report["d_inf_moved"]
    assert report["d_scaler_after_inf"]["scale"] == SCALE / 2
    assert report["d_clean"]["train/loss_scale_skipped_steps"] == 0 and report["d_clean_moved"]


def test_the_scale_grows_after_the_window(report):
    assert report["scaler_after_clean"] == {"scale": SCALE / 2, "growth_tracker": 1, "hysteresis_tracker": 0}
    assert report["scaler_after_window"]["scale"] == SCALE  # 2 clean steps: --loss-scale-window 2
    assert report["scaler_after_window"]["growth_tracker"] == 0


def test_the_scaler_is_saved_and_restored_with_the_optimizer(report):
    assert report["loaded"] and report["main_loaded"]
    assert report["scaler_loaded"] == report["scaler_after_clean"]
    assert report["d_scaler_loaded"] == report["d_scaler_saved"]


def test_fp16_exports_fp16_weights(report):
    assert report["export_dtypes"] == ["torch.float16"]  # Miles serves --fp16 with SGLang dtype float16


@pytest.mark.parametrize("case", ["offload", "overlap", "trio"])
def test_the_offloaded_step_is_the_step_on_the_device(report, case):
    """trio: --use-precision-aware-optimizer too; its host optimizer updates its fp32 master copies
    as the distributed optimizer updates its fp32 main shards (same gradients, clip, AdamW)."""
    assert report[f"{case}_step_diff"] <= 1e-6  # measured 6e-8: torch's fused (host) vs foreach AdamW


@pytest.mark.parametrize("case", ["offload", "overlap", "trio"])
def test_offloaded_state_lives_on_the_host_and_parameters_on_the_trainer_device(report, case):
    """Every main parameter shard is offloaded: a host copy of its own (not the shard's storage, so
    the state is not the device's, on a GPU or here where the trainer's device is the host), its
    gradient copied to the host, the optimizer state on the host; no device-side optimizer."""
    where = report[f"{case}_placement"]
    assert where["param"] == [report[f"{case}_trainer_device"]]
    assert where["host_copy"] == where["host_grad"] == where["state"] == ["cpu"]
    assert where["offloaded"] > 0 and where["shared"] == 0 and where["device_optimizers"] == 0
    # --overlap-cpu-optimizer-d2h-h2d: megatron's one host optimizer per shard, else one for all
    assert report[f"{case}_host_optimizers"] == (where["offloaded"] if case != "offload" else 1)
    if case == "trio":  # the fp32 masters live in the host optimizer only; it steps the bf16 shards' copies
        assert where["master"] == ["cpu"] and where["main_shards"] == 0
        assert where["dtypes"] == ["bfloat16 -> float32"]
    else:  # the distributed optimizer's own fp32 main shards, copied to the host
        assert where["master"] == [] and where["main_shards"] == where["offloaded"]
        assert where["dtypes"] == ["float32 -> float32"]


@pytest.mark.parametrize("case", ["offload", "trio"])
def test_the_offloaded_optimizer_resumes_to_the_same_step(report, case):
    assert report[f"{case}_loaded"] and report[f"{case}_load_diff"] == 0.0
    assert report[f"{case}_resumed_diff"] == 0.0


@pytest.mark.parametrize("case", ["offload", "trio"])
def test_weights_loaded_without_the_optimizer_become_its_fp32_masters(report, case):
    """--no-load-optim: load_model's weights reach the optimizer's fp32 masters and host copies (else the
    next step writes the stale ones back: measured 5.2e-3 off, the step in between)."""
    assert report[f"{case}_stepped_off_model"] > 0  # the masters the step left: not the bf16 weights
    assert report[f"{case}_reloaded_off_model"] == 0.0
