"""The HF-only families (Qwen3.5 dense / MoE, Qwen3-Next, GLM-4.5, GLM-4.7-Flash, DeepSeek-V3 / V3.2,
GPT-OSS, Gemma-4, Nemotron-H, MiniMax-M2), each on a tiny checkpoint built here: its export layout is HF's own, the embedded
engine's continuous batch (left padding, shared GRPO prefills, rows joining and leaving mid-decode:
linear-attention and Mamba state, sliding windows and sinks, MLA and the DSA indexer carried across steps)
gives the log-probs the fsdp trainer computes, and one --ci-test GRPO step holds the step-0 checks
(with R3 on the MoE ones: the engine's routes, replayed, reproduce the trainer's own) and moves the
weights. Megatron refuses each by name but DeepSeek-V3, GLM-4.7-Flash (test_deepseek_v3_bridge.py) and
GLM-4.5 (test_glm4_moe_bridge.py); their vision-language checkpoints and mxfp4 weights are refused at
validation."""

import json
import math
import shutil

import pytest
import torch
from loop_helpers import engine_rollout
from safetensors.torch import load_file

from miles_platform.config import ConfigError, RunConfig
from miles_platform.errors import CheckpointError
from miles_platform.models.bridge import get_bridge
from miles_platform.models.checkpoint import load_hf_model, validate_hf_dir
from miles_platform.models.checkpoint_layout import fuse_checkpoint_experts, split_fused_experts
from miles_platform.models.families import HF_FAMILIES, REFUSED_ARCHITECTURES, is_moe_config
from miles_platform.models.mla_cache import is_mla_attention
from miles_platform.models.moe import RoutingReplay, balance_loss, decode_routes, routed_shape
from miles_platform.models.tiny import save_tiny_checkpoint
from miles_platform.preflight import _check_moe
from miles_platform.training.actor import TrainBatch, TrainerActor

# 3 GRPO groups of 2 (shared prefills), prompts of 3-9 tokens; with at most 4 rows running, rows
# finish at different lengths and queued ones join the running batch mid-decode. Up to 23 tokens:
# past the tiny sliding windows and DSA's top-8.
PROMPTS = [[5, 9, 17, 33, 41, 7, 70, 71, 72], [12, 4, 99], [60, 61, 62, 63, 64, 65]]
NEW_TOKENS = [14, 6, 10, 14, 4, 12]
# the tiny checkpoints' routed layers: DeepSeek / GLM keep their first layer dense, Nemotron-H's
# pattern is Mamba, attention, MoE
MOE_LAYERS = {"qwen3_5_moe": 2, "qwen3_next": 2, "glm4_moe": 1, "glm4_moe_lite": 1, "deepseek_v3": 1,
              "deepseek_v32": 1, "gpt_oss": 2, "nemotron_h": 1, "minimax_m2": 2}  # fmt: skip


