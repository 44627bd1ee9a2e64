"""MiniMax-M2 on megatron-core (models/bridge/minimax_m2.py): GQA attention whose q/k RMSNorms span the whole
projection (all heads jointly: WholeQNorm / WholeKNorm in the layer spec), a partial rotary (megatron
`rotary_percent`), and a sigmoid-routed MoE with the score-correction bias, renormalized top-k gates and no
shared expert. HF <-> megatron names bit-exact both ways (module and on-disk layouts); megatron's GPTModel
logits, loss and every gradient equal transformers' MiniMaxM2ForCausalLM in fp32; controls show each
non-obvious mapping is what makes it pass (a per-head q/k norm, the expert bias zeroed, the whole head
rotated); torch_dist conversion both ways, written at TP 2, is bit-exact; preflight takes TP + SP and EP 2 and
refuses LoRA by name (test_megatron_layouts: the TP2 + SP step equals the 1-rank step); one --ci-test GRPO
step on megatron (extended).

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
VARIANTS = {"minimax_m2": {}}


def minimax_config(vocab: int = 128, **overrides):
    """The tiny MiniMax-M2 (families.py: 2 layers, 4 heads in 2 query groups of head_dim 32, half of each
    head rotated, 4 experts, top-2), untied as MiniMax publishes it."""
    return tiny_config("minimax_m2", vocab, tie_word_embeddings=False, **overrides)


@pytest.fixture(scope="module")
def model():
    cfg = minimax_config()
    return cfg, sharp_model(cfg)


# ---------------------------------------------------------------- names, without megatron


def test_round_trip_is_bit_exact_in_both_layouts(model):
    cfg, hf = model
    sd = _state(cfg, hf)
    for fused_norms in (False, True):
        mc, _, disk = round_trip(cfg, sd, fused_norms)
        # on disk: block_sparse_moe, one tensor per expert (w1 / w3 / w2), the bias beside the gate
        assert {"model.layers.1.block_sparse_moe.experts.3.w3.weight",
                "model.layers.1.block_sparse_moe.e_score_correction_bias"} <= set(disk)  # fmt: skip
    # the whole projection's norm weights: heads x head_dim for q, query groups x head_dim for k
    assert mc["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (4 * 32,)
    assert mc["decoder.layers.0.self_attention.k_layernorm.weight"].shape == (2 * 32,)
    assert torch.equal(
        mc["decoder.layers.1.mlp.router.expert_bias"], sd["model.layers.1.mlp.e_score_correction_bias"]
    )
    assert not any("shared_experts" in k for k in mc)
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        get_bridge(cfg).hf_to_megatron({**sd, "model.layers.1.self_attn.extra.weight": torch.zeros(1)}, cfg)


def test_megatron_config_follows_the_rotary_and_routing_fields(model):
    cfg, _ = model
    bridge = get_bridge(cfg)
    tc, kw = bridge.transformer_config(cfg), bridge.gpt_model_kwargs(cfg)
    assert (tc["num_query_groups"], tc["kv_channels"], tc["qk_layernorm"]) == (2, 32, True)
    assert kw["rotary_percent"] == 0.5
    assert (tc["moe_router_score_function"], tc["moe_router_enable_expert_bias"]) == ("sigmoid", True)
    assert (tc["moe_router_bias_update_rate"], tc["moe_ffn_hidden_size"], tc["num_moe_experts"]) == (
        0.0,
        384,
        4,
    )
    assert tc.get("moe_shared_expert_intermediate_size") is None
    # config.json as MiniMax publishes it: `rotary_dim` (64 of 128 per head) and a top-level rope_theta
    c = {k: v for k, v in cfg.to_dict().items() if k != "rope_parameters"}
    assert bridge.gpt_model_kwargs({**c, "rope_theta": 5e6, "rotary_dim": 8})["rotary_percent"] == 0.25
    assert bridge.gpt_model_kwargs(cfg, tensor_model_parallel_size=2)["rotary_percent"] == 0.5


@pytest.mark.parametrize(
    "change,match",
    [
        ({"num_experts_per_tok": 1}, "num_experts_per_tok 1"),
        ({"router_jitter_noise": 0.1}, "router_jitter_noise 0.1"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_type 'linear'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}},
         "partial_rotary_factor 0.3"),
    ],
)  # fmt: skip
def test_what_megatron_cannot_reproduce_is_refused_by_name(change, match):
    megatron_config_of(minimax_config(), change, "MiniMax-M2", match)


def test_preflight_takes_tp_and_ep_and_lora(tiny_hf_checkpoint, tmp_path):
    from miles_platform.config import ConfigError
    from miles_platform.preflight import validate_before_start

    run = megatron_runs(minimax_config, tiny_hf_checkpoint, tmp_path)
    validate_before_start(run(use_rollout_routing_replay=True))
    two = dict(actor_num_gpus_per_node=2, global_batch_size=4)
    validate_before_start(run(**two, expert_model_parallel_size=2))
    # test_megatron_layouts: the TP2 + SP step equals the 1-rank step
    validate_before_start(run(**two, tensor_model_parallel_size=2, sequence_parallel=True))
    validate_before_start(run(lora_rank=4))  # attention and expert adapters (test_lora_megatron.py)
    with pytest.raises(ConfigError, match="expert adapters on megatron are built at tensor parallel 1"):
        validate_before_start(run(**two, tensor_model_parallel_size=2, sequence_parallel=True, lora_rank=4))


# ---------------------------------------------------------------- megatron (subprocess)


@pytest.fixture(scope="module")
def megatron_report(tiny_hf_checkpoint, tmp_path_factory):
    """One subprocess: the parity with its controls, then hf -> torch_dist -> hf of a saved checkpoint."""
    from test_deepseek_v3_bridge import bridge_report

    return bridge_report(
        lambda v: sharp_model(minimax_config(v)), tiny_hf_checkpoint, tmp_path_factory, "minimax_m2", __file__
    )


def test_megatron_logits_loss_grads_match_hf_in_fp32(megatron_report):
    p = megatron_report["parity"]["minimax_m2"]
    assert p["logits_max_abs_diff"] < TOL and p["loss_abs_diff"] < TOL and p["grad_max_abs_diff"] < TOL, p
    assert p["grads_compared"] == p["hf_params"]  # every HF parameter: whole q/k norms, routers, experts
    assert p["export_identical"]  # megatron's state, gathered and mapped back: HF's, bias buffer included
    assert p["experts_routed"] == 4 and p["logits_scale"] > 0.5  # every expert used; logits not near zero


def test_without_each_minimax_mapping_parity_fails(megatron_report):
    """The same weights with one mapping dropped: q/k normalized per head (megatron's own qk_layernorm, the
    weight's per-head mean), the expert bias zeroed, the whole head rotated. Each is far outside the bound."""
    c = megatron_report["parity"]["minimax_m2"]["controls"]
    assert set(c) == {"per_head_qk_norm", "expert_bias", "full_rotary"} and all(
        v > 1000 * TOL for v in c.values()
    ), c


def test_hf_to_torch_dist_to_hf_is_bit_exact(megatron_report):
    """`miles-platform convert` both ways through megatron's torch_dist, written at TP 2 (each rank its heads'
    slice of the whole-projection norms, its half of every expert's hidden units): HF's on-disk tensors (one
    per expert, the whole-projection norms, the score-correction bias) come back bit for bit."""
    from safetensors.torch import load_file

    hf, work = megatron_report["hf"], megatron_report["work"]
    a, b = load_file(f"{hf}/model.safetensors"), load_file(str(work / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b) and {"model.layers.1.block_sparse_moe.e_score_correction_bias",
                                        "model.layers.0.self_attn.q_norm.weight"} <= set(a)  # fmt: skip
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


@pytest.mark.extended
def test_one_ci_test_grpo_step_on_megatron_gives_the_engines_log_probs(tiny_hf_checkpoint, tmp_path):
    """The embedded engine (transformers' model) rolls out with R3; the megatron trainer's log-probs equal
    the engine's, one --ci-test GRPO step passes with the routes replayed, moves the whole-projection q norm
    and the router, and keeps the score-correction bias the checkpoint's."""
    from test_deepseek_v3_bridge import megatron_grpo_step

    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint

    tok = load_tokenizer(tiny_hf_checkpoint)
    ckpt = str(tmp_path / "minimax")
    save_hf_checkpoint(sharp_model(minimax_config(len(tok))), tok, ckpt)
    start, after = megatron_grpo_step(ckpt, tmp_path, moe_layers=2)  # every layer routed
    bias = "model.layers.1.mlp.e_score_correction_bias"
    assert torch.equal(after[bias], start[bias]) and start[bias].abs().max() > 0.1
    for moved in ("model.layers.1.mlp.gate.weight", "model.layers.0.self_attn.q_norm.weight"):
        assert not torch.equal(after[moved], start[moved]), moved


def _per_head(hd: int):
    """megatron's own per-head q/k norm (the spec's, not WholeQNorm / WholeKNorm) with each head's slice of
    HF's whole-projection weight averaged to one head_dim weight."""

    def edit(full: dict) -> dict:
        return {
            k: t.reshape(-1, hd).mean(0) if k.endswith(("q_layernorm.weight", "k_layernorm.weight")) else t
            for k, t in full.items()
        }

    return edit


def _parity_report(variant: str) -> dict:
    from miles_platform.models.bridge import minimax_m2

    cfg_obj = minimax_config(**VARIANTS[variant])
    out, cfg, _, control = megatron_vs_hf(cfg_obj, sharp_model(cfg_obj))

    def per_head_qk_norm():
        keep = minimax_m2.MiniMaxM2Bridge.adapt_layer_spec
        minimax_m2.MiniMaxM2Bridge.adapt_layer_spec = lambda self, spec, use_te: spec
        try:
            return control(cfg, edit=_per_head(cfg["head_dim"]))
        finally:
            minimax_m2.MiniMaxM2Bridge.adapt_layer_spec = keep

    rope = cfg["rope_parameters"]
    controls = {
        "per_head_qk_norm": per_head_qk_norm,
        "expert_bias": lambda: control(cfg, edit=zero_expert_bias),
        "full_rotary": lambda: control({**cfg, "rope_parameters": {**rope, "partial_rotary_factor": 1.0}}),
    }
    out["controls"] = {name: run() for name, run in controls.items()}
    return out


def _main(mode: str, hf: str, work: str) -> None:
    parity_then_convert(_parity_report, VARIANTS, hf, work, "--tensor-model-parallel-size", "2")


if __name__ == "__main__":
    _main(*sys.argv[1:])
