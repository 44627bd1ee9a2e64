"""FP8 block / INT4 group quantization: error bounds, packing layout, STE, quantized checkpoints served."""

import json

import pytest
import torch

from kernels import quant as kq
from miles_platform.weights.quantize import (
    MAX_REL_ERROR,
    block_rel_error,
    load_dequantized_state_dict,
    quantize_checkpoint,
)


@pytest.fixture
def w():
    return torch.randn(300, 260, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 260)


def test_fp8_block_round_trip_error_bound(w):
    q, s = kq.fp8_block_quant(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (3, 3)  # ceil(300/128), ceil(260/128)
    torch.testing.assert_close(s[0, 0], w[:128, :128].abs().max() / 448)
    deq = kq.fp8_block_dequant(q, s)
    err = block_rel_error(w, deq, "fp8")
    assert 0 < err <= MAX_REL_ERROR["fp8"]
    # a block whose amax is tiny keeps its own precision (per-block scales)
    assert (deq[:128, :128] - w[:128, :128]).abs().max() <= w[:128, :128].abs().max() / 16


def test_int4_pack_layout_and_error_bound(w):
    w = w[:, :256]
    t = kq.int4_pack_quantize(w.to(torch.bfloat16), group_size=128)
    assert t["weight_packed"].dtype == torch.int32 and t["weight_packed"].shape == (300, 32)
    assert t["weight_scale"].dtype == torch.bfloat16 and t["weight_scale"].shape == (300, 2)
    assert t["weight_shape"].tolist() == [300, 256]
    q, _ = kq.int4_quant(w.to(torch.bfloat16), 128)
    assert int(q.abs().max()) <= 7
    # nibble order: element j of a pack sits at bits 4j, stored as value + 8
    p0 = int(t["weight_packed"][0, 0]) & 0xFFFFFFFF
    assert [((p0 >> (4 * j)) & 0xF) - 8 for j in range(8)] == q[0, :8].tolist()
    assert torch.equal(kq.unpack_int4(t["weight_packed"], 256), q)
    deq = kq.int4_dequant(t["weight_packed"], t["weight_scale"], t["weight_shape"])
    assert block_rel_error(w, deq, "int4", 128) <= MAX_REL_ERROR["int4"] + 1e-2  # bf16 scales
    assert (
        block_rel_error(w, kq.int4_dequant(*kq.int4_pack_quantize(w, 128).values()), "int4")
        <= MAX_REL_ERROR["int4"]
    )
    assert kq.int4_group_size(64, 128) == 64  # clamped to in_features
    with pytest.raises(ValueError, match="not divisible"):
        kq.int4_quant(torch.randn(4, 100), 64)


def test_fake_int4_ste_forward_matches_pack_and_gradient_passes_through(w):
    w = w[:, :256].clone().requires_grad_(True)
    fake = kq.fake_int4_quant(w, 128)
    packed = kq.int4_pack_quantize(w.detach(), 128)
    torch.testing.assert_close(fake.detach(), kq.int4_dequant(*packed.values()))
    g = torch.randn_like(w)
    (fake * g).sum().backward()
    assert torch.equal(w.grad, g)
    # QAT weights are already on the grid: packing them again loses nothing
    again = kq.int4_dequant(*kq.int4_pack_quantize(fake.detach(), 128).values())
    torch.testing.assert_close(again, fake.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantized_checkpoint_served_close_to_original(tiny_hf_checkpoint, tmp_path, fmt):
    from miles_platform.models.checkpoint import load_hf_model

    out = tmp_path / fmt
    st = quantize_checkpoint(tiny_hf_checkpoint, str(out), fmt)
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    if fmt == "fp8":
        assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    else:
        assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "pack-quantized")
        assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 32  # clamped to hidden 32
        assert "lm_head" in qc["ignore"]
    assert st.tensors_quantized == 14 and st.max_rel_error <= MAX_REL_ERROR[fmt]
    assert st.bytes_out < st.bytes_in
    assert (out / "tokenizer.json").exists() or (out / "tokenizer_config.json").exists()

    model = load_hf_model(tiny_hf_checkpoint)
    ref_sd = {k: v.clone() for k, v in model.state_dict().items()}
    deq = load_dequantized_state_dict(str(out))
    assert all(deq[k].dtype == torch.float32 for k in deq)
    missing, unexpected = model.load_state_dict(deq, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    torch.manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (2, 16))
    quant_model = model
    with torch.no_grad():
        lq = torch.log_softmax(quant_model(ids).logits.float(), -1)
        model.load_state_dict(ref_sd)
        lr = torch.log_softmax(model(ids).logits.float(), -1)
    tok_q, tok_r = lq[:, :-1].gather(-1, ids[:, 1:, None]), lr[:, :-1].gather(-1, ids[:, 1:, None])
    gap = float((tok_q - tok_r).abs().max())
    print(f"{fmt}: max |log-prob gap| = {gap:.5f}")
    assert gap < {"fp8": 0.02, "int4": 0.1}[fmt]


def test_quantize_cli_and_already_quantized_refused(tiny_hf_checkpoint, tmp_path, capsys):
    from miles_platform.cli import main

    out = tmp_path / "int4"
    args = ["quantize", "--format", "int4", "--hf-checkpoint", tiny_hf_checkpoint, "--save", str(out)]
    assert main(args + ["--group-size", "16"]) == 0
    assert "14 tensors quantized" in capsys.readouterr().out
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 16
    again = ["quantize", "--format", "fp8", "--hf-checkpoint", str(out), "--save", str(tmp_path / "x")]
    assert main(again) == 2
    assert "already quantized" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
