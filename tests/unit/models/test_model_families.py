"""Qwen2 and Llama beside Qwen3: tiny configs, validation, bridge mapping and its refusals (no
torch.distributed here; megatron logits parity and torch_dist round trips: test_model_families_megatron.py)."""

import json
import re
import shutil

import pytest
import torch

from miles_platform.errors import CheckpointError
from miles_platform.models.bridge import get_bridge
from miles_platform.models.checkpoint import SUPPORTED_ARCHITECTURES, validate_hf_dir
from miles_platform.models.families import (
    ALL_FAMILIES,
    FAMILIES,
    HF_FAMILIES,
    VLM_FAMILIES,
    build_model,
    tiny_config,
)
from miles_platform.models.qwen3 import num_parameters
from miles_platform.models.tiny import save_tiny_checkpoint

FAMILY_NAMES = sorted(FAMILIES)


def _model(family, tied=True, **kw):
    dims = dict(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8
    )
    cfg = tiny_config(family, 50, **{**dims, "tie_word_embeddings": tied, **kw})
    model = build_model(cfg, seed=3)
    sd = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    return cfg, sd


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_tiny_config_is_the_real_architecture_and_tiny(family):
    cfg = tiny_config(family, 256)
    model = build_model(cfg)
    assert type(model).__name__ == FAMILIES[family].architecture == cfg.architectures[0]
    assert 1e5 < num_parameters(model) < 1e6
    biases = [n for n, _ in model.named_parameters() if n.endswith(".bias")]
    assert bool(biases) is (family == "qwen2")  # Qwen2.5: q/k/v only
    assert all(n.split(".")[-2] in ("q_proj", "k_proj", "v_proj") for n in biases)
    assert all(float(p.detach().abs().max()) > 0 for n, p in model.named_parameters() if n.endswith(".bias"))
    qk_norm = any(".q_norm." in n for n, _ in model.named_parameters())
    assert qk_norm is (family == "qwen3")
    rope = cfg.rope_parameters
    assert rope["rope_type"] == ("llama3" if family == "llama" else "default")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_saved_checkpoint_validates(family, tmp_path):
    path = save_tiny_checkpoint(tmp_path / family, family)
    assert validate_hf_dir(path)["architectures"] == [FAMILIES[family].architecture]


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "MistralForCausalLM"])
def test_other_architectures_refused_with_the_supported_list(arch, tiny_hf_checkpoint, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_hf_checkpoint, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": [arch]}))
    assert set(SUPPORTED_ARCHITECTURES) == {"Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM",
                                            "Qwen3MoeForCausalLM", *(f.architecture for f in HF_FAMILIES.values()),
                                            *(f.architecture for f in VLM_FAMILIES.values())}  # fmt: skip
    msg = f"architecture ['{arch}'] is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}"
    with pytest.raises(CheckpointError, match=re.escape(msg)):
        validate_hf_dir(bad)


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("fused_norms", [False, True])
def test_round_trip_is_bit_exact(family, tied, fused_norms):
    cfg, sd = _model(family, tied)
    bridge = get_bridge(cfg)
    mc = bridge.hf_to_megatron(sd, cfg, fused_norms=fused_norms, padded_vocab_size=128)
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in mc) is (family == "qwen2")
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in mc) is (family == "qwen3")
    back = bridge.megatron_to_hf(mc, cfg)
    assert sorted(back) == sorted(sd)
    for k in sd:
        assert back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k]), k


