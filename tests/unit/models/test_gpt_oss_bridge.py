"""GPT-OSS on megatron-core (models/bridge/gpt_oss.py): GQA attention with biases and attention sinks,
sliding-window layers between full ones, and every layer a top-k MoE block of biased experts (fused,
interleaved gate / up columns) with a clamped SwiGLU. HF <-> megatron names bit-exact both ways;
megatron's GPTModel logits, loss and gradients equal transformers' GptOssForCausalLM in fp32, with
default rope and with GPT-OSS's yarn (truncate false) and an active clamp; controls show each mapping
is what makes it pass (the sinks, the window and its width, the router and expert biases, the gate / up
interleave, the +1 on up, the sigmoid gain, the clamp, yarn and its truncation); torch_dist conversion
both ways (at TP 2, EP 2) is bit-exact; preflight takes TP / SP / EP at expert TP 1 (their steps:
tests/unit/training/test_megatron_layouts.py) and refuses expert TP > 1 and LoRA by name; one --ci-test
GRPO step with R3 on --train-backend megatron gives the embedded engine's log-probs.

Everything touching torch.distributed runs in a subprocess (this file as a script, or run_ranks).
"""

import sys

import pytest
import torch
from test_deepseek_v3_bridge import (
    TOL,
    _state,
    megatron_config_of,
    megatron_grpo_step,
    megatron_runs,
    megatron_vs_hf,
    parity_then_convert,
    round_trip,
    sharp_model,
)

from miles_platform.errors import CheckpointError
from miles_platform.models.bridge import get_bridge
from miles_platform.models.families import tiny_config

# GPT-OSS's yarn as published (factor 32, original 4096, truncate false), scaled to the tiny context
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}  # fmt: skip
# the parity shapes: the tiny GPT-OSS (8-token window on layer 0, default rope, clamp at 7: inactive),
# and GPT-OSS's yarn with a clamp the experts' pre-activations reach (limit 1)
VARIANTS = {"gpt_oss": {}, "yarn_clamped": {"rope_parameters": YARN, "swiglu_limit": 1.0}}


def gpt_oss_config(vocab: int = 128, **overrides):
    """The tiny GPT-OSS (families.py: layer 0 sliding, layer 1 full; 4 experts, top-2), untied."""
    return tiny_config("gpt_oss", vocab, tie_word_embeddings=False, **overrides)


