"""kernels/* on device tensors against the CPU reference: bit-exact where the math is exact (fp8
block and int4 group quantization, xor / overwrite deltas), 1e-4 for log-probs and entropy."""

from __future__ import annotations

import pytest
import torch

from kernels import logprob as kl
from kernels import quant as kq
from kernels import xor_delta as kx

pytestmark = pytest.mark.gpu


def _maxdiff(a, b) -> float:
    return float((a.detach().float().cpu() - b.detach().float().cpu()).abs().max())


# ------------------------------------------------------------------------------------------- fp8


def _fp8_case(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=g) * torch.logspace(-3, 1, 260)
    if name == "300x260_fp32":
        return w
    return torch.randn(4096, 4096, generator=g).to(torch.bfloat16)  # the same draw order as one run


@pytest.mark.parametrize("case", ["300x260_fp32", "4096x4096_bf16"])
def test_fp8_block_quant_is_bit_exact_vs_cpu(case, device, record):
    w = _fp8_case(case)
    q_c, s_c = kq.fp8_block_quant(w)
    q_d, s_d = kq.fp8_block_quant(w.to(device))
    qb_c, qb_d = q_c.view(torch.uint8), q_d.cpu().view(torch.uint8)
    deq_d, deq_c = kq.fp8_block_dequant(q_d, s_d), kq.fp8_block_dequant(q_c, s_c)
    dequant_diff = _maxdiff(deq_c, deq_d)
    record(
        q_mismatching_elements=int((qb_c != qb_d).sum()),
        scale_inv_mismatching_blocks=int((s_c != s_d.cpu()).sum()),
        scale_inv_max_rel_diff=float(((s_c - s_d.cpu()).abs() / s_c).max()),
        scale_inv_numel=s_c.numel(),
        dequant_max_abs_diff=dequant_diff,
        roundtrip_max_rel_err=float((deq_d.cpu().float() - w.float()).abs().max() / w.float().abs().max()),
        roundtrip_max_rel_err_cpu=float((deq_c.float() - w.float()).abs().max() / w.float().abs().max()),
    )
    record.ran_on(q_d.device.type)
    assert torch.equal(qb_c, qb_d), "fp8 codes differ from the CPU's"
    assert torch.equal(s_c, s_d.cpu()), "block scales differ from the CPU's"
    assert dequant_diff == 0.0


# ------------------------------------------------------------------------------------------ int4


@pytest.fixture(scope="module")
def int4_weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(300, 256, generator=g) * torch.logspace(-3, 1, 256)).to(torch.bfloat16)


def test_int4_quant_is_exact_vs_cpu(int4_weight, device, record):
    w = int4_weight
    q_c, s_c = kq.int4_quant(w, 128)
    q_d, s_d = kq.int4_quant(w.to(device), 128)
    record(
        q_mismatching_elements=int((q_c != q_d.cpu()).sum()),
        q_numel=q_c.numel(),
        scale_mismatching_groups=int((s_c != s_d.cpu()).sum()),
        scale_numel=s_c.numel(),
    )
    record.ran_on(q_d.device.type)
    assert torch.equal(q_c, q_d.cpu()) and torch.equal(s_c, s_d.cpu())


INT4_OPS = {  # name -> (w, dev) -> (on the CPU, on the device)
    "pack_int4": lambda w, dev: (
        kq.pack_int4(kq.int4_quant(w, 128)[0]),
        kq.pack_int4(kq.int4_quant(w.to(dev), 128)[0]),
    ),
    "unpack_int4": lambda w, dev: (
        kq.unpack_int4(kq.pack_int4(kq.int4_quant(w, 128)[0]), 256),
        kq.unpack_int4(kq.pack_int4(kq.int4_quant(w, 128)[0]).to(dev), 256),
    ),
    "int4_pack_quantize": lambda w, dev: (
        kq.int4_pack_quantize(w, 128)["weight_packed"],
        kq.int4_pack_quantize(w.to(dev), 128)["weight_packed"],
    ),
    "fake_int4_quant": lambda w, dev: (kq.fake_int4_quant(w, 128), kq.fake_int4_quant(w.to(dev), 128)),
}


@pytest.mark.parametrize("op", list(INT4_OPS))
def test_int4_op_is_exact_vs_cpu(op, int4_weight, device, record):
    a, b = INT4_OPS[op](int4_weight, device)
    record.ran_on(b.device.type)
    assert torch.equal(a, b.cpu())


def test_int4_dequant_is_exact_vs_cpu(int4_weight, device, record):
    p = kq.int4_pack_quantize(int4_weight.to(device), 128)
    deq = kq.int4_dequant(p["weight_packed"], p["weight_scale"], p["weight_shape"])
    ref = kq.int4_dequant(*kq.int4_pack_quantize(int4_weight, 128).values())
    record(max_abs_diff=_maxdiff(ref, deq))
    record.ran_on(deq.device.type)
    assert _maxdiff(ref, deq) == 0.0