def _rollout(ckpt: str, moe: bool, family: str) -> list[dict]:
    def check(core):
        assert core.stats["num_shared_prefill_rows"] > 0
        # MLA: decode runs absorbed against the compressed cache (models/mla_cache.py)
        mla = [m._mla_absorbed for m in core.model.modules() if is_mla_attention(m)]
        assert len(mla) == (2 if HF_FAMILIES[family].mla else 0) and all(mla)

    return engine_rollout(ckpt, PROMPTS, NEW_TOKENS, moe, check)


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_family_exports_rolls_out_and_trains_under_ci_test(family, tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / family, family)
    hf = validate_hf_dir(ckpt)
    moe = is_moe_config(hf)
    model = load_hf_model(ckpt)
    assert type(model).__name__ == HF_FAMILIES[family].architecture
    # the export / publication layout is the one HF saved (and loads back)
    saved = load_file(f"{ckpt}/model.safetensors")
    tied = model.config.tie_word_embeddings
    module = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    export = split_fused_experts(module)
    assert sorted(export) == sorted(saved) and all(torch.equal(export[k], saved[k]) for k in saved)
    back = fuse_checkpoint_experts(saved)  # what an engine reads from an export / publication
    assert sorted(back) == sorted(module) and all(torch.equal(back[k], module[k]) for k in module)

    outs = _rollout(ckpt, moe, family)
    prompts = [p for p in PROMPTS for _ in range(2)]
    tokens = [p + o["output_ids"] for p, o in zip(prompts, outs, strict=True)]
    lens = [len(o["output_ids"]) for o in outs]
    assert lens == NEW_TOKENS
    engine_lp = [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]
    routes = None
    if moe:
        rr = RoutingReplay.of(model)  # the run decodes routes with routed_shape: its MoE layers only
        assert routed_shape(ckpt) == (rr.num_layers, rr.top_k) == (MOE_LAYERS[family], 2)
        routes = [decode_routes(o["meta_info"]["routed_experts"], *routed_shape(ckpt)).tolist() for o in outs]
        assert [len(r) for r in routes] == [len(t) - 1 for t in tokens]
    cfg = RunConfig(hf_checkpoint=ckpt, rollout_batch_size=3, n_samples_per_prompt=2, global_batch_size=6,
                    micro_batch_size=6, lr=3e-3, save=str(tmp_path / "ck"), num_rollout=1, ci_test=True,
                    use_rollout_routing_replay=moe, moe_aux_loss_coeff=0.01 if moe else 0.0).validate()  # fmt: skip
    actor = TrainerActor(cfg)
    batch = TrainBatch(tokens, lens, [[1] * n for n in lens], [1.0, 0.0, 0.0, 1.0, 1.0, 0.0], engine_lp,
                       routed_experts=routes)  # fmt: skip
    trainer_lp = actor.compute_log_probs(batch)
    diff = max(
        abs(a - b) for t, e in zip(trainer_lp, engine_lp, strict=True) for a, b in zip(t, e, strict=True)
    )
    assert diff < 1e-4, f"{family}: trainer-vs-engine log-prob max abs diff {diff:.3g}"
    before = {k: v.clone() for k, v in actor.get_hf_weights().items()}
    m = actor.train(0, batch)
    assert abs(m["train/step0_ppo_kl"]) < 1e-9 and m["train/step0_pg_clipfrac"] < 1e-10
    assert m["train/train_rollout_logprob_abs_diff"] < cfg.ci_logprob_abs_diff_threshold
    assert not moe or m["train/moe_route_flips"] == 0  # replayed routes are the trainer's own, same gates
    assert not moe or 0.5 < m["train/moe_aux_loss"] < 2.5  # ~1 when even (k=2 of 4)
    after = actor.get_hf_weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(bool(torch.isfinite(v).all()) for v in after.values()) and math.isfinite(m["train/grad_norm"])

    arch = HF_FAMILIES[family].architecture
    if not HF_FAMILIES[
        family
    ].megatron:  # Qwen3.5, DeepSeek-V3, GLM-4.x, GPT-OSS, MiniMax-M2: their bridges' tests
        _check_moe(RunConfig(hf_checkpoint=ckpt, train_backend="megatron"), hf)
        assert get_bridge(hf).architectures == (arch,)
        return
    with pytest.raises(
        ConfigError,
        match=f"--train-backend megatron.*{arch} \\({family}\\): no megatron bridge is written here",
    ):
        _check_moe(RunConfig(hf_checkpoint=ckpt, train_backend="megatron"), hf)
    with pytest.raises(CheckpointError, match=f"{arch} \\({family}\\) on the megatron backend"):
        get_bridge(hf)  # what SFT and the trainer's build ask


@pytest.mark.parametrize("arch", sorted(REFUSED_ARCHITECTURES))
def test_refused_families_are_named_with_why(arch, tiny_hf_checkpoint, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_hf_checkpoint, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": [arch]}))
    with pytest.raises(CheckpointError, match=f"{arch} is refused: a vision-language checkpoint: the text"):
        validate_hf_dir(bad)


def test_mxfp4_gpt_oss_is_refused_naming_the_format(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "gpt_oss", "gpt_oss")
    cfg = json.loads((tmp_path / "gpt_oss" / "config.json").read_text())
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "gpt_oss" / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(CheckpointError, match="quantization_config mxfp4/None is not read here.*bf16"):
        validate_hf_dir(ckpt)


def test_sigmoid_routers_balance_loss_is_megatrons():
    """DeepSeek / GLM routers score with a sigmoid: megatron's aux loss then takes the sigmoid
    normalized over the experts (compute_routing_scores_for_aux_loss), not a softmax."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0], [0.1, 0.2, -3.0, 1.0], [-0.5, 1.5, 0.3, 0.3]])
    tokens = torch.tensor([2.0, 1.0, 1.0, 2.0])  # top-2 of 3 tokens
    p = logits.sigmoid() / logits.sigmoid().sum(-1, keepdim=True)
    want = 4 / (2 * 3 * 3) * float((p.sum(0) * tokens).sum())  # E / (k T^2) sum_e P_e f_e
    assert float(balance_loss(logits, tokens, 2, "sigmoid")) == pytest.approx(want, rel=1e-6)
    assert float(balance_loss(logits, tokens, 2)) != pytest.approx(want, rel=1e-3)
