"""GLM-4.5 on megatron-core (models/bridge/glm4_moe.py): GQA attention with q/k/v biases, optional q/k
norm and a partial rotary (megatron `rotary_percent`), and DeepSeek's MoE (first layers dense, sigmoid
routing with the score-correction bias, group-limited top-k, shared experts, routed_scaling_factor).
HF <-> megatron names bit-exact both ways; megatron's GPTModel logits, loss and gradients equal
transformers' Glm4MoeForCausalLM in fp32, for GLM-4.5's layout (q/k norm, scaling 2.5) and GLM-4.5-Air's
(no q/k norm) with a group limit; controls show each mapping is what makes it pass (the rotary
fraction, the q/k/v biases, the q/k norm, the expert bias, the scaling factor, the group limit);
torch_dist conversion both ways (at TP 2, EP 2) is bit-exact; preflight takes TP / SP / EP (their steps:
tests/unit/training/test_megatron_layouts.py); what megatron cannot reproduce and LoRA are refused by name. The --ci-test GRPO step on megatron: test_deepseek_v3_bridge.py (parametrized by family).

Everything touching torch.distributed runs in a subprocess (this file as a script).
"""

import sys
from pathlib import Path

import pytest
import torch
from test_deepseek_v3_bridge import (
    TOL,
    _state,
    megatron_config_of,
    megatron_runs,
    megatron_vs_hf,
    parity_then_convert,
    round_trip,
    sharp_model,
    zero_expert_bias,
)

from miles_platform.errors import CheckpointError
from miles_platform.models.bridge import get_bridge
from miles_platform.models.families import tiny_config

REPO = Path(__file__).resolve().parents[3]
# the parity shapes: GLM-4.5 (q/k norm, routed_scaling_factor 2.5) and GLM-4.5-Air's attention (no q/k
# norm) with 2 groups of 2 experts, 1 group per token (the group limit runs); both with q/k/v biases
VARIANTS = {
    "glm4_5": {"routed_scaling_factor": 2.5},
    "air_groups": {"use_qk_norm": False, "n_group": 2, "topk_group": 1},
}
_LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
_YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 64}
_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 1e4}


def glm_config(vocab: int = 128, **overrides):
    """The tiny GLM-4.5 (families.py: layer 0 dense, layer 1 MoE: 4 experts, top-2, 1 shared expert,
    half the head rotated), untied, with q/k/v biases as GLM-4.5 publishes."""
    return tiny_config("glm4_moe", vocab, tie_word_embeddings=False, attention_bias=True, **overrides)


@pytest.fixture(scope="module")
def models():
    return {v: (cfg := glm_config(**VARIANTS[v]), sharp_model(cfg)) for v in VARIANTS}


# ---------------------------------------------------------------- names, without megatron


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_round_trip_is_bit_exact_and_mtp_layers_are_dropped(models, variant):
    cfg, model = models[variant]
    sd, bridge = _state(cfg, model), get_bridge(cfg)
    for fused_norms in (False, True):
        mc, _, disk = round_trip(cfg, sd, fused_norms)
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in disk  # one tensor per expert on disk
    # the TE spec fuses the dense layer's MLP norm into linear_fc1, keeps the MoE layer's for its router
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in mc
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in mc
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in mc) is bool(cfg.use_qk_norm)
    mtp = {"model.layers.2.eh_proj.weight": torch.zeros(4, 4), "model.layers.2.enorm.weight": torch.ones(4)}
    assert sorted(bridge.hf_to_megatron({**sd, **mtp}, cfg)) == sorted(bridge.hf_to_megatron(sd, cfg))
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        bridge.hf_to_megatron({**sd, "model.layers.1.self_attn.extra.weight": torch.zeros(1)}, cfg)


