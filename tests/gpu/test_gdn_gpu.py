"""Qwen3.5's gated-DeltaNet on the device: flash-linear-attention's kernel (what megatron-core's
GatedDeltaNet calls with CUDA) against the torch stand-in the CPU runs (training/megatron_gdn.py, which
tests/unit/models/test_qwen3_5_bridge.py checks against transformers' reference and the bridge's parity
rests on): outputs and every input's gradient, fp32 and bf16, over two 64-token chunks and a tail.
Needs flash-linear-attention (`.whl/`: flash_linear_attention, fla_core, einops) and megatron-core;
skipped without them, and without CUDA (fla's kernels are triton)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

# fp32 inputs: fla's triton dots may run in TF32 on the GPU (10-bit mantissa): bounds well above the
# ~1e-6 of the CPU stand-in against transformers, far below a wrong recurrence (O(1))
BOUND = {torch.float32: 5e-3, torch.bfloat16: 6e-2}


def _inputs(dtype: torch.dtype, device: str):
    """GatedDeltaNet's kernel inputs for B=2, T=144 (two chunks + 16), 2 key heads, 4 value heads (GVA
    repeated to 4 as megatron does before the call), head dims 32: q / k l2-normalized, g = -exp(A_log) *
    softplus(a + dt_bias) (log decay, negative), beta = sigmoid(b)."""
    from miles_platform.training.megatron_gdn import l2norm

    g = torch.Generator().manual_seed(0)
    B, T, H, D = 2, 144, 4, 32
    q = l2norm(torch.randn(B, T, H // 2, D, generator=g)).repeat_interleave(2, dim=2)
    k = l2norm(torch.randn(B, T, H // 2, D, generator=g)).repeat_interleave(2, dim=2)
    v = torch.randn(B, T, H, D, generator=g)
    a_log = torch.log(torch.empty(H).uniform_(1, 16, generator=g))
    gate = -a_log.exp() * torch.nn.functional.softplus(torch.randn(B, T, H, generator=g) + 1.0)
    beta = torch.rand(B, T, H, generator=g)
    # as megatron's forward passes them: g in fp32, the rest in the model's dtype
    return [t.to(device=device, dtype=torch.float32 if i == 3 else dtype).requires_grad_() for i, t in
            enumerate((q, k, v, gate, beta))]  # fmt: skip


def _run(fn, xs):
    out, _ = fn(*xs[:3], g=xs[3], beta=xs[4], initial_state=None, output_final_state=False)
    grads = torch.autograd.grad(out.float().square().sum(), xs)
    return out.detach().float().cpu(), [x.float().cpu() for x in grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_kernel_equals_the_cpu_stand_in(dtype, device, record):
    if device != "cuda":
        pytest.skip("flash-linear-attention's kernels are triton: CUDA only")
    pytest.importorskip("megatron.core", reason="megatron-core (`.whl/`) provides the torch stand-in")
    fla_rule = pytest.importorskip("fla.ops.gated_delta_rule", reason="flash-linear-attention in `.whl/`")
    from miles_platform.training.megatron_gdn import check_fla, chunk_gated_delta_rule

    check_fla(torch.device("cuda", 0))  # with fla installed a CUDA rank is not refused
    xs = _inputs(dtype, "cuda")
    ref_xs = [x.detach().cpu().float().requires_grad_() for x in xs]
    got, got_grads = _run(fla_rule.chunk_gated_delta_rule, xs)
    want, want_grads = _run(chunk_gated_delta_rule, ref_xs)
    rel, scale = _relative(got, want, got_grads, want_grads)
    record(dtype=str(dtype), max_rel_diff=rel, out_scale=scale, bound=BOUND[dtype])
    record.ran_on(xs[0].device.type)
    assert scale > 0.1, scale  # the outputs are not near zero: the comparison means something
    assert all(v < BOUND[dtype] for v in rel.values()), rel


def _relative(got, want, got_grads, want_grads) -> tuple[dict[str, float], float]:
    """Max abs difference of the output and of each gradient over that tensor's own max magnitude."""
    pairs = {"out": (got, want)} | {
        f"d{n}": p
        for n, p in zip(("q", "k", "v", "g", "beta"), zip(got_grads, want_grads, strict=True), strict=True)
    }
    rel = {k: float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) for k, (a, b) in pairs.items()}
    return rel, float(want.abs().max())
