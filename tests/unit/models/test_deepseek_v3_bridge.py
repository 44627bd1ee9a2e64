"""DeepSeek-V3 on megatron-core (models/bridge/deepseek_v3.py): MLA attention and DeepSeek's MoE (first
layers dense, sigmoid routing with the score-correction bias, group-limited top-k, shared experts,
routed_scaling_factor). HF <-> megatron names bit-exact both ways; megatron's GPTModel logits, loss and
gradients equal transformers' DeepseekV3ForCausalLM in fp32, for DeepSeek's interleaved rope with
q_lora and for HF's half-split rope without q_lora under yarn; controls show each mapping is what
makes it pass (the rope row order, the expert bias, the group limit, the scaling factor, yarn);
torch_dist conversion both ways is bit-exact; preflight takes the family on megatron and refuses TP,
EP and LoRA there by name; and one --ci-test GRPO step with R3 on --train-backend megatron gives the
embedded engine's log-probs.

Everything touching torch.distributed runs in a subprocess (this file as a script, or run_ranks).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_platform.errors import CheckpointError
from miles_platform.models.bridge import get_bridge
from miles_platform.models.families import build_model, tiny_config

REPO = Path(__file__).resolve().parents[3]
TOL = 1e-5  # fp32 parity, as the other families (tests/unit/training/test_model_families_megatron.py)
# yarn as DeepSeek publishes it (factor 40, original 4096), scaled to the tiny context; mscale_all_dim
# != mscale so both the rotary attention factor and the softmax scale differ from 1
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7}  # fmt: skip
# the parity shapes: DeepSeek-V3's own layout (rope_interleave, q_lora_rank), the other branch of each
# mapping (HF's half-split rope, one q_proj, yarn), and GLM-4.7-Flash (DeepSeek-V3's classes renamed,
# dense layers by mlp_layer_types, no group limit)
VARIANTS = {
    "v3": {},
    "halves_no_q_lora_yarn": {"rope_interleave": False, "q_lora_rank": None, "rope_parameters": YARN},
    "glm4_7_flash": {"family": "glm4_moe_lite"},
}


def deepseek_config(vocab: int = 128, family: str = "deepseek_v3", **overrides):
    """The tiny DeepSeek-V3 (families.py: layer 0 dense, layer 1 MoE: 4 experts in 2 groups, top-2
    from 1 group, 1 shared expert), untied; `family="glm4_moe_lite"`: the tiny GLM-4.7-Flash."""
    return tiny_config(family, vocab, tie_word_embeddings=False, **overrides)


def sharp_model(cfg, seed: int = 5):
    """HF's model with weights drawn so each mapping shows in the logits: norms away from 1, sharp
    attention (positions matter), routers at std 0.5 and score-correction biases at std 0.3 (they
    change which experts win; HF initializes both near zero), experts scaled up."""
    model = build_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            if name.endswith(
                ("q_b_proj.weight", "q_proj.weight", "kv_b_proj.weight", "kv_a_proj_with_mqa.weight")
            ):
                p.mul_(4.0)
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5, generator=g)
            if ".experts." in name:
                p.mul_(5.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3, generator=g)
    return model


def _state(cfg, model) -> dict[str, torch.Tensor]:
    return {
        k: v for k, v in model.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")
    }


# ---------------------------------------------------------------- names, without megatron


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("fused_norms", [False, True])
def test_round_trip_is_bit_exact(variant, fused_norms):
    cfg = deepseek_config(**VARIANTS[variant])
    back, disk = round_trip(cfg, _state(cfg, sharp_model(cfg)), fused_norms)[1:]
    # the on-disk layout is one tensor per expert
    from miles_platform.models.checkpoint_layout import split_fused_experts

    split = split_fused_experts(back)
    assert sorted(disk) == sorted(split) and all(torch.equal(disk[k], split[k]) for k in split)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in disk


def round_trip(cfg, sd: dict, fused_norms: bool) -> tuple[dict, dict, dict]:
    """HF -> megatron (local or TE names) -> HF is bit-exact, and HF's on-disk layout of it
    (`checkpoint_layout`) maps to the same megatron state: (megatron state, HF state back, on disk).
    Also the GLM-4.5 and GPT-OSS bridges' (test_glm4_moe_bridge.py, test_gpt_oss_bridge.py)."""
    bridge = get_bridge(cfg)
    mc = bridge.hf_to_megatron(sd, cfg, fused_norms=fused_norms, padded_vocab_size=256)
    back = bridge.megatron_to_hf(mc, cfg)
    assert sorted(back) == sorted(sd)
    for k in sd:
        assert back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k]), k
    disk = bridge.checkpoint_layout(back, cfg)
    again = bridge.hf_to_megatron(disk, cfg, fused_norms=fused_norms, padded_vocab_size=256)
    assert sorted(again) == sorted(mc) and all(torch.equal(again[k], mc[k]) for k in mc)
    return mc, back, disk


