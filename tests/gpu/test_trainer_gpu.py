"""The loop's trainer (`TrainerActor.train`, what the Ray actor runs) on the device, both backends:
loss, grad norm and the weights after the step against the same step on the CPU. fp32 on both sides
within 1e-4 (another device's kernels); the CUDA default (bf16 forward, fp32 masters, the aligned
plan at world size 1 over NCCL) within bf16 bounds. Without CUDA (MILES_GPU_CHECKS_ON_CPU=1) the
"device" is the CPU and the check only proves the harness."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from loop_helpers import random_train_batch

from miles_platform.config import RunConfig
from miles_platform.training.actor import TrainerActor

pytestmark = pytest.mark.gpu

FP32_TOL = 1e-4
BF16_LOSS_TOL, BF16_PARAM_TOL = 5e-2, 5e-3  # lr 1e-3: a step moves a weight by ~1e-3


def _cfg(ckpt, **kw) -> RunConfig:
    base = dict(hf_checkpoint=ckpt, rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4,
                lr=1e-3, num_rollout=4, micro_batch_size=2)  # fmt: skip
    return RunConfig(**{**base, **kw}).validate()


def _step(cfg, device):
    a = TrainerActor(cfg, device=device)
    before = {k: v.clone() for k, v in a.get_hf_weights().items()}
    m = a.train(0, random_train_batch(0, rewards=[1.0, 0.0, 0.0, 1.0]))
    after = a.get_hf_weights()
    params = [p for p in a.backend.parameters()]
    return a, m, before, after, params


@pytest.mark.parametrize(
    "backend,forward",
    [("fsdp", "fp32"), ("fsdp", None), ("megatron", "fp32")],
    ids=["fsdp-fp32", "fsdp-default", "megatron-fp32"],
)
def test_trainer_train_on_the_device_matches_the_cpu(backend, forward, tiny_hf_checkpoint, device, record):
    if backend == "megatron" and importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed here (carry its wheel in .whl/, docs/scale_out.md)")
    flags = dict(train_backend=backend, train_forward_dtype=forward, rollout_dtype=forward)
    cfg = _cfg(tiny_hf_checkpoint, **flags)
    dev, m_dev, before, after_dev, params = _step(cfg, device)
    kinds = sorted({p.device.type for p in params})
    _, m_cpu, _, after_cpu, _ = _step(cfg, "cpu")
    moved = max(float((after_cpu[k] - before[k]).abs().max()) for k in before)
    pdiff = max(float((after_dev[k].float() - after_cpu[k].float()).abs().max()) for k in after_cpu)
    ldiff = abs(m_dev["train/loss"] - m_cpu["train/loss"])
    gdiff = abs(m_dev["train/grad_norm"] - m_cpu["train/grad_norm"])
    record(backend=backend, train_forward_dtype=dev.cfg.train_forward_dtype, param_devices=kinds,
           master_dtypes=sorted({str(p.dtype) for p in params}), loss_abs_diff=ldiff, grad_norm_abs_diff=gdiff,
           grad_norm=m_dev["train/grad_norm"], param_after_step_max_abs_diff=pdiff, step_moved_params_by=moved,
           logprob_abs_diff_vs_rollout=m_dev.get("train/train_rollout_logprob_abs_diff"),
           peak_device_mem_mb=m_dev.get("perf/actor_peak_device_mem_mb"))  # fmt: skip
    record.ran_on(*kinds)
    assert all(str(p.dtype) == "torch.float32" for p in params)  # fp32 masters on every device
    if dev.cfg.train_forward_dtype == "fp32":
        assert ldiff < FP32_TOL and gdiff < FP32_TOL * max(1.0, m_cpu["train/grad_norm"]) and pdiff < FP32_TOL
    else:  # the CUDA default: bf16 forward against the CPU's fp32
        assert ldiff < BF16_LOSS_TOL and pdiff < BF16_PARAM_TOL and moved > 0


def test_offload_and_onload_free_the_device_and_keep_the_state(tiny_hf_checkpoint, device, record):
    """--offload-train on the device: memory allocated drops while offloaded, every value returns."""
    a = TrainerActor(_cfg(tiny_hf_checkpoint), device=device)
    a.train(0, random_train_batch(0))
    dev = torch.device(device)
    mem = (lambda: torch.cuda.memory_allocated(dev)) if dev.type == "cuda" else (lambda: 0)
    before_w = {k: v.clone() for k, v in a.get_hf_weights().items()}
    state = {
        id(p): {k: v.detach().cpu().clone() for k, v in s.items() if torch.is_tensor(v)}
        for p, s in a.opt.state.items()
    }
    resident = mem()
    a.offload()
    parked = mem()
    a.onload()
    after_w = a.get_hf_weights()
    same_state = all(
        torch.equal(v, a.opt.state[p][k].detach().cpu()) for p in a.opt.state for k, v in state[id(p)].items()
    )
    record(resident_mb=resident / 2**20, offloaded_mb=parked / 2**20, ran_on_cuda=dev.type == "cuda")
    assert all(torch.equal(before_w[k], after_w[k]) for k in before_w) and same_state
    if dev.type == "cuda":
        assert parked < resident
