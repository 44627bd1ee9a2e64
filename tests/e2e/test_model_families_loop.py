"""Qwen2, Llama and Qwen3-MoE through the whole loop on both trainer backends (Qwen3-MoE with R3, the
aux loss and the z-loss on both; tests/unit/training/test_model_families_megatron.py /
test_moe_megatron.py check the families' megatron conversion and logits parity on their own), and
Qwen3.5-MoE (linear attention, gated shared expert, R3) on both (megatron: models/bridge/qwen3_5_moe.py,
megatron-core's GatedDeltaNet); under `make test-extended` every other HF-only family too, on fsdp
and on megatron where it has a bridge (tests/unit/models/test_hf_families.py checks each of them in
a step in `make test`): 3 GRPO rollouts with --ci-test
(step-0 ppo_kl = 0, trainer-vs-engine log-prob diff within bound, engine weights equal to the
trainer's after every sync, over HTTP), weights to the engine by disk-delta, resume from the
checkpoint, and the publications applied to a fresh replica give the trainer's exported weights."""

import pytest
import torch
from loop_helpers import small_run_config
from safetensors.torch import load_file

from miles_platform.loop import train
from miles_platform.models.families import HF_FAMILIES
from miles_platform.models.moe import routed_shape
from miles_platform.models.tiny import save_tiny_checkpoint
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths


class _Checkpoints(dict):
    """family -> its tiny checkpoint, built the first time a test asks for it (module-wide)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, family):
        self[family] = save_tiny_checkpoint(self.root / family, family)
        return self[family]


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    return _Checkpoints(tmp_path_factory.mktemp("families"))


# every other family HF's classes run: on fsdp, and on megatron through its bridge (issue 53's loop
# per family); built of what make test checks per family (test_hf_families.py: the engine's rollout
# and one --ci-test GRPO step on fsdp; each bridge's parity and megatron step), so `make test-extended`
HF_ONLY = sorted(set(HF_FAMILIES) - {"qwen3_5_moe"})


# Qwen3-MoE with R3, the aux loss and the z-loss on both backends (docs/moe.md)
@pytest.mark.parametrize(
    ("family", "backend"),
    [(f, "fsdp") for f in ("llama", "qwen2", "qwen3_moe", "qwen3_5_moe")]
    + [("qwen3_moe", "megatron")]
    # 10-25 s each: their bridges' conversion and parity (test_model_families_megatron.py,
    # test_qwen3_5_bridge.py), GRPO steps and layouts, and the megatron loop (test_loop.py, the
    # Qwen3-MoE cell) are in `make test`; these loops, composed of them, in `make test-extended`
    + [pytest.param(f, "megatron", marks=pytest.mark.extended) for f in ("llama", "qwen2", "qwen3_5_moe")]
    + [pytest.param(f, "fsdp", marks=pytest.mark.extended) for f in HF_ONLY]
    + [
        pytest.param(f, "megatron", marks=pytest.mark.extended)
        for f in HF_ONLY
        if not HF_FAMILIES[f].megatron
    ],
)
def test_family_loop_ci_disk_delta_and_resume(family_checkpoints, tmp_path, family, backend):
    from miles_platform.weights.delta_format import committed_versions
    from miles_platform.weights.disk_delta import apply_publication

    ckpt, pub = family_checkpoints[family], str(tmp_path / "pub")
    # R3, the aux loss and the z-loss where the family routes (megatron: its TopKRouters' replay hook)
    r3 = family == "qwen3_moe" or (family in HF_FAMILIES and HF_FAMILIES[family].moe)

    def cfg(num_rollout):
        return small_run_config(ckpt, tmp_path, ci_test=True, save_interval=1, num_rollout=num_rollout,
                                train_backend=backend, update_weight_transfer_mode="disk-delta",
                                update_weight_disk_dir=pub, save_hf=str(tmp_path / "hf" / "iter_{rollout_id}"),
                                use_rollout_routing_replay=r3, moe_aux_loss_coeff=0.01 if r3 else 0.0,
                                moe_z_loss_coeff=1e-3 if r3 else 0.0,
                                micro_batch_size=4)  # fmt: skip  # 4 rows per forward: megatron routes them seq-first

    res = train(cfg(2))
    assert res.final_version == 2
    assert ("train/moe_route_flips" in res.metrics[0]) is r3
    moe = r3  # expert load on both backends (megatron: its TopKRouters' routing maps)
    assert all(("train/moe_load_balance" in m) is moe for m in res.metrics)
    assert not moe or all(1.0 <= m["train/moe_load_balance"] <= 2.0 for m in res.metrics)  # k=2 of 4: <= 2
    # the aux and z-loss terms join the loss on both backends (their formulas: test_moe_r3 / test_moe_megatron)
    assert all(("train/moe_aux_loss" in m) is moe and ("train/moe_z_loss" in m) is moe for m in res.metrics)
    # ~1 with the load even; DeepSeek-V3.2's sigmoid scores on megatron read 0.9999 (measured)
    assert not moe or all(
        0.9 <= m["train/moe_aux_loss"] <= 2.0 and m["train/moe_z_loss"] > 0 for m in res.metrics
    )
    assert res.ci_checks["step0_ppo_kl"] < 1e-9  # the run itself raises past 1e-9 / the diff bound
    assert res.ci_checks["train_rollout_logprob_abs_diff"] < cfg(2).ci_logprob_abs_diff_threshold
    res2 = train(cfg(3))  # the same command with one more rollout: resumes from iter_0000001
    assert (res2.start_rollout_id, res2.final_version) == (2, 3)
    assert committed_versions(pub) == [0, 1, 2, 3]  # base snapshot, then one per update
    _, rows = Catalog(StoragePaths(cfg(3).storage_root)).query(
        "select rollout_id, count(*) from rollouts group by 1 order by 1"
    )
    assert rows == [(0, 4), (1, 4), (2, 4)]
    if r3:  # same weights, fp32 on both sides: the replayed routes are the trainer's own
        assert all(
            m["train/moe_route_flips"] == 0 and m["train/moe_load_balance"] >= 1.0 for m in res.metrics
        )
        # the routes are in the shard, one row per token but the last, per layer top-2, from DuckDB
        _, shapes = Catalog(StoragePaths(cfg(3).storage_root)).query(
            "select distinct len(rollout_routed_experts) = len(prompt_tokens) + len(response_tokens) - 1, "
            "len(rollout_routed_experts[1]), len(rollout_routed_experts[1][1]) from rollouts"
        )
        assert shapes == [(True, routed_shape(ckpt)[0], 2)], (
            shapes
        )  # DeepSeek / GLM / Nemotron-H: 1 routed layer
    # a fresh replica that applies the publications holds what the trainer exported at v3
    assert apply_publication(pub, tmp_path / "replica") == 3
    got, want = (
        load_file(str(tmp_path / "replica" / "model.safetensors")),
        load_file(str(tmp_path / "hf" / "iter_2" / "model.safetensors")),
    )
    start = load_file(f"{ckpt}/model.safetensors")
    biased = any(k.endswith("q_proj.bias") for k in start)  # Qwen2's, GLM-4.5's, GPT-OSS's
    assert sorted(got) == sorted(want) and any(k.endswith("q_proj.bias") for k in got) is biased
    # training moved the weights (names both hold: an MoE checkpoint keeps HF's per-expert tensors
    # on disk, the export the fused experts of the module; the rest is named alike)
    common = [k for k in want if k in start]
    assert len(common) >= len(want) // 2 and any(not torch.equal(start[k], want[k]) for k in common)
    for k in want:
        assert torch.equal(got[k].to(want[k].dtype), want[k]), k


@pytest.mark.extended  # ~15 s each: their TP2 + SP steps equal the 1-rank step in `make test` (test_megatron_layouts)
@pytest.mark.parametrize("family", ["deepseek_v3", "minimax_m2", "deepseek_v32"])
def test_megatron_tp2_sp_loop_gives_the_engines_log_probs(family, tiny_hf_checkpoint, tmp_path):
    """DeepSeek-V3 (MLA: heads split, latent down projections duplicated), MiniMax-M2 (whole-projection q/k
    norms over TP) and DeepSeek-V3.2 (MLA + DSA: the frozen indexer whole on each rank; the engine caches its
    keys) through the loop on megatron at TP2 + SP on 2 ranks: 2 GRPO rollouts with --ci-test and R3,
    weights to the engine by disk-delta: the trainer's log-probs are the engine's, step-0 ppo_kl 0, no route
    flips (the tests' sharp models: routers and biases drawn so routing depends on them)."""
    import sys
    from pathlib import Path

    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "models"))
    if family == "deepseek_v3":
        from test_deepseek_v3_bridge import deepseek_config as make_config
        from test_deepseek_v3_bridge import sharp_model
    elif family == "deepseek_v32":
        from test_deepseek_v32_bridge import sharp_v32 as sharp_model
        from test_deepseek_v32_bridge import v32_config as make_config
    else:
        from test_minimax_m2_bridge import minimax_config as make_config
        from test_minimax_m2_bridge import sharp_model
    tok = load_tokenizer(tiny_hf_checkpoint)
    ckpt = str(tmp_path / "hf")
    save_hf_checkpoint(sharp_model(make_config(len(tok))), tok, ckpt)
    cfg = small_run_config(ckpt, tmp_path, ci_test=True, num_rollout=2, train_backend="megatron",
                           tensor_model_parallel_size=2, sequence_parallel=True, actor_num_gpus_per_node=2,
                           use_rollout_routing_replay=True, micro_batch_size=4,
                           update_weight_transfer_mode="disk-delta", update_weight_disk_dir=str(tmp_path / "pub"))  # fmt: skip
    res = train(cfg)
    assert res.final_version == 2
    assert res.ci_checks["step0_ppo_kl"] < 1e-9
    assert res.ci_checks["train_rollout_logprob_abs_diff"] < 1e-5  # fp32 on CPU: ~2e-7
    assert all(m["train/moe_route_flips"] == 0 for m in res.metrics)