def test_the_te_spec_names_are_told_from_the_local_ones():
    """What picks `fused_norms` for a built model (megatron_backend.uses_fused_norms) sees MLA's TE names."""
    from types import SimpleNamespace

    from miles_platform.training.megatron_backend import uses_fused_norms

    cfg = deepseek_config()
    sd, bridge = _state(cfg, sharp_model(cfg)), get_bridge(cfg)
    for fused in (False, True):
        mc = bridge.hf_to_megatron(sd, cfg, fused_norms=fused)
        assert uses_fused_norms(SimpleNamespace(state_dict=lambda mc=mc: mc)) is fused


def test_megatron_names_of_the_dense_and_the_moe_layer():
    cfg = deepseek_config()
    sd = _state(cfg, sharp_model(cfg))
    mc = get_bridge(cfg).hf_to_megatron(sd, cfg)
    a0, a1 = "decoder.layers.0.self_attention.", "decoder.layers.1."
    assert {a0 + n for n in ("linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight",
                             "linear_kv_down_proj.weight", "kv_layernorm.weight", "linear_kv_up_proj.weight",
                             "linear_proj.weight")} <= set(mc)  # fmt: skip
    assert "decoder.layers.0.mlp.linear_fc1.weight" in mc and "decoder.layers.0.mlp.router.weight" not in mc
    bias = mc[a1 + "mlp.router.expert_bias"]
    assert torch.equal(bias, sd["model.layers.1.mlp.gate.e_score_correction_bias"]) and bias.abs().max() > 0.1
    fc1 = mc[a1 + "mlp.shared_experts.linear_fc1.weight"]
    assert torch.equal(fc1[:48], sd["model.layers.1.mlp.shared_experts.gate_proj.weight"])
    assert torch.equal(fc1[48:], sd["model.layers.1.mlp.shared_experts.up_proj.weight"])