def test_megatron_config_follows_the_attention_rotary_and_routing_fields(models):
    cfg, model = models["glm4_5"]
    bridge = get_bridge(cfg)
    tc, kw = bridge.transformer_config(cfg), bridge.gpt_model_kwargs(cfg)
    assert (tc["add_qkv_bias"], tc["qk_layernorm"]) == (True, True)
    assert (tc["num_query_groups"], tc["kv_channels"]) == (2, 32)
    assert kw["rotary_percent"] == 0.5 and not tc.get("multi_latent_attention")
    assert tc["moe_layer_freq"] == [0, 1] and tc["moe_shared_expert_intermediate_size"] == 48
    assert (tc["moe_router_score_function"], tc["moe_router_enable_expert_bias"]) == ("sigmoid", True)
    assert (tc["moe_router_num_groups"], tc["moe_router_topk_scaling_factor"]) == (None, 2.5)
    air = glm_config(**VARIANTS["air_groups"])
    assert not bridge.transformer_config(air)["qk_layernorm"]
    assert bridge.transformer_config(air)["moe_router_num_groups"] == 2
    # config.json as published: the fraction at the top level, or left out (Glm4MoeConfig's default 0.5)
    c = {k: v for k, v in cfg.to_dict().items() if k != "rope_parameters"}
    assert bridge.gpt_model_kwargs({**c, "rope_theta": 1e6})["rotary_percent"] == 0.5
    assert bridge.gpt_model_kwargs({**c, "partial_rotary_factor": 0.25})["rotary_percent"] == 0.25
    q = _state(cfg, model)["model.layers.0.self_attn.q_proj.bias"].reshape(2, 2 * 32)  # per query group
    qkv = bridge.hf_to_megatron(_state(cfg, model), cfg)["decoder.layers.0.self_attention.linear_qkv.bias"]
    assert torch.equal(qkv.reshape(2, 4 * 32)[:, : 2 * 32], q)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"norm_topk_prob": False}, "norm_topk_prob False"),
        ({"n_shared_experts": 0}, "n_shared_experts 0"),
        ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2}, "topk must be 2 x topk_group"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": _YARN}, "rope_type 'yarn'"),
        ({"rope_parameters": {**_LLAMA3, "partial_rotary_factor": 0.5}}, "rope_type 'llama3'"),
        ({"rope_parameters": {**_DEFAULT_ROPE, "partial_rotary_factor": 0.3}}, "partial_rotary_factor 0.3"),
    ],
)
def test_what_megatron_cannot_reproduce_is_refused_by_name(change, match):
    megatron_config_of(glm_config(), change, "GLM-4.5", match)


def test_preflight_takes_it_on_megatron_at_tp_and_ep_and_lora(tiny_hf_checkpoint, tmp_path):
    """TP / SP / EP as Qwen3-MoE's (the steps: test_megatron_layouts.py); LoRA on its attention, dense MLP,
    shared and routed experts (the DeepSeek MoE adapters: test_lora_megatron.py)."""
    from miles_platform.config import ConfigError
    from miles_platform.preflight import validate_before_start

    run = megatron_runs(glm_config, tiny_hf_checkpoint, tmp_path)
    validate_before_start(run(use_rollout_routing_replay=True))
    two = dict(actor_num_gpus_per_node=2, global_batch_size=4)
    validate_before_start(run(**two, tensor_model_parallel_size=2, sequence_parallel=True))
    validate_before_start(run(**two, expert_model_parallel_size=2))
    with pytest.raises(
        ConfigError, match="MoE model at --tensor-model-parallel-size 2 needs --sequence-parallel"
    ):
        validate_before_start(run(**two, tensor_model_parallel_size=2))
    validate_before_start(run(lora_rank=4))


# ---------------------------------------------------------------- megatron (subprocess)