def test_fake_int4_straight_through_grad_is_ones(int4_weight, device, record):
    wd = int4_weight.float().to(device).requires_grad_(True)
    kq.fake_int4_quant(wd, 128).sum().backward()
    record.ran_on(wd.grad.device.type)
    assert torch.equal(wd.grad.cpu(), torch.ones(wd.shape))


# --------------------------------------------------------------------------------------- logprob


def test_log_probs_and_entropy_match_fp64_reference(device, record):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 700, 1000, generator=g) * 3
    tokens = torch.randint(0, 1000, (4, 700), generator=g)
    ref_lp = kl.log_probs_reference(logits.double(), tokens).float()
    ref_ent = kl.entropy_reference(logits.double()).float()
    lp = kl.selective_log_softmax(logits.to(device), tokens.to(device), chunk_size=512)
    ent = kl.entropy_from_logits(logits.to(device), chunk_size=512)
    lp_bf16 = kl.selective_log_softmax(logits.to(device).bfloat16(), tokens.to(device))
    ref_bf16 = kl.log_probs_reference(logits.bfloat16(), tokens)
    d = {
        "selective_log_softmax_max_abs_diff_vs_fp64": _maxdiff(ref_lp, lp),
        "entropy_max_abs_diff_vs_fp64": _maxdiff(ref_ent, ent),
        "bf16_logits_vs_cpu_reference_max_abs_diff": _maxdiff(ref_bf16, lp_bf16),
    }
    record(**d)
    record.ran_on(lp.device.type)
    assert max(d.values()) < 1e-4, d


# ------------------------------------------------------------------------------------- xor_delta


@pytest.fixture(scope="module")
def delta_bytes(device):
    """4 MiB of fp32 with 5000 values changed: (old bytes, new bytes) on the CPU and the device,
    and the changed element indices."""
    g = torch.Generator().manual_seed(3)
    old = torch.randn(1 << 20, generator=g)
    new = old.clone()
    idx = torch.randperm(old.numel(), generator=g)[:5000].sort().values
    new[idx] += 1.0
    ob_c, nb_c = old.view(torch.uint8), new.view(torch.uint8)
    return {
        "old": old,
        "ob_c": ob_c,
        "nb_c": nb_c,
        "ob_d": ob_c.to(device),
        "nb_d": nb_c.to(device),
        "idx": idx,
    }


def test_xor_bytes_match_reference_and_apply_recovers_new(delta_bytes, record):
    b = delta_bytes
    dx = kx.xor_bytes(b["ob_d"], b["nb_d"])
    ref = kx.xor_bytes_reference(b["ob_c"], b["nb_c"])
    buf = b["ob_d"].clone()
    kx.apply_xor_(buf, dx)
    record(nonzero_bytes=kx.count_nonzero_bytes(dx), nonzero_bytes_cpu=kx.count_nonzero_bytes(ref))
    record.ran_on(dx.device.type)
    assert torch.equal(dx.cpu(), ref)
    assert torch.equal(buf.cpu(), b["nb_c"])


def test_changed_positions_match_reference_and_apply_recovers_new(delta_bytes, record):
    b = delta_bytes
    i_d, v_d = kx.changed_positions(b["ob_d"], b["nb_d"], 4)
    i_c, v_c = kx.changed_positions_reference(b["ob_c"], b["nb_c"], 4)
    buf = b["ob_d"].clone()
    kx.apply_overwrite_(buf, i_d, v_d, 4)
    gaps, kind = kx.encode_indices(i_d)
    record(n_changed=int(i_d.numel()), index_dtype=kind)
    record.ran_on(i_d.device.type)
    assert torch.equal(i_d.cpu(), i_c) and torch.equal(i_d.cpu(), b["idx"])
    assert torch.equal(v_d.cpu(), v_c)
    assert torch.equal(buf.cpu(), b["nb_c"])
    assert torch.equal(kx.decode_indices(gaps).cpu(), i_c)


def test_unaligned_changed_positions_match_reference(delta_bytes, record):
    """Storage offset 1: the byte-wise reference path, on the device."""
    b = delta_bytes
    i_d, v_d = kx.changed_positions(b["ob_d"][1:-3], b["nb_d"][1:-3], 4)
    i_c, v_c = kx.changed_positions_reference(b["ob_c"][1:-3], b["nb_c"][1:-3], 4)
    record.ran_on(i_d.device.type)
    assert torch.equal(i_d.cpu(), i_c) and torch.equal(v_d.cpu(), v_c)


def test_tensor_bytes_on_the_device(delta_bytes, device, record):
    out = kx.tensor_bytes(delta_bytes["old"].to(device))
    record.ran_on(out.device.type)
    assert torch.equal(out.cpu(), delta_bytes["ob_c"])