def test_rope_rows_keep_deepseeks_interleave_and_pair_hfs_halves():
    """rope_interleave (DeepSeek's layout) is megatron MLA's: rows as they are. HF's half-split layout
    pairs rows j and j + 4 of a head's 8 rope rows: megatron's (2j, 2j + 1) get them."""
    for interleave in (True, False):
        cfg = deepseek_config(rope_interleave=interleave)
        sd = _state(cfg, sharp_model(cfg))
        mc = get_bridge(cfg).hf_to_megatron(sd, cfg)
        q_hf = sd["model.layers.0.self_attn.q_b_proj.weight"].reshape(4, 16, -1)
        q_mc = mc["decoder.layers.0.self_attention.linear_q_up_proj.weight"].reshape(4, 16, -1)
        kv_hf = sd["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
        kv_mc = mc["decoder.layers.0.self_attention.linear_kv_down_proj.weight"]
        order = list(range(8)) if interleave else [0, 4, 1, 5, 2, 6, 3, 7]
        assert torch.equal(q_mc[:, :8], q_hf[:, :8]) and torch.equal(kv_mc[:16], kv_hf[:16])  # no-rope rows
        assert torch.equal(q_mc[:, 8:], q_hf[:, 8:][:, order]) and torch.equal(kv_mc[16:], kv_hf[16:][order])


def test_megatron_config_follows_the_routing_and_mla_fields():
    cfg = deepseek_config()
    bridge = get_bridge(cfg)
    tc = bridge.transformer_config(cfg)
    assert tc["multi_latent_attention"] and tc["qk_layernorm"] and tc["rope_type"] == "rope"
    assert (tc["q_lora_rank"], tc["kv_lora_rank"], tc["qk_head_dim"], tc["qk_pos_emb_head_dim"], tc["v_head_dim"]) == (
        24, 16, 8, 8, 16)  # fmt: skip
    assert tc["moe_layer_freq"] == [0, 1] and tc["moe_shared_expert_intermediate_size"] == 48
    assert (tc["moe_router_score_function"], tc["moe_router_enable_expert_bias"]) == ("sigmoid", True)
    assert tc["moe_router_bias_update_rate"] == 0.0  # the bias stays the checkpoint's, as HF's model keeps it
    assert (tc["moe_router_num_groups"], tc["moe_router_group_topk"], tc["moe_router_topk_scaling_factor"]) == (
        2, 1, 2.5)  # fmt: skip
    yarn = bridge.transformer_config(deepseek_config(rope_parameters=YARN))
    assert (yarn["rope_type"], yarn["rotary_scaling_factor"], yarn["original_max_position_embeddings"]) == (
        "yarn", 4.0, 64)  # fmt: skip
    assert (yarn["mscale"], yarn["mscale_all_dim"]) == (1.0, 0.7)
    assert (
        bridge.transformer_config(deepseek_config(n_group=1, topk_group=1))["moe_router_num_groups"] is None
    )


def megatron_config_of(config, change: dict, family: str, match: str | None):
    """The bridge's megatron config of `config` changed by `change`; with `match`, its refusal: a
    CheckpointError naming the family, the field and the way out (`--train-backend fsdp`)."""
    c = {**config.to_dict(), **change}
    if match is None:
        return get_bridge(c).transformer_config(c)
    with pytest.raises(CheckpointError, match=f"{family} config: .*{match}.*--train-backend fsdp"):
        get_bridge(c).transformer_config(c)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"norm_topk_prob": False}, "norm_topk_prob False"),
        ({"num_experts_per_tok": 1}, "num_experts_per_tok 1"),
        (
            {"n_group": 2, "topk_group": 2, "num_experts_per_tok": 3},
            None,
        ),  # every group kept: no limit, taken
        ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2}, "topk must be 2 x topk_group"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"n_shared_experts": 0}, "n_shared_experts 0"),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type 'linear'",
        ),
        ({"rope_parameters": {**YARN, "attention_factor": 1.5}}, "attention_factor"),
        ({"rope_parameters": {**YARN, "mscale": 0}}, "mscale_all_dim but no mscale"),
    ],
)
def test_what_megatron_cannot_reproduce_is_refused_by_name(change, match):
    megatron_config_of(deepseek_config(), change, "DeepSeek-V3", match)


def test_mtp_layers_are_dropped():
    cfg = deepseek_config()
    bridge = get_bridge(cfg)
    sd = _state(cfg, sharp_model(cfg))
    mtp = {"model.layers.2.eh_proj.weight": torch.zeros(4, 4), "model.layers.2.enorm.weight": torch.ones(4)}
    assert sorted(bridge.hf_to_megatron({**sd, **mtp}, cfg)) == sorted(bridge.hf_to_megatron(sd, cfg))
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        bridge.hf_to_megatron({**sd, "model.layers.1.self_attn.extra.weight": torch.zeros(1)}, cfg)


# ---------------------------------------------------------------- megatron (subprocess)


def bridge_report(make_model, tok_dir: str, tmp_path_factory, name: str, script: str) -> dict:
    """A bridge test's module fixture: `make_model(vocab)`'s HF model saved with `tok_dir`'s tokenizer,
    then `script`'s parity-then-convert subprocess on it: its JSON plus the HF dir and the work dir."""
    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint

    work = tmp_path_factory.mktemp(name)
    hf, tok = str(work / "hf"), load_tokenizer(tok_dir)
    save_hf_checkpoint(make_model(len(tok)), tok, hf)
    return {**_run_script("parity", hf, str(work), script=script), "hf": hf, "work": work}


