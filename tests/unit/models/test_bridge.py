"""Bridge: HF <-> megatron names and layouts, without megatron or torch.distributed."""

import re

import pytest
import torch

from miles_platform.errors import CheckpointError
from miles_platform.models.bridge import get_bridge, supported_architectures
from miles_platform.models.bridge.base import padded_vocab, tp_shard, tp_unshard
from miles_platform.models.qwen3 import build_model, tiny_qwen3_config


def _model(tied=True, heads=4, groups=2):
    cfg = tiny_qwen3_config(
        50,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=8,
        num_hidden_layers=2,
        tie_word_embeddings=tied,
        architectures=["Qwen3ForCausalLM"],
    )
    model = build_model(cfg, seed=3)
    sd = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    return cfg, sd


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("fused_norms", [False, True])
def test_round_trip_is_bit_exact(tied, fused_norms):
    cfg, sd = _model(tied)
    bridge = get_bridge(cfg)
    mc = bridge.hf_to_megatron(sd, cfg, fused_norms=fused_norms, padded_vocab_size=128)
    assert ("output_layer.weight" in mc) is (not tied)
    assert mc["embedding.word_embeddings.weight"].shape[0] == 128
    norm = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    assert (norm in mc) is fused_norms
    assert ("decoder.layers.0.input_layernorm.weight" in mc) is (not fused_norms)
    back = bridge.megatron_to_hf(mc, cfg)
    assert sorted(back) == sorted(sd)
    for k in sd:
        assert back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k]), k


def test_qkv_is_interleaved_per_query_group():
    cfg, sd = _model(heads=4, groups=2)  # 2 q heads per group, head_dim 8
    mc = get_bridge(cfg).hf_to_megatron(sd, cfg)
    qkv = mc["decoder.layers.1.self_attention.linear_qkv.weight"]
    q, k, v = (sd[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    hd, per_group = 8, (2 + 2) * 8
    for g in range(2):
        block = qkv[g * per_group : (g + 1) * per_group]
        assert torch.equal(block[: 2 * hd], q[g * 2 * hd : (g + 1) * 2 * hd])
        assert torch.equal(block[2 * hd : 3 * hd], k[g * hd : (g + 1) * hd])
        assert torch.equal(block[3 * hd :], v[g * hd : (g + 1) * hd])
    fc1 = mc["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:48], sd["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(fc1[48:], sd["model.layers.1.mlp.up_proj.weight"])


def test_transformer_config_follows_hf_config():
    cfg, _ = _model(heads=4, groups=2)
    tc = get_bridge(cfg).transformer_config(cfg)
    assert (tc["num_attention_heads"], tc["num_query_groups"], tc["kv_channels"]) == (4, 2, 8)
    assert tc["qk_layernorm"] and tc["gated_linear_unit"] and tc["normalization"] == "RMSNorm"
    kw = get_bridge(cfg).gpt_model_kwargs(cfg, tensor_model_parallel_size=2)
    assert kw["vocab_size"] == 128 and kw["share_embeddings_and_output_weights"]


def test_tp_shards_reassemble():
    full = torch.arange(8 * 6.0).reshape(8, 6)
    for name in (
        "x.linear_qkv.weight",
        "x.linear_fc1.weight",
        "x.linear_proj.weight",
        "x.final_layernorm.weight",
    ):
        shards = [tp_shard(name, full, r, 2) for r in range(2)]
        assert torch.equal(tp_unshard(name, shards), full), name
    gate_up = [tp_shard("m.linear_fc1.weight", full, r, 2) for r in range(2)]
    assert torch.equal(gate_up[0], torch.cat([full[0:2], full[4:6]]))  # gate and up halves split each
    # GatedDeltaNet's in_proj: each part split (rows 2 + 2 + 4 of q, k, v...), rank-major; its parts' sizes named
    name, parts = "decoder.layers.0.self_attention.in_proj.weight", [2, 2, 4]
    gdn = [tp_shard(name, full, r, 2, parts) for r in range(2)]
    assert torch.equal(gdn[1], full[[1, 3, 6, 7]]) and torch.equal(tp_unshard(name, gdn, parts), full)
    with pytest.raises(ValueError, match="needs its parts' sizes"):
        tp_shard(name, full, 0, 2)
    assert padded_vocab(259, 1) == 384 and padded_vocab(259, 256) == 512


def test_missing_tensor_is_named():
    cfg, sd = _model()
    del sd["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.down_proj.weight"):
        get_bridge(cfg).hf_to_megatron(sd, cfg)


def test_shape_mismatch_is_named():
    cfg, sd = _model()
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 32)
    with pytest.raises(CheckpointError, match=r"k_proj.weight.*\(3, 32\).*\(16, 32\)"):
        get_bridge(cfg).hf_to_megatron(sd, cfg)


def test_missing_megatron_tensor_is_named():
    cfg, sd = _model()
    mc = get_bridge(cfg).hf_to_megatron(sd, cfg)
    del mc["decoder.final_layernorm.weight"]
    with pytest.raises(CheckpointError, match="decoder.final_layernorm.weight"):
        get_bridge(cfg).megatron_to_hf(mc, cfg)


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "GPT2LMHeadModel"])
def test_unsupported_architecture_lists_supported(arch):
    supported = ["DeepseekV32ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "GptOssForCausalLM", "LlamaForCausalLM", "MiniMaxM2ForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"]  # fmt: skip
    assert supported_architectures() == supported
    with pytest.raises(
        CheckpointError, match=re.escape(f"['{arch}'] has no megatron bridge; supported: {supported}")
    ):
        get_bridge({"architectures": [arch]})