def sharp_gpt_oss(cfg, seed: int = 5):
    """sharp_model's weights, and GPT-OSS's own drawn so each mapping shows: the sinks at std 1 (HF: 0.02),
    the routers at std 0.5 with biases at 0.3, the experts' biases at 0.3 (HF initializes them to zero)."""
    model = sharp_model(cfg, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                p.normal_(0.0, 1.0, generator=g)
            if name.endswith("mlp.router.weight"):
                p.normal_(0.0, 0.5, generator=g)
            if name.endswith(("mlp.router.bias", "_proj_bias")):
                p.normal_(0.0, 0.3, generator=g)
    return model


@pytest.fixture(scope="module")
def models():
    return {v: (cfg := gpt_oss_config(**VARIANTS[v]), sharp_gpt_oss(cfg)) for v in VARIANTS}


# ---------------------------------------------------------------- names, without megatron


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("fused_norms", [False, True])
def test_round_trip_is_bit_exact_and_the_experts_stay_fused_on_disk(models, variant, fused_norms):
    cfg, model = models[variant]
    sd = _state(cfg, model)
    mc, back, disk = round_trip(cfg, sd, fused_norms)
    assert sorted(disk) == sorted(sd) and "model.layers.1.mlp.experts.gate_up_proj_bias" in disk  # HF's
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in mc  # the router reads it under the TE spec too
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        get_bridge(cfg).hf_to_megatron({**sd, "model.layers.1.self_attn.extra.weight": torch.zeros(1)}, cfg)


def test_expert_rows_are_hfs_interleaved_columns_and_the_sinks_the_offsets(models):
    cfg, model = models["gpt_oss"]
    sd = _state(cfg, model)
    mc = get_bridge(cfg).hf_to_megatron(sd, cfg)
    e, x = "decoder.layers.1.mlp.experts.local_experts.3.", "model.layers.1.mlp.experts."
    fc1, gate_up = mc[e + "linear_fc1.weight"], sd[x + "gate_up_proj"][3]  # [2I, H], [H, 2I]
    assert torch.equal(fc1[:384], gate_up[:, 0::2].t()) and torch.equal(fc1[384:], gate_up[:, 1::2].t())
    b = sd[x + "gate_up_proj_bias"][3]
    assert torch.equal(mc[e + "linear_fc1.bias"], torch.cat([b[0::2], b[1::2]])) and b.abs().max() > 0.1
    assert torch.equal(mc[e + "linear_fc2.weight"], sd[x + "down_proj"][3].t())
    assert torch.equal(mc[e + "linear_fc2.bias"], sd[x + "down_proj_bias"][3])
    a, h = "decoder.layers.0.self_attention.", "model.layers.0.self_attn."
    assert torch.equal(mc[a + "core_attention.softmax_offset"], sd[h + "sinks"])
    assert torch.equal(mc[a + "linear_proj.bias"], sd[h + "o_proj.bias"])
    assert torch.equal(mc["decoder.layers.0.mlp.router.bias"], sd["model.layers.0.mlp.router.bias"])


def test_megatron_config_follows_the_window_sinks_experts_and_rope(models):
    cfg, _ = models["gpt_oss"]
    bridge = get_bridge(cfg)
    tc, kw = bridge.transformer_config(cfg), bridge.gpt_model_kwargs(cfg)
    assert (tc["add_bias_linear"], tc["softmax_type"], tc["glu_linear_offset"]) == (True, "learnable", 1.0)
    assert tc["window_size"] == (7, 0) and tc["window_attn_skip_freq"] == [1, 0]  # 8 keys, layer 0 only
    assert tc["activation_func_clamp_value"] == 7.0 and tc["activation_func"].keywords == {"alpha": 1.702}
    assert (tc["num_moe_experts"], tc["moe_router_topk"], tc["moe_ffn_hidden_size"]) == (4, 2, 384)
    assert (tc["moe_router_score_function"], tc["moe_router_pre_softmax"]) == ("softmax", False)
    assert kw["position_embedding_type"] == "rope" and not any(k.startswith("yarn_") for k in tc)
    full = bridge.transformer_config({**cfg.to_dict(), "layer_types": ["full_attention"] * 2})
    assert full["window_size"] is None and full["window_attn_skip_freq"] is None
    yarn_cfg = models["yarn_clamped"][0]
    tc, kw = bridge.transformer_config(yarn_cfg), bridge.gpt_model_kwargs(yarn_cfg)
    assert kw["position_embedding_type"] == "yarn"
    assert (tc["yarn_rotary_scaling_factor"], tc["yarn_original_max_position_embeddings"]) == (4.0, 64)
    assert (tc["yarn_correction_range_round_to_int"], tc["yarn_mscale"], tc["yarn_mscale_all_dim"]) == (
        False, None, None)  # fmt: skip


@pytest.mark.parametrize(
    "change,match",
    [
        ({"attention_bias": False}, "attention_bias false"),
        ({"num_experts_per_tok": 1}, "num_experts_per_tok 1"),
        ({"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
        ({"sliding_window": None}, "sliding_window None"),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type 'linear'",
        ),
        ({"rope_parameters": {**YARN, "attention_factor": 1.5}}, "attention_factor"),
        ({"rope_parameters": {**YARN, "partial_rotary_factor": 0.5}}, "partial_rotary_factor 0.5"),
    ],
)
def test_what_megatron_cannot_reproduce_is_refused_by_name(change, match):
    megatron_config_of(gpt_oss_config(), change, "GPT-OSS", match)


def test_preflight_takes_tp_sp_ep_at_expert_tp_1_and_lora(tiny_hf_checkpoint, tmp_path):
    """TP / SP / EP as Qwen3-MoE's with expert TP 1 (the steps: test_megatron_layouts.py); expert TP > 1
    refused by name; LoRA on attention and experts (test_lora_megatron.py)."""
    from miles_platform.config import ConfigError
    from miles_platform.preflight import validate_before_start

    run = megatron_runs(gpt_oss_config, tiny_hf_checkpoint, tmp_path)
    validate_before_start(run(use_rollout_routing_replay=True))
    two = dict(actor_num_gpus_per_node=2, global_batch_size=4)
    tp2 = dict(tensor_model_parallel_size=2, sequence_parallel=True)
    validate_before_start(run(**two, **tp2, expert_tensor_parallel_size=1))
    validate_before_start(run(**two, expert_model_parallel_size=2))
    with pytest.raises(
        ConfigError, match="expert tensor parallel 2 .* GPT-OSS's biased experts: .* add --expert-tensor"
    ):
        validate_before_start(run(**two, **tp2))
    validate_before_start(run(lora_rank=4))  # the default: attention and the experts
    with pytest.raises(ConfigError, match="expert adapters on megatron are built at tensor parallel 1"):
        validate_before_start(run(**two, **tp2, expert_tensor_parallel_size=1, lora_rank=4))


# ---------------------------------------------------------------- megatron (subprocess)


@pytest.fixture(scope="module")
def megatron_report(tiny_hf_checkpoint, tmp_path_factory):
    """One subprocess: the parity of each variant with its controls, then hf -> torch_dist -> hf."""
    from test_deepseek_v3_bridge import bridge_report

    return bridge_report(
        lambda v: sharp_gpt_oss(gpt_oss_config(v)), tiny_hf_checkpoint, tmp_path_factory, "gpt_oss", __file__
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_megatron_logits_loss_grads_match_hf_in_fp32(megatron_report, variant):
    p = megatron_report["parity"][variant]
    assert p["logits_max_abs_diff"] < TOL and p["loss_abs_diff"] < TOL and p["grad_max_abs_diff"] < TOL, p
    assert p["grads_compared"] == p["hf_params"]  # every HF parameter: sinks, biases, routers, experts
    assert p["export_identical"]  # megatron's state, gathered and mapped back: HF's
    assert p["experts_routed"] == 4 and p["logits_scale"] > 0.5  # every expert used; logits not near zero
    assert variant != "yarn_clamped" or p["clamped_fraction"] > 0.1  # the clamp acts


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_without_each_gpt_oss_mapping_parity_fails(megatron_report, variant):
    """The same weights with one mapping dropped: no sinks, no window, Miles' one-key-wider window, the
    router's or the experts' biases zeroed, gate / up rows left interleaved, no +1 on up, silu's gain (1)
    for 1.702; with yarn: default rope, truncated yarn; with the clamp: none. Each is far outside the bound."""
    c = megatron_report["parity"][variant]["controls"]
    want = {"sinks", "window", "window_plus_one", "router_bias", "expert_biases", "interleave", "glu_offset",
            "swiglu_alpha"}  # fmt: skip
    want |= {"yarn", "yarn_truncate", "clamp"} if variant == "yarn_clamped" else set()
    assert set(c) == want and all(v > 1000 * TOL for v in c.values()), c


def test_hf_to_torch_dist_to_hf_is_bit_exact(megatron_report):
    """`miles-platform convert` both ways through megatron's torch_dist, written at TP 2, EP 2, expert TP 1:
    HF's tensors (the fused experts and their biases, the sinks split by TP, o_proj's and the router's
    biases) come back bit for bit."""
    from safetensors.torch import load_file

    hf, work = megatron_report["hf"], megatron_report["work"]
    # 2 ranks: TP 2, and EP 2 x expert TP 1 over the same two: one file per rank
    assert len(list((work / "td" / "release").glob("*.distcp"))) == 2
    a, b = load_file(f"{hf}/model.safetensors"), load_file(str(work / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b) and {"model.layers.0.self_attn.sinks", "model.layers.1.mlp.router.bias",
                                        "model.layers.1.mlp.experts.down_proj_bias"} <= set(a)  # fmt: skip
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def test_one_ci_test_grpo_step_with_r3_on_megatron_gives_the_engines_log_probs(tiny_hf_checkpoint, tmp_path):
    """The embedded engine (transformers' GPT-OSS) rolls out with R3 past the 8-token window (prompts up
    to 7 tokens + up to 10 new); the megatron trainer's log-probs of those tokens equal the engine's, and
    one --ci-test GRPO step passes the step-0 checks with the routes replayed and moves the sinks, the
    attention, the router's bias and the experts' biases."""
    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint

    tok = load_tokenizer(tiny_hf_checkpoint)
    ckpt = str(tmp_path / "gpt_oss")
    save_hf_checkpoint(sharp_gpt_oss(gpt_oss_config(len(tok))), tok, ckpt)
    start, after = megatron_grpo_step(ckpt, tmp_path, moe_layers=2)
    for name in ("model.layers.0.self_attn.sinks", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.1.mlp.router.bias", "model.layers.1.mlp.experts.gate_up_proj_bias"):  # fmt: skip
        assert not torch.equal(after[name], start[name]), name


def _parity_report(variant: str) -> dict:
    cfg_obj = gpt_oss_config(**VARIANTS[variant])
    hf = sharp_gpt_oss(cfg_obj)
    clamped = []  # of each layer: the fraction of (token, expert) gate / up pre-activations past the limit

    def count(m, args):
        gate_up = (args[0] @ m.gate_up_proj + m.gate_up_proj_bias[:, None]).detach()  # [E, tokens, 2I]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        clamped.append(((gate > m.limit).sum() + (up.abs() > m.limit).sum()).item() / gate_up.numel())

    hooks = [layer.mlp.experts.register_forward_pre_hook(count) for layer in hf.model.layers]
    out, cfg, _, control = megatron_vs_hf(cfg_obj, hf)
    for h in hooks:
        h.remove()
    out["clamped_fraction"] = min(clamped)

    def edit(fn):
        return lambda full: {k: fn(k, t) for k, t in full.items()}

    inter = cfg["intermediate_size"]

    def interleaved(k, t):  # megatron's [gate; up] rows back in HF's column order
        if not k.endswith(("linear_fc1.weight", "linear_fc1.bias")):
            return t
        return torch.stack([t[:inter], t[inter:]], dim=1).reshape(t.shape)

    def no_offset(k, t):  # up - 1: megatron's + 1 cancelled
        return torch.cat([t[:inter], t[inter:] - 1.0]) if k.endswith("linear_fc1.bias") else t

    def zeroed(*suffixes):
        return edit(lambda k, t: torch.zeros_like(t) if k.endswith(suffixes) else t)

    n, rope = cfg["num_hidden_layers"], cfg["rope_parameters"]
    controls = {
        "sinks": lambda: control(
            cfg, edit=edit(lambda k, t: torch.full_like(t, -1e4) if k.endswith("softmax_offset") else t)
        ),
        "window": lambda: control({**cfg, "layer_types": ["full_attention"] * n}),
        "window_plus_one": lambda: control({**cfg, "sliding_window": cfg["sliding_window"] + 1}),
        "router_bias": lambda: control(cfg, edit=zeroed("router.bias")),
        "expert_biases": lambda: control(cfg, edit=zeroed("linear_fc1.bias", "linear_fc2.bias")),
        "interleave": lambda: control(cfg, edit=edit(interleaved)),
        "glu_offset": lambda: control(cfg, edit=edit(no_offset)),
        "swiglu_alpha": lambda: control({**cfg, "swiglu_alpha": 1.0}),
    }
    if rope["rope_type"] == "yarn":
        controls["yarn"] = lambda: control(
            {**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
        )
        controls["yarn_truncate"] = lambda: control({**cfg, "rope_parameters": {**rope, "truncate": True}})
    if cfg["swiglu_limit"] < 7.0:
        controls["clamp"] = lambda: control({**cfg, "swiglu_limit": 1e9})
    out["controls"] = {name: run() for name, run in controls.items()}
    return out


def _main(mode: str, hf: str, work: str) -> None:
    # the conversion at TP 2, EP 2, expert TP 1: torch_dist reshards on load
    layout = "--tensor-model-parallel-size 2 --expert-model-parallel-size 2 --expert-tensor-parallel-size 1"
    parity_then_convert(_parity_report, VARIANTS, hf, work, *layout.split())


if __name__ == "__main__":
    _main(*sys.argv[1:])