def _run_script(*args: str, script: str = __file__) -> dict:
    """This file (or `script`) as a script (its own gloo group): the JSON line it prints last."""
    from loop_helpers import warm_python

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    proc = subprocess.run([*warm_python(), script, *args], capture_output=True, text=True, env=env,
                          timeout=400, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def parity():
    return _run_script("parity")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_megatron_logits_loss_grads_match_hf_in_fp32(parity, variant):
    p = parity[variant]
    assert p["logits_max_abs_diff"] < TOL and p["loss_abs_diff"] < TOL and p["grad_max_abs_diff"] < TOL, p
    assert p["grads_compared"] == p["hf_params"]  # every HF parameter, routers and experts included
    assert p["export_identical"]  # megatron's state, gathered and mapped back: HF's, bias buffer included
    assert p["experts_routed"] == 4 and p["logits_scale"] > 0.5  # every expert used; logits not near zero


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_without_each_mapping_parity_fails(parity, variant):
    """The same weights with one mapping dropped: the rope rows in the other order, the expert bias
    zeroed, no group limit, no routed_scaling_factor, default rope for yarn. Each is far outside the bound."""
    c = parity[variant]["controls"]
    yarn = ["yarn"] if VARIANTS[variant].get("rope_parameters") else []
    groups = [] if VARIANTS[variant].get("family") else ["group_limit"]  # the tiny GLM has one group
    assert sorted(c) == sorted(["expert_bias", "rope_rows", "routed_scaling", *groups, *yarn])
    assert all(v > 1000 * TOL for v in c.values()), c


def test_hf_to_torch_dist_to_hf_is_bit_exact_at_ep1_ep2_and_tp2(tiny_hf_checkpoint, tmp_path):
    """`miles-platform convert` both ways through megatron's torch_dist (the MLA layers' and the
    router's expert_bias sharded state): HF's on-disk tensors come back bit for bit, written whole, with
    the experts split over 2 ranks, and at TP2 (the up projections' heads and the experts' hidden units
    split, the latent down projections whole on each rank)."""
    from safetensors.torch import load_file

    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint

    hf, tok = str(tmp_path / "hf"), load_tokenizer(tiny_hf_checkpoint)
    save_hf_checkpoint(sharp_model(deepseek_config(len(tok))), tok, hf)
    _run_script("convert", hf, str(tmp_path))
    a, b = load_file(f"{hf}/model.safetensors"), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b) and "model.layers.1.mlp.gate.e_score_correction_bias" in a
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    # written with the experts split over 2 ranks (EP2), and at TP2, read back whole: the same bits
    for name, layout in (
        ("ep2", ["--expert-model-parallel-size", "2"]),
        ("tp2", ["--tensor-model-parallel-size", "2"]),
    ):
        _run_script("convert", hf, str(tmp_path / name), *layout)
        c = load_file(str(tmp_path / name / "back" / "model.safetensors"))
        assert sorted(a) == sorted(c) and all(
            torch.equal(a[k].view(torch.uint8), c[k].view(torch.uint8)) for k in a
        ), name


def megatron_runs(make_config, tiny_hf_checkpoint, tmp_path):
    """A maker of validated megatron RunConfigs on a saved `sharp_model(make_config(vocab size))`."""
    from loop_helpers import small_run_config

    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint

    hf, tok = str(tmp_path / "hf"), load_tokenizer(tiny_hf_checkpoint)
    save_hf_checkpoint(sharp_model(make_config(len(tok))), tok, hf)
    return lambda **flags: small_run_config(hf, tmp_path, train_backend="megatron", **flags)


def test_preflight_takes_it_on_megatron_at_ep_and_tp_and_lora(tiny_hf_checkpoint, tmp_path):
    from miles_platform.config import ConfigError
    from miles_platform.preflight import validate_before_start

    run = megatron_runs(deepseek_config, tiny_hf_checkpoint, tmp_path)
    validate_before_start(run(use_rollout_routing_replay=True))
    two = dict(actor_num_gpus_per_node=2, global_batch_size=4)
    # test_megatron_layouts: the EP2 step (attention replicated) and the TP2 + SP step equal one rank's
    validate_before_start(run(**two, tensor_model_parallel_size=2, sequence_parallel=True))
    validate_before_start(run(**two, expert_model_parallel_size=2, use_rollout_routing_replay=True))
    with pytest.raises(
        ConfigError,
        match="--tensor-model-parallel-size 2 with multi-latent attention needs --sequence-parallel",
    ):
        validate_before_start(run(**two, tensor_model_parallel_size=2))
    # LoRA on megatron (tests/unit/training/test_lora_megatron.py: MLA's steps equal fsdp's, TP2 + SP too);
    # the routed experts' adapters at tensor parallel 1
    validate_before_start(run(lora_rank=4))
    validate_before_start(run(**two, tensor_model_parallel_size=2, sequence_parallel=True, lora_rank=4,
                              target_modules="attn,mlp", exclude_modules="experts"))  # fmt: skip
    with pytest.raises(ConfigError, match="expert adapters on megatron are built at tensor parallel 1"):
        validate_before_start(run(**two, tensor_model_parallel_size=2, sequence_parallel=True, lora_rank=4))


