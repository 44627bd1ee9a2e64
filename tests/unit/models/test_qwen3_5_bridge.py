"""Qwen3.5 (dense) on megatron-core (models/bridge/qwen3_5.py): megatron-core's GatedDeltaNet for the
linear-attention layers (on the CPU through training/megatron_gdn.py's torch `fla`), gated full attention
(`attention_output_gate`), zero-centered norms, a partial rotary. HF <-> megatron names bit-exact both ways;
megatron's GPTModel logits, loss and gradients equal transformers' Qwen3_5ForCausalLM in fp32 over two of the
DeltaNet's 64-token chunks; controls show each non-obvious mapping is what makes it pass (the in_proj order,
the zero-centering and the output norm's lack of it, the gate rows, the rotary fraction); torch_dist conversion
both ways (written at TP 2) is bit-exact; preflight takes TP + SP and PP (their steps: test_megatron_layouts.py)
and refuses TP without SP, CP and LoRA by name; one --ci-test GRPO step on megatron gives the embedded engine's
log-probs.

Everything touching torch.distributed runs in a subprocess (this file as a script, or run_ranks).
"""

import sys
from pathlib import Path

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

REPO = Path(__file__).resolve().parents[3]
T = 80  # two of the DeltaNet's 64-token chunks: the recurrent state crosses a chunk boundary
# Qwen3.5 and Qwen3.5-MoE (models/bridge/qwen3_5_moe.py: its MLPs 4 experts, top-2, a gated shared expert)
VARIANTS = {"qwen3_5": {}, "qwen3_5_moe": {"family": "qwen3_5_moe"}, "qwen3_next": {"family": "qwen3_next"}}


def q35_config(vocab: int = 128, family: str = "qwen3_5", **overrides):
    """The tiny Qwen3.5 (families.py: layer 0 gated DeltaNet with 2 key / 4 value heads, layer 1 gated
    full attention with 4 heads in 2 query groups, a quarter of each head rotated), untied."""
    return tiny_config(family, vocab, tie_word_embeddings=False, **overrides)