@pytest.fixture(scope="module")
def megatron_report(tiny_hf_checkpoint, tmp_path_factory):
    """One subprocess: the parity of each variant, then hf -> torch_dist -> hf of a saved checkpoint."""
    from test_deepseek_v3_bridge import bridge_report

    return bridge_report(
        lambda v: sharp_model(glm_config(v, **VARIANTS["glm4_5"])),
        tiny_hf_checkpoint,
        tmp_path_factory,
        "glm4_moe",
        __file__,
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_megatron_logits_loss_grads_match_hf_in_fp32(megatron_report, variant):
    p = megatron_report["parity"][variant]
    assert p["logits_max_abs_diff"] < TOL and p["loss_abs_diff"] < TOL and p["grad_max_abs_diff"] < TOL, p
    assert p["grads_compared"] == p["hf_params"]  # every HF parameter: biases, q/k norms, routers, experts
    assert p["export_identical"]  # megatron's state, gathered and mapped back: HF's, bias buffer included
    assert p["experts_routed"] == 4 and p["logits_scale"] > 0.5  # every expert used; logits not near zero


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_without_each_glm_mapping_parity_fails(megatron_report, variant):
    """The same weights with one mapping dropped: the whole head rotated, the q/k/v biases, the q/k
    norms or the expert bias zeroed / unit, no routed_scaling_factor, no group limit. Each is far outside
    the bound."""
    c = megatron_report["parity"][variant]["controls"]
    want = {"rotary_percent", "qkv_bias", "expert_bias"}
    want |= {"qk_norm", "routed_scaling"} if variant == "glm4_5" else {"group_limit"}
    assert set(c) == want and all(v > 1000 * TOL for v in c.values()), c


def test_hf_to_torch_dist_to_hf_is_bit_exact(megatron_report):
    """`miles-platform convert` both ways through megatron's torch_dist, written at TP 2 and EP 2: HF's
    on-disk tensors (one per expert, the q/k/v biases, the router's bias) come back bit for bit."""
    from safetensors.torch import load_file

    hf, work = megatron_report["hf"], megatron_report["work"]
    assert len(list((work / "td" / "release").glob("*.distcp"))) == 4  # TP 2 x EP 2: one file per rank
    a, b = load_file(f"{hf}/model.safetensors"), load_file(str(work / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b) and {"model.layers.1.mlp.gate.e_score_correction_bias",
                                        "model.layers.0.self_attn.k_proj.bias"} <= set(a)  # fmt: skip
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def _parity_report(variant: str) -> dict:
    cfg_obj = glm_config(**VARIANTS[variant])
    out, cfg, _, control = megatron_vs_hf(cfg_obj, sharp_model(cfg_obj))

    def edit(suffixes: tuple[str, ...], value: float):
        return lambda full: {
            k: torch.full_like(t, value) if k.endswith(suffixes) else t for k, t in full.items()
        }

    rope = cfg["rope_parameters"]
    controls = {
        "rotary_percent": lambda: control({**cfg, "rope_parameters": {**rope, "partial_rotary_factor": 1.0}}),
        "qkv_bias": lambda: control(cfg, edit=edit(("linear_qkv.bias",), 0.0)),
        "expert_bias": lambda: control(cfg, edit=zero_expert_bias),
    }
    if cfg["use_qk_norm"]:
        controls["qk_norm"] = lambda: control(
            cfg, edit=edit(("q_layernorm.weight", "k_layernorm.weight"), 1.0)
        )
    if cfg["routed_scaling_factor"] != 1.0:
        controls["routed_scaling"] = lambda: control({**cfg, "routed_scaling_factor": 1.0})
    if cfg["n_group"] > 1:
        controls["group_limit"] = lambda: control({**cfg, "n_group": 1, "topk_group": 1})
    out["controls"] = {name: run() for name, run in controls.items()}
    return out


def _main(mode: str, hf: str, work: str) -> None:
    # the conversion at TP 2 and EP 2: torch_dist reshards on load
    layout = "--tensor-model-parallel-size 2 --expert-model-parallel-size 2"
    parity_then_convert(_parity_report, VARIANTS, hf, work, *layout.split())


if __name__ == "__main__":
    _main(*sys.argv[1:])