# 3 GRPO groups of 2, prompts of 3-7 tokens, as tests/unit/models/test_hf_families.py rolls them out
PROMPTS = [[5, 9, 17, 33, 41, 7, 70], [12, 4, 99], [60, 61, 62, 63]]
NEW_TOKENS = [10, 6, 8, 10, 4, 9]


def _run_config(ckpt: str, save: str, r3: bool = True):
    from loop_helpers import UNTRAINED_ENTROPY_MAX

    from miles_platform.config import RunConfig

    return RunConfig(hf_checkpoint=ckpt, train_backend="megatron", rollout_batch_size=3, n_samples_per_prompt=2,
                     global_batch_size=6, micro_batch_size=6, lr=3e-3, save=save, num_rollout=1, ci_test=True,
                     ci_entropy_max=UNTRAINED_ENTROPY_MAX, use_rollout_routing_replay=r3).validate()  # fmt: skip


def _train_worker(
    rank: int, world: int, port: int, ckpt: str, out: str, batch, r3: bool = True, save: bool = False
) -> None:
    import traceback

    from safetensors.torch import save_file

    from miles_platform.training import megatron_shims
    from miles_platform.training.actor import TrainerActor

    torch.set_num_threads(1)
    path = Path(out, f"rank{rank}")
    try:
        actor = TrainerActor(
            _run_config(ckpt, str(Path(out, "ck")), r3), rank, world, f"tcp://127.0.0.1:{port}"
        )
        log_probs = actor.compute_log_probs(batch)
        metrics = actor.train(0, batch)
        if save:  # torch_dist weights + the optimizer's sharded state (training/megatron_checkpoint.py)
            actor.save(0)
        save_file(actor.get_hf_weights(), f"{path}.safetensors")
        Path(f"{path}.json").write_text(json.dumps({"log_probs": log_probs, "metrics": metrics}))
    except Exception:
        Path(f"{path}.error").write_text(traceback.format_exc())
    finally:
        megatron_shims.destroy_process_group()


# an attention weight of each family the step must move: MLA's kv_b_proj, GLM-4.5's q_proj (GQA)
ATTENTION_WEIGHT = {"deepseek_v3": "kv_b_proj", "glm4_moe_lite": "kv_b_proj", "glm4_moe": "q_proj"}


@pytest.mark.parametrize("family", sorted(ATTENTION_WEIGHT))
def test_one_ci_test_grpo_step_on_megatron_gives_the_engines_log_probs(family, tiny_hf_checkpoint, tmp_path):
    """The embedded engine (transformers' model) rolls out with R3; the megatron trainer's log-probs of
    those tokens equal the engine's, one --ci-test GRPO step passes the step-0 checks with the routes
    replayed, moves the weights and keeps the score-correction bias the checkpoint's. GLM-4.5
    (models/bridge/glm4_moe.py) with its q/k/v biases and partial rotary."""
    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint

    tok = load_tokenizer(tiny_hf_checkpoint)
    ckpt = str(tmp_path / "dsv3")
    biases = {"attention_bias": True} if family == "glm4_moe" else {}  # as GLM-4.5 publishes
    save_hf_checkpoint(sharp_model(deepseek_config(len(tok), family, **biases)), tok, ckpt)
    start, after = megatron_grpo_step(ckpt, tmp_path, moe_layers=1)  # layer 0 dense, layer 1 routed
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(after[bias], start[bias]) and start[bias].abs().max() > 0.1
    assert not torch.equal(after["model.layers.1.mlp.gate.weight"], start["model.layers.1.mlp.gate.weight"])
    attention = f"model.layers.0.self_attn.{ATTENTION_WEIGHT[family]}.weight"
    assert not torch.equal(after[attention], start[attention])


