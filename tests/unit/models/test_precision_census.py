"""`miles-platform dtype-census` on a tiny Qwen3 checkpoint: the aligned policy keeps every float
activation in the compute dtype; the naive one leaks the fp32 gather dtype into the residual stream."""

from __future__ import annotations

import json

import pytest
import torch

from miles_platform.cli import main


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=64, tie_word_embeddings=False,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("qwen3")
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def census(capsys, *args: str) -> dict:
    assert main(["dtype-census", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_aligned_policy_keeps_the_activation_path_in_the_compute_dtype(qwen3_dir, capsys):
    out = census(capsys, "--hf-checkpoint", str(qwen3_dir), "--forward-dtype", "bf16", "--master-dtype", "fp32", "--gather-dtype", "fp32")  # fmt: skip
    assert out["offenders"] == []
    assert list(out["activations"]) == ["bf16"] and out["activations"]["bf16"] > 50
    assert out["master_weights"] == {"fp32": 25}  # fp32 confined to the master weights
    assert set(out["other"]) == {"int64"}  # ids (input_ids, position_ids, mask) only


def test_naive_policy_leaks_fp32_into_the_residual_stream(qwen3_dir, capsys):
    out = census(capsys, "--hf-checkpoint", str(qwen3_dir), "--forward-dtype", "bf16", "--unaligned")
    assert out["activations"].get("fp32", 0) > out["activations"].get("bf16", 0) / 2
    for name in ("model.embed_tokens", "model.layers.0", "model.layers.1.input_layernorm", "model.norm"):
        assert name in out["offenders"]


def test_operator_rule_shows_up_as_offender(qwen3_dir, capsys):
    # an fp32 final norm (operator override after the model rules) emits fp32 into lm_head
    out = census(capsys, "--hf-checkpoint", str(qwen3_dir), "--forward-dtype", "bf16", "--fsdp-precision-rules", "module:model.norm=fp32")  # fmt: skip
    assert "model.norm" in out["offenders"] and "lm_head" in out["offenders"]
    assert "model.layers.1" not in out["offenders"]


def test_bad_checkpoint_and_bad_rule_are_one_line_errors(tmp_path, qwen3_dir, capsys):
    assert main(["dtype-census", "--hf-checkpoint", str(tmp_path), "--forward-dtype", "bf16"]) == 2
    assert "no config.json" in capsys.readouterr().err
    args = ["dtype-census", "--hf-checkpoint", str(qwen3_dir), "--forward-dtype", "bf16"]
    assert main([*args, "--fsdp-precision-rules", "module:model.nope=fp32"]) == 2
    assert "matches nothing" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3_moe"])
def test_every_family_keeps_the_activation_path_in_the_compute_dtype(family, tmp_path, capsys):
    """precision.MODEL_RULES for each supported family (docs/precision.md): the aligned bf16 policy
    leaves no float activation outside bf16 -- the MoE's routers, experts and gates included."""
    from miles_platform.models.tiny import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / family, family)
    out = census(capsys, "--hf-checkpoint", ckpt, "--forward-dtype", "bf16", "--master-dtype", "fp32", "--gather-dtype", "fp32")  # fmt: skip
    assert out["offenders"] == [], out["offenders"]
    assert list(out["activations"]) == ["bf16"] and out["activations"]["bf16"] > 50
    assert set(out["master_weights"]) == {"fp32"}
