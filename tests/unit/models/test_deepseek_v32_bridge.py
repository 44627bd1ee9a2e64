"""DeepSeek-V3.2 on megatron-core (models/bridge/deepseek_v32.py, training/megatron_dsa.py): DeepSeek-V3's
MLA and MoE plus the DSA indexer on megatron-core's DSAttention. HF <-> megatron names bit-exact both
ways (local and TE names); megatron's logits, loss and gradients equal transformers'
DeepseekV32ForCausalLM in fp32 with the indexer keeping 8 of 48 tokens; controls show the sparse
attention and each indexer mapping are what make it pass (all keys kept, HF's row order, the k_norm
bias dropped); torch_dist conversion both ways is bit-exact; preflight takes EP and TP + SP and refuses
CP by name; one --ci-test GRPO step with R3 on --train-backend megatron gives the embedded engine's
log-probs and leaves the frozen indexer as it was.

Everything touching torch.distributed runs in a subprocess (this file as a script, or run_ranks).
"""

import sys

import pytest
import torch
from test_deepseek_v3_bridge import (
    TOL,
    _state,
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

INDEXER = ("linear_wq_b.weight", "linear_wk.weight", "k_norm.weight", "k_norm.bias")


def v32_config(vocab: int = 128, **overrides):
    """The tiny DeepSeek-V3.2 (families.py: V3's, the indexer keeping 8 tokens, 8 heads of 16 dims)."""
    return tiny_config("deepseek_v32", vocab, tie_word_embeddings=False, **overrides)


def sharp_v32(cfg, seed: int = 5):
    """sharp_model's weights, the indexer's scaled up and its LayerNorm away from (1, 0): each of its
    mappings changes which tokens a query keeps."""
    model = sharp_model(cfg, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".indexer." in name and name.endswith(("wq_b.weight", "wk.weight", "weights_proj.weight")):
                p.mul_(4.0)
            if ".indexer.k_norm." in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("fused_norms", [False, True])
def test_round_trip_is_bit_exact(fused_norms):
    cfg = v32_config()
    mc = round_trip(cfg, _state(cfg, sharp_v32(cfg)), fused_norms)[0]
    sa = "decoder.layers.0.self_attention."
    # the indexer reads the normed query latent: the norm is apart on TE's spec too (megatron_dsa.py)
    assert sa + "q_layernorm.weight" in mc and sa + "linear_q_up_proj.layer_norm_weight" not in mc
    assert {sa + "core_attention.indexer." + n for n in (*INDEXER, "linear_weights_proj.weight")} <= set(mc)


def test_indexer_rows_put_the_rope_dims_last_as_interleaved_pairs():
    """HF's indexer head: 8 rope rows first (pairs j, j + 4), then 8 others; megatron's: the others, then
    the rope rows as (0, 4), (1, 5), ...: megatron MLA's interleaved pairs."""
    cfg = v32_config()
    sd = _state(cfg, sharp_v32(cfg))
    mc = get_bridge(cfg).hf_to_megatron(sd, cfg)
    order = list(range(8, 16)) + [0, 4, 1, 5, 2, 6, 3, 7]
    hf, ix = "model.layers.0.self_attn.indexer.", "decoder.layers.0.self_attention.core_attention.indexer."
    q_hf, q_mc = sd[hf + "wq_b.weight"].reshape(8, 16, -1), mc[ix + "linear_wq_b.weight"].reshape(8, 16, -1)
    assert torch.equal(q_mc, q_hf[:, order]) and torch.equal(
        mc[ix + "linear_wk.weight"], sd[hf + "wk.weight"][order]
    )
    assert torch.equal(mc[ix + "k_norm.bias"], sd[hf + "k_norm.bias"][order])
    assert torch.equal(mc[ix + "linear_weights_proj.weight"], sd[hf + "weights_proj.weight"])
    tc = get_bridge(cfg).transformer_config(cfg)
    assert (tc["experimental_attention_variant"], tc["dsa_indexer_topk"], tc["dsa_indexer_n_heads"]) == (
        "dsa",
        8,
        8,
    )
    assert tc["dsa_indexer_head_dim"] == 16 and tc["dsa_indexer_loss_coeff"] == 0.0


@pytest.mark.parametrize(
    "change,match",
    [
        ({"q_lora_rank": None}, "q_lora_rank null"),
        ({"index_head_dim": 8}, "index_head_dim 8 with qk_rope_head_dim 8"),
    ],
)
def test_what_the_indexer_mapping_cannot_take_is_refused_by_name(change, match):
    c = {**v32_config().to_dict(), **change}
    with pytest.raises(CheckpointError, match=f"DeepSeek-V3.2 config: {match}.*--train-backend fsdp"):
        get_bridge(c).transformer_config(c)


def test_preflight_takes_it_on_megatron_at_ep_and_tp_and_refuses_cp(tiny_hf_checkpoint, tmp_path):
    from miles_platform.config import ConfigError
    from miles_platform.preflight import validate_before_start

    run = megatron_runs(v32_config, tiny_hf_checkpoint, tmp_path)
    validate_before_start(run(use_rollout_routing_replay=True))
    two = dict(actor_num_gpus_per_node=2, global_batch_size=4)
    validate_before_start(run(**two, expert_model_parallel_size=2, use_rollout_routing_replay=True))
    validate_before_start(run(**two, tensor_model_parallel_size=2, sequence_parallel=True))
    with pytest.raises(ConfigError, match="--context-parallel-size 2 with DeepSeek sparse attention"):
        validate_before_start(run(**two, context_parallel_size=2))


# ---------------------------------------------------------------- megatron (subprocess)


@pytest.fixture(scope="module")
def megatron_report(tiny_hf_checkpoint, tmp_path_factory):
    """One subprocess: the parity report, then hf -> torch_dist -> hf of a saved checkpoint."""
    from test_deepseek_v3_bridge import bridge_report

    return bridge_report(
        lambda v: sharp_v32(v32_config(v)), tiny_hf_checkpoint, tmp_path_factory, "dsv32", __file__
    )


def test_megatron_logits_loss_grads_match_hf_in_fp32(megatron_report):
    p = megatron_report["parity"]["v32"]
    assert p["logits_max_abs_diff"] < TOL and p["loss_abs_diff"] < TOL and p["grad_max_abs_diff"] < TOL, p
    # every HF parameter; the indexer's gradient is none on both sides (transformers: no_grad; megatron: frozen)
    assert p["grads_compared"] == p["hf_params"] and p["indexer_grads"] == {"hf": 0, "megatron": 0}, p
    assert p["export_identical"] and p["experts_routed"] == 4 and p["logits_scale"] > 0.5


def test_without_the_sparse_attention_or_each_indexer_mapping_parity_fails(megatron_report):
    """The same weights with every key kept (index_topk 4096), the indexer's rows in HF's order, or its
    k_norm bias zeroed: the queries keep other keys, far outside the bound."""
    c = megatron_report["parity"]["v32"]["controls"]
    assert sorted(c) == ["all_keys", "hf_row_order", "k_norm_bias"] and all(
        v > 1000 * TOL for v in c.values()
    ), c


def test_hf_to_torch_dist_to_hf_is_bit_exact(megatron_report):
    """`miles-platform convert` both ways through torch_dist: the indexer's tensors come back bit for
    bit with the rest."""
    from safetensors.torch import load_file

    hf, work = megatron_report["hf"], megatron_report["work"]
    a, b = load_file(f"{hf}/model.safetensors"), load_file(str(work / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b) and "model.layers.1.self_attn.indexer.k_norm.bias" in a
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def test_one_ci_test_grpo_step_on_megatron_gives_the_engines_log_probs(tiny_hf_checkpoint, tmp_path):
    """The embedded engine (transformers' model, the indexer's keys cached) rolls out with R3; the
    megatron trainer's log-probs of those tokens equal the engine's; one --ci-test GRPO step passes the
    step-0 checks, moves the attention and leaves the frozen indexer as it was; the checkpoint after it
    saves the optimizer's state without the indexer's (it never stepped: the save raised KeyError before)."""
    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint

    tok = load_tokenizer(tiny_hf_checkpoint)
    ckpt = str(tmp_path / "dsv32")
    save_hf_checkpoint(sharp_v32(v32_config(len(tok))), tok, ckpt)
    start, after = megatron_grpo_step(ckpt, tmp_path, moe_layers=1, save=True)
    assert (tmp_path / "out" / "ck" / "iter_0000000" / "optimizer" / ".metadata").exists()
    a = "model.layers.0.self_attn."
    assert not torch.equal(after[a + "kv_b_proj.weight"], start[a + "kv_b_proj.weight"])
    for name in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"):
        assert torch.equal(after[a + "indexer." + name], start[a + "indexer." + name]), name


def _parity_report(variant: str) -> dict:
    from miles_platform.models.bridge.deepseek_v3 import permute_head_rows
    from miles_platform.models.bridge.deepseek_v32 import indexer_row_order

    cfg_obj = v32_config()
    hf = sharp_v32(cfg_obj)
    out, cfg, _, control = megatron_vs_hf(cfg_obj, hf)
    out["indexer_grads"] = {"hf": sum(p.grad is not None for n, p in hf.named_parameters() if ".indexer." in n),
                            "megatron": out.pop("megatron_indexer_grads")}  # fmt: skip
    inverse = torch.argsort(indexer_row_order(get_bridge(cfg).dims(cfg)))

    def hf_order(full: dict) -> dict:  # the indexer's rows as HF stores them
        heads = {"linear_wq_b.weight": cfg["index_n_heads"]}
        return {
            k: permute_head_rows(t, inverse, heads.get(k.rsplit("indexer.", 1)[1], 1))
            if "indexer." in k and k.endswith(INDEXER)
            else t
            for k, t in full.items()
        }

    controls = {
        "all_keys": lambda: control({**cfg, "index_topk": 4096}),
        "hf_row_order": lambda: control(cfg, edit=hf_order),
        "k_norm_bias": lambda: control(
            cfg,
            edit=lambda full: {
                k: torch.zeros_like(t) if k.endswith("k_norm.bias") else t for k, t in full.items()
            },
        ),
    }
    out["controls"] = {name: run() for name, run in controls.items()}
    return out


def _main(mode: str, hf: str, work: str) -> None:
    parity_then_convert(_parity_report, ["v32"], hf, work)  # EP / TP splits: as DeepSeek-V3's (its tests)


if __name__ == "__main__":
    _main(*sys.argv[1:])