def megatron_grpo_step(ckpt: str, tmp_path, moe_layers: int, save: bool = False) -> tuple[dict, dict]:
    """The embedded engine rolls PROMPTS out of `ckpt` (top-2 routes in `moe_layers` layers, R3; a dense
    model at 0: no routes); one megatron rank's log-probs of those tokens equal the engine's (< 1e-4) and one
    --ci-test GRPO step passes the step-0 checks with the routes replayed (0 flips): (HF state before, HF
    export after), under transformers' module names. Also GPT-OSS's and Qwen3.5's (test_gpt_oss_bridge.py,
    test_qwen3_5_bridge.py)."""
    from loop_helpers import engine_rollout, run_ranks
    from safetensors.torch import load_file

    from miles_platform.cluster.ports import free_port
    from miles_platform.models.checkpoint import load_hf_model
    from miles_platform.models.moe import decode_routes, routed_shape
    from miles_platform.training.ci_checks import rollout_checks
    from miles_platform.training.train_batch import TrainBatch

    r3 = moe_layers > 0
    outs = engine_rollout(ckpt, PROMPTS, NEW_TOKENS, routes=r3)
    prompts = [p for p in PROMPTS for _ in range(2)]
    tokens = [p + o["output_ids"] for p, o in zip(prompts, outs, strict=True)]
    engine_lp = [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]
    routes = None
    if r3:
        assert routed_shape(ckpt) == (moe_layers, 2)
        routes = [decode_routes(o["meta_info"]["routed_experts"], *routed_shape(ckpt)).tolist() for o in outs]
    batch = TrainBatch(tokens, NEW_TOKENS, [[1] * n for n in NEW_TOKENS], [1.0, 0.0, 0.0, 1.0, 1.0, 0.0],
                       engine_lp, routed_experts=routes)  # fmt: skip
    out = tmp_path / "out"
    run_ranks(_train_worker, (1, free_port(), ckpt, str(out), batch, r3, save), 1, out)
    r = json.loads((out / "rank0.json").read_text())
    diff = max(
        abs(a - b) for t, e in zip(r["log_probs"], engine_lp, strict=True) for a, b in zip(t, e, strict=True)
    )
    assert diff < 1e-4, f"trainer-vs-engine log-prob max abs diff {diff:.3g}"
    m = r["metrics"]
    rollout_checks(_run_config(ckpt, str(tmp_path / "ck"), r3), 0, m, print)  # raises CITestFailure on a miss
    assert abs(m["train/step0_ppo_kl"]) < 1e-9 and (not r3 or m["train/moe_route_flips"] == 0), m
    start, after = load_hf_model(ckpt).state_dict(), load_file(out / "rank0.safetensors")
    assert sorted(after) == sorted(start)  # transformers' module names, buffers included
    return start, after