def sharp_q35(cfg, seed: int = 5):
    """test_deepseek_v3_bridge's sharp model, the shared expert's gate drawn at std 0.5 (HF's init keeps
    sigmoid(gate) near 1/2 for every token, which a gate mapped nowhere would match)."""
    model = sharp_model(cfg, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("shared_expert_gate.weight"):
                p.normal_(0.0, 0.5, generator=g)
    return model


@pytest.fixture(scope="module")
def model():
    cfg = q35_config()
    return cfg, sharp_q35(cfg)


# ---------------------------------------------------------------- names, without megatron


def test_round_trip_is_bit_exact_for_both_layer_kinds(model):
    cfg, hf = model
    sd, bridge = _state(cfg, hf), get_bridge(cfg)
    for fused_norms in (False, True):
        mc = round_trip(cfg, sd, fused_norms)[0]
    # the TE names: the input norm inside in_proj (DeltaNet) / linear_qkv (attention)
    assert {"decoder.layers.0.self_attention.in_proj.layer_norm_weight",
            "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"} <= set(mc)  # fmt: skip
    local = bridge.hf_to_megatron(sd, cfg)
    assert {"decoder.layers.0.self_attention.conv1d.weight", "decoder.layers.0.self_attention.out_norm.weight",
            "decoder.layers.0.input_layernorm.weight", "decoder.layers.1.self_attention.q_layernorm.weight"} <= set(local)  # fmt: skip
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        bridge.hf_to_megatron({**sd, "model.layers.0.linear_attn.extra.weight": torch.zeros(1)}, cfg)
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.0.linear_attn.in_proj_z.weight'"):
        bridge.hf_to_megatron({k: v for k, v in sd.items() if "in_proj_z" not in k}, cfg)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_moe_round_trip_and_its_moe_fields(family):
    """Qwen3.5-MoE / Qwen3-Next: Qwen3.5's layers (Qwen3-Next: the fused in_proj_qkvz / in_proj_ba regrouped),
    qwen3_moe.py's experts (per expert on disk), the gated shared expert."""
    cfg = q35_config(family=family)
    sd, bridge = _state(cfg, sharp_q35(cfg)), get_bridge(cfg)
    for fused_norms in (False, True):
        mc, _, disk = round_trip(cfg, sd, fused_norms)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in disk  # one tensor per expert on disk
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in mc  # the router reads it: not fused under TE
    assert torch.equal(
        mc["decoder.layers.0.mlp.shared_experts.gate_weight"],
        sd["model.layers.0.mlp.shared_expert_gate.weight"],
    )
    tc = bridge.transformer_config(cfg)
    assert (
        tc["moe_router_pre_softmax"],
        tc["moe_shared_expert_gate"],
        tc["moe_shared_expert_intermediate_size"],
    ) == (False, True, 48)
    assert tc["experimental_attention_variant"] == "gated_delta_net" and tc["num_moe_experts"] == 4
    name = {"qwen3_5_moe": "Qwen3.5-MoE", "qwen3_next": "Qwen3-Next"}[family]
    megatron_config_of(cfg, {"num_experts_per_tok": 1}, name, "num_experts_per_tok 1")
    if family == "qwen3_next":
        megatron_config_of(cfg, {"decoder_sparse_step": 2}, name, r"layers \[0\] are dense MLPs")
        assert (
            megatron_config_of(cfg, {"norm_topk_prob": False}, name, None)["moe_router_pre_softmax"] is True
        )


def test_megatron_config_and_the_fused_layouts(model):
    cfg, hf = model
    bridge, sd = get_bridge(cfg), _state(cfg, hf)
    tc, kw = bridge.transformer_config(cfg), bridge.gpt_model_kwargs(cfg)
    assert (tc["experimental_attention_variant"], tc["linear_attention_freq"]) == ("gated_delta_net", [1, 0])
    assert tc["attention_output_gate"] and tc["layernorm_zero_centered_gamma"] and tc["qk_layernorm"]
    assert (tc["linear_num_key_heads"], tc["linear_num_value_heads"], tc["linear_key_head_dim"]) == (2, 4, 8)
    assert kw["rotary_percent"] == 0.25
    mc = bridge.hf_to_megatron(sd, cfg)
    # in_proj: [qkv; z; b; a], the split GatedDeltaNet.forward makes
    h = "model.layers.0.linear_attn."
    want = torch.cat([sd[h + f"in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a")])
    assert torch.equal(mc["decoder.layers.0.self_attention.in_proj.weight"], want)
    # linear_qkv of query group 0: [its 2 heads' queries; their gates; k; v]; HF's q_proj rows are [q_h; gate_h]
    q = sd["model.layers.1.self_attn.q_proj.weight"].reshape(4, 2, 32, 128)
    group0 = mc["decoder.layers.1.self_attention.linear_qkv.weight"].reshape(2, 6 * 32, 128)[0]
    assert torch.equal(group0[:64], q[:2, 0].reshape(64, 128)) and torch.equal(
        group0[64:128], q[:2, 1].reshape(64, 128)
    )
    # config.json with the fraction at the top level (older files) or without it (Qwen3_5TextConfig's 0.25)
    c = {k: v for k, v in cfg.to_dict().items() if k != "rope_parameters"}
    assert bridge.gpt_model_kwargs({**c, "partial_rotary_factor": 0.5})["rotary_percent"] == 0.5
    assert bridge.gpt_model_kwargs(c)["rotary_percent"] == 0.25
    # no layer_types: every full_attention_interval-th layer is full attention (Qwen3_5TextConfig's default 4)
    c4 = {k: v for k, v in q35_config(num_hidden_layers=4).to_dict().items() if k != "layer_types"}
    assert bridge.transformer_config(c4)["linear_attention_freq"] == [1, 1, 1, 0]
    assert bridge.transformer_config({**c4, "full_attention_interval": 2})["linear_attention_freq"] == [
        1,
        0,
        1,
        0,
    ]


@pytest.mark.parametrize(
    "change,match",
    [
        ({"attention_bias": True}, "attention_bias true"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type 'yarn'"),
        ({"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types"),
    ],
)
def test_what_megatron_cannot_reproduce_is_refused_by_name(change, match):
    megatron_config_of(q35_config(), change, "Qwen3.5", match)


def test_preflight_takes_tp_sp_pp_and_lora_and_refuses_tp_without_sp_cp(tiny_hf_checkpoint, tmp_path):
    from miles_platform.config import ConfigError
    from miles_platform.preflight import validate_before_start

    run = megatron_runs(q35_config, tiny_hf_checkpoint, tmp_path)
    validate_before_start(run())
    two = dict(actor_num_gpus_per_node=2, global_batch_size=4)
    validate_before_start(run(**two))  # data parallel
    # TP2 + SP and PP2: their steps equal the 1-rank step (tests/unit/training/test_megatron_layouts.py)
    validate_before_start(run(**two, tensor_model_parallel_size=2, sequence_parallel=True))
    validate_before_start(run(**two, pipeline_model_parallel_size=2))
    with pytest.raises(
        ConfigError,
        match="gated-DeltaNet layers .* at --tensor-model-parallel-size 2 need --sequence-parallel",
    ):
        validate_before_start(run(**two, tensor_model_parallel_size=2))
    with pytest.raises(ConfigError, match=r"--context-parallel-size 2 with gated-DeltaNet layers \(Qwen3.5"):
        validate_before_start(run(**two, context_parallel_size=2))
    # LoRA (test_lora_megatron.py): the full-attention layers and the MLPs; a DeltaNet projection refused
    validate_before_start(run(lora_rank=4))
    with pytest.raises(ConfigError, match=r"in_proj_qkv has no adapter on the megatron backend"):
        validate_before_start(run(lora_rank=4, target_modules="attn,in_proj_qkv"))
    moe = megatron_runs(lambda v: q35_config(v, "qwen3_5_moe"), tiny_hf_checkpoint, tmp_path / "moe")
    validate_before_start(moe(use_rollout_routing_replay=True))
    validate_before_start(moe(lora_rank=4))


def test_the_cpu_fla_matches_transformers_delta_rule():
    """megatron_gdn's chunk_gated_delta_rule (megatron's torch chunks + fla's l2norm) against transformers'
    reference over 2.5 chunks, with grouped value heads and an initial state."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from miles_platform.training import megatron_gdn

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 160, 4, 8, generator=g) for _ in range(2))
    v = torch.randn(2, 160, 4, 16, generator=g)
    decay, beta = -torch.rand(2, 160, 4, generator=g), torch.rand(2, 160, 4, generator=g)
    s0 = torch.randn(2, 4, 8, 16, generator=g)
    kw = dict(g=decay, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    got, got_state = megatron_gdn.chunk_gated_delta_rule(q, k, v, **kw)
    want, want_state = hf.torch_chunk_gated_delta_rule(q, k, v, **kw)
    assert (got - want).abs().max() < TOL and (got_state - want_state).abs().max() < TOL
    assert torch.equal(megatron_gdn.l2norm(q), hf.l2norm(q))


def test_a_cuda_build_without_flash_linear_attention_is_refused_by_name():
    """The torch `fla` is the CPU's; a CUDA rank without the real one stops at the build, naming the package."""
    from miles_platform.config import ConfigError
    from miles_platform.training.megatron_gdn import check_fla, fla_available

    check_fla(torch.device("cpu"))
    if fla_available():
        pytest.skip("flash-linear-attention is installed here")
    with pytest.raises(ConfigError, match="need flash-linear-attention .*--train-backend fsdp"):
        check_fla(torch.device("cuda", 0))


# ---------------------------------------------------------------- megatron (subprocess)


@pytest.fixture(scope="module")
def megatron_report(tiny_hf_checkpoint, tmp_path_factory):
    """One subprocess: the parity and its controls, then hf -> torch_dist -> hf of a saved checkpoint, in bf16
    with A_log in fp32 as Qwen3.5 ships it (models/gdn.py)."""
    from test_deepseek_v3_bridge import _run_script

    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint
    from miles_platform.models.gdn import keep_decay_fp32

    work = tmp_path_factory.mktemp("qwen3_5")
    hf, tok = str(work / "hf"), load_tokenizer(tiny_hf_checkpoint)
    model = sharp_q35(q35_config(len(tok))).to(torch.bfloat16)
    keep_decay_fp32(model)  # A_log's bf16-rounded draw, held in fp32
    save_hf_checkpoint(model, tok, hf)
    return {**_run_script("parity", hf, str(work), script=__file__), "hf": hf, "work": work}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_megatron_logits_loss_grads_match_hf_in_fp32(megatron_report, variant):
    p = megatron_report["parity"][variant]
    assert p["logits_max_abs_diff"] < TOL and p["loss_abs_diff"] < TOL and p["grad_max_abs_diff"] < TOL, p
    assert p["grads_compared"] == p["hf_params"]  # every HF parameter: conv, dt_bias, A_log, both norms kinds
    assert p["export_identical"] and p["logits_scale"] > 0.5
    assert p["experts_routed"] == (0 if variant == "qwen3_5" else 4)  # every expert used


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_without_each_qwen3_5_mapping_parity_fails(megatron_report, variant):
    """The same weights with one mapping dropped: in_proj as [qkv; z; a; b] (or z first), the norms applied
    as x * w (no zero-centering), the DeltaNet's output norm zero-centered (x * (1 + w), what the model-wide
    flag would do to it), HF's q_proj rows [q_h; gate_h] copied as they are, the whole head rotated (on Qwen3.5:
    the code path of all three); Qwen3.5-MoE / Qwen3-Next: the shared expert's gate at 0 (sigmoid 1/2); Qwen3-Next:
    its fused rows read flat. Each is far outside the bound."""
    c = megatron_report["parity"][variant]["controls"]
    want = {"in_proj_b_a_swapped", "in_proj_z_first", "no_zero_centering", "out_norm_zero_centered",
            "gate_rows_interleaved", "rotary_percent"} if variant == "qwen3_5" else {"shared_expert_gate"}  # fmt: skip
    want |= {"in_proj_qkvz_flat"} if variant == "qwen3_next" else set()
    assert set(c) == want and all(v > 1000 * TOL for v in c.values()), c


def test_hf_to_torch_dist_to_hf_is_bit_exact(megatron_report):
    """`miles-platform convert` both ways through megatron's torch_dist, written at TP 2 (each rank its slice of
    every in_proj / conv1d part; GatedDeltaNet's sharded state names the parts) and read back whole: HF's
    tensors come back bit for bit, each in its own dtype (bf16, A_log fp32 as Qwen3.5 ships it; a mixed
    checkpoint was written all fp32 before)."""
    from safetensors.torch import load_file

    hf, work = megatron_report["hf"], megatron_report["work"]
    assert len(list((work / "td" / "release").glob("*.distcp"))) == 2  # TP 2: one file per rank
    a, b = load_file(f"{hf}/model.safetensors"), load_file(str(work / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b) and {"model.layers.0.linear_attn.A_log",
                                        "model.layers.1.self_attn.q_proj.weight"} <= set(a)  # fmt: skip
    assert a["model.layers.0.linear_attn.A_log"].dtype == torch.float32
    assert a["model.layers.1.self_attn.q_proj.weight"].dtype == torch.bfloat16
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def test_one_ci_test_grpo_step_on_megatron_gives_the_engines_log_probs(tiny_hf_checkpoint, tmp_path):
    """The embedded engine (transformers' Qwen3.5, its conv / recurrent state in the batched cache) rolls out
    rows of different lengths; the megatron trainer's log-probs of those tokens (right-padded rows through
    GatedDeltaNet) equal the engine's, and one --ci-test GRPO step passes the step-0 checks and moves both layer
    kinds' weights."""
    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint

    tok = load_tokenizer(tiny_hf_checkpoint)
    ckpt = str(tmp_path / "qwen3_5")
    save_hf_checkpoint(sharp_q35(q35_config(len(tok))), tok, ckpt)
    start, after = megatron_grpo_step(ckpt, tmp_path, moe_layers=0)
    for name in ("model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.A_log",
                 "model.layers.1.self_attn.q_proj.weight"):  # fmt: skip
        assert not torch.equal(after[name], start[name]), name


@pytest.mark.slow
@pytest.mark.parametrize(
    # Qwen3-Next's step is Qwen3.5-MoE's but for the fused in_proj rows (parity and round trip above)
    "family",
    ["qwen3_5_moe", pytest.param("qwen3_next", marks=pytest.mark.extended)],
)
def test_moe_grpo_step_with_r3_on_megatron_gives_the_engines_log_probs(family, tiny_hf_checkpoint, tmp_path):
    """Qwen3.5-MoE / Qwen3-Next: the engine's routes replayed (R3) in both layers' routers; the trainer's log-probs equal the
    engine's, one --ci-test GRPO step passes with 0 route flips and moves the router and the shared expert's gate."""
    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint

    tok = load_tokenizer(tiny_hf_checkpoint)
    ckpt = str(tmp_path / family)
    save_hf_checkpoint(sharp_q35(q35_config(len(tok), family)), tok, ckpt)
    start, after = megatron_grpo_step(ckpt, tmp_path, moe_layers=2)
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.shared_expert_gate.weight",
                 f"model.layers.0.linear_attn.in_proj_{'qkvz' if family == 'qwen3_next' else 'qkv'}.weight"):  # fmt: skip
        assert not torch.equal(after[name], start[name]), name


def _in_proj_order(order: tuple[str, ...]):
    """An edit of the megatron state: each DeltaNet's in_proj rows re-cut as `order` of qkv / z / b / a."""
    cfg = q35_config()
    nk, nv, dk, dv = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    sizes = {"qkv": 2 * nk * dk + nv * dv, "z": nv * dv, "b": nv, "a": nv}

    def edit(full):
        out = dict(full)
        for k, t in full.items():
            if k.endswith("in_proj.weight"):
                parts = dict(zip(sizes, t.split(list(sizes.values())), strict=True))
                out[k] = torch.cat([parts[p] for p in order])
        return out

    return edit


def _parity_report(variant: str) -> dict:
    cfg_obj = q35_config(**VARIANTS[variant])
    out, cfg, sd, control = megatron_vs_hf(cfg_obj, sharp_q35(cfg_obj), T=T)
    zero_centered = ("layernorm.weight", "q_layernorm.weight", "k_layernorm.weight", "final_layernorm.weight")

    def shift(suffixes, by: float, skip: str = "out_norm"):
        return lambda full: {
            k: t + by if k.endswith(suffixes) and skip not in k else t for k, t in full.items()
        }

    def interleaved_gates(full):
        """HF's q_proj rows copied as they are: each group's [q0; g0; q1; g1] instead of [q0; q1; g0; g1]."""
        hd, H = cfg["head_dim"], cfg["hidden_size"]
        out = dict(full)
        for k, t in full.items():
            if k.endswith("linear_qkv.weight"):
                grp = t.reshape(2, 6, hd, H)  # per group: 2 queries, 2 gates, k, v
                qg = torch.stack([grp[:, :2], grp[:, 2:4]], dim=2).reshape(2, 4, hd, H)
                out[k] = torch.cat([qg, grp[:, 4:]], dim=1).reshape(-1, H)
        return out

    rope = cfg["rope_parameters"]
    # the DeltaNet / attention / norm mappings are one code path for the three variants: their controls run on
    # the dense model; the MoE variants run the controls of what only they map (~8 s less in `make test`)
    controls = (
        {}
        if variant != "qwen3_5"
        else {
            "in_proj_b_a_swapped": lambda: control(cfg, edit=_in_proj_order(("qkv", "z", "a", "b"))),
            "in_proj_z_first": lambda: control(cfg, edit=_in_proj_order(("z", "qkv", "b", "a"))),
            # x * w instead of x * (1 + w): the zero-centered model holding w - 1
            "no_zero_centering": lambda: control(cfg, edit=shift(zero_centered, -1.0)),
            "out_norm_zero_centered": lambda: control(cfg, edit=shift(("out_norm.weight",), 1.0, skip="\0")),
            "gate_rows_interleaved": lambda: control(cfg, edit=interleaved_gates),
            "rotary_percent": lambda: control(
                {**cfg, "rope_parameters": {**rope, "partial_rotary_factor": 1.0}}
            ),
        }
    )
    if variant != "qwen3_5":
        controls["shared_expert_gate"] = lambda: control(cfg, edit=_zero("shared_experts.gate_weight"))
    if variant == "qwen3_next":  # HF's per-key-head groups of in_proj_qkvz / in_proj_ba read as flat parts
        controls["in_proj_qkvz_flat"] = lambda: control(cfg, edit=_flat_qkvz(sd))
    out["controls"] = {name: run() for name, run in controls.items()}
    return out


def _flat_qkvz(sd: dict):
    def edit(full):
        out = dict(full)
        for k in full:
            if k.endswith("self_attention.in_proj.weight"):
                h = k.replace("decoder.", "model.").replace(
                    "self_attention.in_proj", "linear_attn.in_proj_qkvz"
                )
                out[k] = torch.cat([sd[h], sd[h.replace("in_proj_qkvz", "in_proj_ba")]])
        return out

    return edit


def _zero(suffix: str):
    return lambda full: {k: torch.zeros_like(t) if k.endswith(suffix) else t for k, t in full.items()}


def _main(mode: str, hf: str, work: str) -> None:
    parity_then_convert(_parity_report, VARIANTS, hf, work, "--tensor-model-parallel-size", "2")


if __name__ == "__main__":
    _main(*sys.argv[1:])