def test_qwen2_qkv_bias_is_grouped_like_the_weight_rows():
    cfg, sd = _model("qwen2")  # 2 q heads per group, head_dim 8
    mc = get_bridge(cfg).hf_to_megatron(sd, cfg)
    bias = mc["decoder.layers.1.self_attention.linear_qkv.bias"]
    q, k, v = (sd[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv")
    hd, per_group = 8, (2 + 2) * 8
    for g in range(2):
        block = bias[g * per_group : (g + 1) * per_group]
        assert torch.equal(block[: 2 * hd], q[g * 2 * hd : (g + 1) * 2 * hd])
        assert torch.equal(block[2 * hd : 3 * hd], k[g * hd : (g + 1) * hd])
        assert torch.equal(block[3 * hd :], v[g * hd : (g + 1) * hd])
    del sd["model.layers.0.self_attn.v_proj.bias"]
    with pytest.raises(CheckpointError, match="model.layers.0.self_attn.v_proj.bias"):
        get_bridge(cfg).hf_to_megatron(sd, cfg)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_megatron_config_follows_the_family(family):
    cfg, _ = _model(family)
    bridge = get_bridge(cfg)
    tc, kw = bridge.transformer_config(cfg), bridge.gpt_model_kwargs(cfg)
    assert tc["add_qkv_bias"] is (family == "qwen2") and not tc["add_bias_linear"]
    assert tc["qk_layernorm"] is (family == "qwen3") is bridge.layer_spec_kwargs(cfg)["qk_layernorm"]
    rope = cfg.rope_parameters
    assert kw["rotary_base"] == rope["rope_theta"]
    if family == "llama":
        assert kw["rope_scaling"] is True and kw["rope_scaling_factor"] == rope["factor"]
    else:
        assert "rope_scaling" not in kw


def test_published_llama3_config_json_is_read():
    """Llama 3.x as published on the Hub: rope_theta + rope_scaling (transformers 4 spelling)."""
    cfg, _ = _model("llama")
    c = cfg.to_dict()
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope.pop("rope_theta")
    c["rope_scaling"] = rope
    kw = get_bridge(c).gpt_model_kwargs(c)
    assert (kw["rotary_base"], kw["rope_scaling_factor"]) == (c["rope_theta"], rope["factor"])


@pytest.mark.parametrize(
    "family,change,match",
    [
        ("llama", {"attention_bias": True}, "attention_bias / mlp_bias"),
        ("llama", {"mlp_bias": True}, "attention_bias / mlp_bias"),
        ("qwen3", {"attention_bias": True}, "attention_bias / mlp_bias"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
        ("llama", {"rope": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ("llama", {"rope": {"original_max_position_embeddings": 4096}}, "original_max_position_embeddings"),
        ("qwen2", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_what_megatron_cannot_represent_is_refused_by_name(family, change, match):
    cfg, _ = _model(family)
    c = cfg.to_dict()
    c["rope_parameters"] = {**c["rope_parameters"], **change.pop("rope", {})}
    c.update(change)
    with pytest.raises(CheckpointError, match=match):
        get_bridge(c).transformer_config(c)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("family_dirs")
    return {f: save_tiny_checkpoint(root / f, f) for f in FAMILY_NAMES}


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3_moe"])
def test_sft_from_a_family_checkpoint_lowers_the_loss_and_saves_it(family, family_dirs, tmp_path):
    from miles_platform.data.tasks import write_task_datasets
    from miles_platform.models.checkpoint import load_hf_checkpoint
    from miles_platform.training.sft import SFTRecipe, run_sft

    data = write_task_datasets(tmp_path / "tasks", seed=0)["sft"]
    recipe = SFTRecipe(
        lr=3e-3, lr_warmup_iters=2, global_batch_size=16, micro_batch_size=16, train_iters=20, log_interval=1
    )
    ckpt = family_dirs.get(family) or save_tiny_checkpoint(tmp_path / family, family)  # MoE: not in FAMILIES
    m = run_sft(data, tmp_path / "sft", hf_checkpoint=ckpt, recipe=recipe, progress=False)
    assert m["final_loss"] < 0.8 * m["loss_curve"][0][1], m["loss_curve"]
    model, tok = load_hf_checkpoint(m["save"])  # an MoE's saved per expert (HF's layout), loaded fused
    assert type(model).__name__ == ALL_FAMILIES[family].architecture
    ids = torch.tensor([tok.encode("12+34=")])
    assert torch.equal(model(ids).logits, m["model"].eval()(ids).logits)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_quantized_family_checkpoint_is_served_close_to_the_original(family, fmt, family_dirs, tmp_path):
    """The engine's own loader (`load_model`: dequantize into the family's HF model) on the output of
    `miles-platform quantize`; biases and norms are kept exact, projections quantized."""
    from miles_platform.models.checkpoint import load_hf_model
    from miles_platform.rollout.engine_weights import load_model
    from miles_platform.weights.quantize import quantize_checkpoint

    src = family_dirs[family]
    st = quantize_checkpoint(src, str(tmp_path / fmt), fmt)
    assert st.tensors_quantized == 2 * 7  # q, k, v, o, gate, up, down per layer
    served, _ = load_model(str(tmp_path / fmt), torch.float32)
    ref = load_hf_model(src)
    assert type(served) is type(ref)
    ref_sd, got_sd = ref.state_dict(), served.state_dict()
    for k in ref_sd:
        if k.endswith(".bias") or "norm" in k:
            assert torch.equal(got_sd[k], ref_sd[k]), k
    assert not torch.equal(
        got_sd["model.layers.0.mlp.up_proj.weight"], ref_sd["model.layers.0.mlp.up_proj.weight"]
    )
    ids = torch.randint(0, ref.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lq, lr = (torch.log_softmax(m(ids).logits, -1) for m in (served, ref))
    tok_q, tok_r = lq[:, :-1].gather(-1, ids[:, 1:, None]), lr[:, :-1].gather(-1, ids[:, 1:, None])
    assert (
        float((tok_q - tok_r).abs().max()) < {"fp8": 0.02, "int4": 0.1}[fmt]
    )  # tests/unit/models/test_quant.py's bounds


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_precision_rules_keep_the_family_in_the_compute_dtype(family, family_dirs):
    """docs/precision.md: MODEL_RULES cover every family; the naive policy leaks fp32 (so the rules matter)."""
    from miles_platform.training.precision import MODEL_RULES, PrecisionPolicy
    from miles_platform.training.precision_census import census_checkpoint

    assert family in MODEL_RULES
    policy = PrecisionPolicy(master="fp32", gather="fp32", compute="bf16")
    aligned = census_checkpoint(family_dirs[family], policy)
    assert aligned.offenders == [] and set(aligned.activations) == {"bf16"}
    naive = census_checkpoint(family_dirs[family], policy, aligned=False)
    assert {"model.embed_tokens", "model.norm"} <= set(naive.offenders)