def megatron_vs_hf(cfg_obj, hf, T: int = 48):
    """megatron's GPTModel built from `hf`'s state (fp32, T tokens, batch 2) against `hf`: (the report:
    logits, loss, every parameter's gradient, the export; the config dict; HF's state; `control`, which
    measures a model with one mapping dropped). Also the GLM-4.5 and GPT-OSS bridges' (test_glm4_moe_bridge.py,
    test_gpt_oss_bridge.py)."""
    from miles_platform.training import megatron_backend as mb

    cfg, sd = cfg_obj.to_dict(), _state(cfg_obj, hf)
    V = cfg["vocab_size"]
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(T).expand(2, T)
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)[None, None]
    chosen = []
    mlp = hf.model.layers[1].mlp
    # GPT-OSS's router is `router`, the others' `gate` (o[2]: the experts); a dense MLP (Qwen3.5) has none
    router = mlp.router if hasattr(mlp, "router") else getattr(mlp, "gate", None)
    hook = router.register_forward_hook(lambda m, i, o: chosen.append(o[2])) if router is not None else None
    want = hf(input_ids=ids, position_ids=pos).logits
    if hook is not None:
        hook.remove()

    def build(c, state):
        model, bridge = mb.build_gpt_model(c)
        mb.load_full_state(model, state)
        return model, bridge

    def megatron_state(c, state):
        return get_bridge(c).hf_to_megatron(
            state, c, padded_vocab_size=get_bridge(c).gpt_model_kwargs(c)["vocab_size"]
        )

    def logits(model):
        return model(ids, pos, causal)[..., :V]

    model, bridge = build(cfg, megatron_state(cfg, sd))
    got = logits(model)
    nll = torch.nn.functional.cross_entropy
    m_loss = nll(got[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    h_loss = nll(want[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    m_loss.backward()
    h_loss.backward()
    grads = {n: torch.zeros_like(t) for n, t in model.state_dict().items() if isinstance(t, torch.Tensor)}
    grads.update({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    m_grads = bridge.megatron_to_hf(grads, cfg)
    # a parameter transformers computes under no_grad (DeepSeek-V3.2's indexer) has none: zeros to compare
    h_grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in hf.named_parameters()}
    exported = bridge.megatron_to_hf(mb.gather_full_state(model), cfg)
    out = dict(
        logits_max_abs_diff=(got - want).abs().max().item(),
        logits_scale=want.abs().max().item(),
        loss_abs_diff=abs(m_loss.item() - h_loss.item()),
        grad_max_abs_diff=max((m_grads[n] - h_grads[n]).abs().max().item() for n in h_grads),
        grads_compared=len(set(m_grads) & set(h_grads)),
        hf_params=len(h_grads),
        export_identical=sorted(exported) == sorted(sd) and all(torch.equal(exported[n], sd[n]) for n in sd),
        experts_routed=int(torch.unique(chosen[0]).numel()) if chosen else 0,
        megatron_indexer_grads=sum(
            p.grad is not None for n, p in model.named_parameters() if ".indexer." in n
        ),
    )

    @torch.no_grad()
    def control(c: dict, mapped_for: dict | None = None, edit=None) -> float:
        """max |logit diff| from HF's of a model built for config `c` holding HF's state mapped for
        `mapped_for` (default: `c`), then `edit`ed: each one mapping dropped."""
        full = megatron_state(mapped_for or c, sd)
        return (logits(build(c, edit(full) if edit else full)[0]) - want).abs().max().item()

    return out, cfg, sd, control


def zero_expert_bias(full: dict) -> dict:
    return {k: torch.zeros_like(v) if k.endswith("expert_bias") else v for k, v in full.items()}


def _parity_report(variant: str) -> dict:
    cfg_obj = deepseek_config(**VARIANTS[variant])
    out, cfg, _, control = megatron_vs_hf(cfg_obj, sharp_model(cfg_obj))
    controls = {  # the other rope row order loaded into the model built for this config
        "rope_rows": lambda: control(cfg, mapped_for={**cfg, "rope_interleave": not cfg["rope_interleave"]}),
        "expert_bias": lambda: control(cfg, edit=zero_expert_bias),
        "routed_scaling": lambda: control({**cfg, "routed_scaling_factor": 1.0}),
    }
    if cfg["n_group"] > 1:
        controls["group_limit"] = lambda: control({**cfg, "n_group": 1, "topk_group": 1})
    if cfg["rope_parameters"]["rope_type"] == "yarn":  # its frequencies, attention factor, softmax scale
        controls["yarn"] = lambda: control(
            {**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
        )
    out["controls"] = {name: run() for name, run in controls.items()}
    return out


def _convert(hf: str, work: str, *layout: str) -> dict:
    """hf-to-torch-dist (at the `layout` flags) then torch-dist-to-hf: the CLI's JSON reports."""
    from contextlib import redirect_stdout
    from io import StringIO

    from miles_platform.weights import conversion

    report = {}
    for name, argv in (
        ("to_torch_dist", ["hf-to-torch-dist", "--hf-checkpoint", hf, "--save", f"{work}/td", *layout]),
        (
            "to_hf",
            ["torch-dist-to-hf", "--load", f"{work}/td", "--hf-checkpoint", hf, "--save", f"{work}/back"],
        ),
    ):
        buf = StringIO()
        with redirect_stdout(buf):
            assert conversion.cli_main(argv) == 0
        report[name] = json.loads(buf.getvalue().strip().splitlines()[-1])
    return report


def parity_then_convert(report, variants, hf: str, work: str, *layout: str) -> None:
    """A bridge test's megatron subprocess: hf -> torch_dist (written at `layout`) -> hf in a group of
    its own, then each variant's `report` on one single-process group; JSON on stdout. The conversion
    first: this process is single-threaded then, so its ranks fork from it (forkserver.rank_context);
    after a gloo group's threads they would fork from a fresh stdlib fork server (~7 CPU-s of imports)."""
    from miles_platform.training import megatron_shims

    torch.set_num_threads(1)
    convert = _convert(hf, work, *layout)
    megatron_shims.init_single_process_group()
    parity = {v: report(v) for v in variants}
    megatron_shims.destroy_process_group()
    print(json.dumps({"parity": parity, "convert": convert}))


def _main(mode: str, *args: str) -> None:
    from miles_platform.training import megatron_shims

    torch.set_num_threads(1)
    if mode == "convert":  # the conversion starts its own group
        print(json.dumps(_convert(*args)))
        return
    megatron_shims.init_single_process_group()
    report = {v: _parity_report(v) for v in VARIANTS}
    megatron_shims.destroy_process_group()
    print(json.dumps(report))


if __name__ == "__main__":
    _main(*sys.argv[1:])
