"""LoRA on the megatron backend (training/megatron_lora.py) against the fsdp backend's PEFT LoRA, fp32:
the same adapter in both, one GRPO step on the same batch gives the same loss, adapter gradients and
updated adapter (1e-5), and the megatron export is PEFT's files key for key. A dense model (GQA with 2
query groups, untied: attention, MLP and lm_head adapters), the tiny Qwen3-MoE (attention and packed
expert adapters), DeepSeek-V3 (multi-latent attention with and without the q latent, its rope rows in
megatron's order; the dense MLP, the shared expert, the routed experts), DeepSeek-V3.2 and GLM-4.5 on both
backends, the dense model and MLA at TP2 + SP too; the embedded engine serving the megatron export gives
the trainer's log-probs (the --ci-test check). Refused before anything starts: megatron model
parallelism, router / expert targets.

The trainers run once in a subprocess (this file as a script: megatron's gloo group, world size 1)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
TOL = 1e-5


def _cfg(hf, backend, targets, **kw):
    from miles_platform.config import RunConfig

    base = dict(hf_checkpoint=hf, rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4, lr=0.5,
                optimizer="sgd", micro_batch_size=2, lora_rank=4, lora_alpha=8, target_modules=targets,
                train_backend=backend, num_rollout=2)  # fmt: skip
    base.update(kw)
    return RunConfig(**base).validate()


def _step_pair(hf: str, targets: str, save: Path | None = None, **kw) -> tuple[dict, object]:
    """fsdp vs megatron LoRA: one step from the same random adapter. Returns (numbers, megatron actor);
    `save`: the start adapter and the fsdp step's merged weights and metrics go there (the TP reference)."""
    from safetensors.torch import save_file

    from miles_platform.training.actor import TrainerActor

    actors = {b: TrainerActor(_cfg(hf, b, targets, **kw)) for b in ("fsdp", "megatron")}
    (f_state, f_conf), (m_state, m_conf) = (actors[b].get_lora_adapter() for b in ("fsdp", "megatron"))
    g = torch.Generator().manual_seed(3)
    start = {k: 0.5 * torch.randn(v.shape, generator=g) for k, v in sorted(f_state.items())}
    for a in actors.values():
        a.backend.load_adapter(start)
    metrics = {b: a.train(0, _batch()) for b, a in actors.items()}
    grads = {
        b: {n: p.grad for n, p in a.backend.named_parameters() if p.requires_grad} for b, a in actors.items()
    }
    after = {b: a.get_lora_adapter()[0] for b, a in actors.items()}
    merged = {b: a.get_hf_weights() for b, a in actors.items()}
    drop = lambda c: {k: v for k, v in c.items() if k != "base_model_name_or_path"}  # noqa: E731
    out = dict(
        same_keys=sorted(f_state) == sorted(m_state) and sorted(grads["fsdp"]) == sorted(grads["megatron"]),
        same_config=drop(f_conf) == drop(m_conf),
        fresh_b_zero=all(not t.any() for k, t in m_state.items() if ".lora_B." in k),
        adapters=len(f_state) // 2,
        loss_abs_diff=abs(metrics["fsdp"]["train/loss"] - metrics["megatron"]["train/loss"]),
        moe_losses={k: [metrics[b].get(k) for b in ("fsdp", "megatron")] for k in ("train/moe_aux_loss", "train/moe_z_loss")},
        grad_norm=[metrics[b]["train/grad_norm"] for b in ("fsdp", "megatron")],
        grad_max_abs_diff=max((grads["fsdp"][n] - grads["megatron"][n]).abs().max().item() for n in grads["fsdp"]),
        grad_min_norm=min(g.norm().item() for g in grads["fsdp"].values()),
        update_max_abs_diff=max((after["fsdp"][k] - after["megatron"][k]).abs().max().item() for k in start),
        moved=min((after["megatron"][k] - start[k]).abs().max().item() for k in start),
        merged_max_abs_diff=max((merged["fsdp"][k] - merged["megatron"][k]).abs().max().item() for k in merged["fsdp"]),
        merged_same_names=sorted(merged["fsdp"]) == sorted(merged["megatron"]),
    )  # fmt: skip
    if save is not None:
        save.mkdir(parents=True)
        save_file(start, str(save / "start.safetensors"))
        save_file({k: v.contiguous() for k, v in merged["fsdp"].items()}, str(save / "merged.safetensors"))
        (save / "metrics.json").write_text(json.dumps(metrics["fsdp"]))
    return out, actors["megatron"]


def _batch():
    from loop_helpers import random_train_batch

    return random_train_batch(0, rewards=[1.0, 0.0, 0.0, 1.0])


def _engine_vs_trainer(hf: str, actor, work: Path) -> dict:
    """The megatron adapter, written as its checkpoint's PEFT dir, loaded by the embedded engine: the
    engine's log-probs of what it generates equal the trainer's log-probs of the same tokens."""
    from miles_platform.rollout.client import post
    from miles_platform.rollout.engine_server import start_engine_server

    ckpt = work / "iter_0000000"
    ckpt.mkdir(parents=True)
    actor.backend.save_model(str(ckpt))
    server = start_engine_server(hf, num_threads=1)
    try:
        post(server.url, "/load_lora_adapter", {"lora_name": "m", "lora_path": str(ckpt / "adapter")})
        prompt = [5, 9, 17, 33, 41]
        body = {"input_ids": [prompt], "return_logprob": True, "lora_path": ["m"],
                "sampling_params": [{"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}]}  # fmt: skip
        out = post(server.url, "/generate", body)[0]
        base = post(server.url, "/generate", {**body, "lora_path": [None]})[0]
        # one batch, a row with the adapter and one without: each row as served alone
        both = post(server.url, "/generate", {**body, "input_ids": [prompt] * 2, "lora_path": ["m", None],
                                               "sampling_params": body["sampling_params"] * 2})  # fmt: skip
    finally:
        server.stop()
    ids = out["output_ids"]
    engine_lp = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
    seq = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = actor.backend.logits(seq, torch.arange(seq.shape[1])[None])[0, len(prompt) - 1 : -1]
    trainer_lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    # the merged HF export (--save-hf, evals) of the adapter: an ordinary checkpoint with the same logits
    from miles_platform.models.checkpoint import load_hf_model
    from miles_platform.training.lora import export_merged_hf_dir

    merged = load_hf_model(export_merged_hf_dir(hf, str(ckpt / "adapter"), str(work / "merged")))
    with torch.no_grad():
        merged_diff = (merged(input_ids=seq).logits[0, len(prompt) - 1 : -1] - logits).abs().max().item()
    # the resumed adapter is the saved one
    before = actor.get_lora_adapter()[0]
    actor.backend.load_model(str(ckpt))
    return dict(
        logprob_max_abs_diff=(engine_lp - trainer_lp).abs().max().item(),
        merged_logits_max_abs_diff=merged_diff,
        adapter_changes_policy=ids != base["output_ids"],
        mixed_batch_rows_as_alone=[r["output_ids"] for r in both] == [ids, base["output_ids"]]
        and max(
            abs(x[0] - y[0])
            for r, o in zip(both, (out, base), strict=True)
            for x, y in zip(
                r["meta_info"]["output_token_logprobs"], o["meta_info"]["output_token_logprobs"], strict=True
            )
        )
        < 1e-5,
        saved=sorted(os.listdir(ckpt / "adapter")),
        resume_identical=all(torch.equal(before[k], v) for k, v in actor.get_lora_adapter()[0].items()),
    )


def _main(paths: str, work: str) -> None:
    torch.set_num_threads(1)
    paths = json.loads(paths)
    dense, moe, mla, mla_q = (paths[k] for k in ("dense", "moe", "mla", "mla_q"))
    report = {}
    report["dense"], actor = _step_pair(dense, "attn,mlp,lm_head", Path(work, "tp1"))
    report["engine"] = _engine_vs_trainer(dense, actor, Path(work))
    # the router's load-balancing and z-loss terms reach the attention adapters through the hidden states
    report["moe"], moe_actor = _step_pair(moe, "attn,mlp", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    # the EP2 reference: without the aux / z losses, which megatron takes over each data-parallel rank's
    # own tokens (EP2 on 2 ranks is DP2: not one rank's whole-batch value)
    _step_pair(moe, "attn,mlp", Path(work, "moe_tp1"))
    report["moe_engine"] = _engine_vs_trainer(moe, moe_actor, Path(work, "moe"))
    # DeepSeek-V3 (MLA with a q latent, rope rows in halves: the bridge permutes them), the default
    # targets: MLA's five projections, the dense MLP, the shared expert and the packed routed experts
    report["mla"], mla_actor = _step_pair(mla, None)
    report["mla_engine"] = _engine_vs_trainer(mla, mla_actor, Path(work, "mla"))
    # no q latent: one q_proj, its rope rows permuted; the dense MLP and the shared expert, not the
    # routed experts (built at TP 1): the reference of the TP2 + SP step
    report["mla_q"], _ = _step_pair(mla_q, "attn,mlp", Path(work, "mla_q_tp1"), exclude_modules="experts")
    # DeepSeek-V3.2 (MLA in DSA's attention, the indexer frozen and never a target) and GLM-4.5 (GQA with
    # q/k/v biases, DeepSeek's MoE): the default targets
    report["v32"], _ = _step_pair(paths["v32"], None)
    report["glm4_5"], _ = _step_pair(paths["glm4_5"], None)
    # Qwen3.5 (q_proj's [query; gate] rows per head; the gated-DeltaNet layers take none), Qwen3.5-MoE and
    # Qwen3-Next (their gated shared expert, routed experts), MiniMax-M2 (whole-projection q/k norms, routed experts) and
    # GPT-OSS (biased projections, sinks; its biased experts' gate / up columns interleaved, the gate clamped)
    for name in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "minimax_m2"):
        report[name], _ = _step_pair(paths[name], None)
    report["gpt_oss"], gpt_oss_actor = _step_pair(paths["gpt_oss"], None)
    report["gpt_oss_engine"] = _engine_vs_trainer(paths["gpt_oss"], gpt_oss_actor, Path(work, "gpt_oss"))
    print(json.dumps(report))


@pytest.fixture(scope="module")
def report(tiny_hf_checkpoint, tmp_path_factory):
    from loop_helpers import warm_python
    from test_moe_megatron import save_moe_checkpoint

    from miles_platform.models.tiny import save_untied_checkpoint

    work = tmp_path_factory.mktemp("lora_megatron")
    dense = save_untied_checkpoint(tiny_hf_checkpoint, work / "dense")
    moe = save_moe_checkpoint(tiny_hf_checkpoint, work / "moe")
    paths = {"dense": dense, "moe": moe, **{n: _family_checkpoint(tiny_hf_checkpoint, work / n, **kw)
                                            for n, kw in FAMILIES.items()}}  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    proc = subprocess.run([*warm_python(), __file__, json.dumps(paths), str(work / "out")],
                          capture_output=True, text=True, env=env, timeout=300, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "paths": {**paths, "work": str(work)}}


# the tiny DeepSeek-V3 (layer 0 dense, layer 1 MoE with a shared expert), rope rows in halves; with one
# q_proj; the tiny DeepSeek-V3.2 and GLM-4.5 (q/k/v biases, as GLM-4.5 publishes); families.py's others
FAMILIES = {"mla": dict(rope_interleave=False), "mla_q": dict(rope_interleave=False, q_lora_rank=None),
            "v32": dict(family="deepseek_v32"), "glm4_5": dict(family="glm4_moe", attention_bias=True),
            **{f: dict(family=f) for f in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "minimax_m2", "gpt_oss")}}  # fmt: skip


FULL = 1  # the tiny Qwen3.5's full-attention layers (families.py: a linear-attention layer, then a full one)


def _family_checkpoint(tok_dir: str, path: Path, **overrides) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from test_deepseek_v3_bridge import deepseek_config, sharp_model

    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint

    tok = load_tokenizer(tok_dir)
    save_hf_checkpoint(sharp_model(deepseek_config(len(tok), **overrides)), tok, str(path))
    return str(path)


@pytest.mark.parametrize(
    "model",
    [
        "dense",
        "moe",
        "mla",
        "mla_q",
        "v32",
        "glm4_5",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
        "minimax_m2",
        "gpt_oss",
    ],
)
def test_a_megatron_lora_step_equals_the_fsdp_lora_step(report, model):
    r = report[model]
    assert r["same_keys"] and r["same_config"] and r["fresh_b_zero"], r
    # every projection of every layer (MoE: q/k/v/o and the packed gate_up / down experts of each layer;
    # MLA: q_a / q_b / kv_a / kv_b / o of both layers, layer 0's MLP, layer 1's shared expert and experts;
    # without the q latent: q / kv_a / kv_b / o, layer 0's MLP and layer 1's shared expert)
    counts = {"dense": 2 * 7 + 1, "moe": 2 * 6, "mla": 2 * 5 + 3 + 3 + 2, "mla_q": 2 * 4 + 3 + 3,
              "v32": 2 * 5 + 3 + 3 + 2, "glm4_5": 2 * 4 + 3 + 3 + 2, "minimax_m2": 2 * 4 + 2 * 2, "gpt_oss": 2 * (4 + 2),
              "qwen3_5": FULL * 4 + 2 * 3, "qwen3_5_moe": FULL * 4 + 2 * (3 + 2), "qwen3_next": FULL * 4 + 2 * (3 + 2)}  # fmt: skip
    assert r["adapters"] == counts[model], r
    # GPT-OSS: its base computes 2e-6 off HF's already (logits; test_gpt_oss_bridge.py) and its sharp experts
    # give gradients ~10x the others' (norm 6.3): measured 6.8e-6 max, the norm 1.6e-5 relative, the merged
    # weights 1.2e-5 apart (2026-12-06); its gate / up columns in HF's interleaved order on megatron: 0.17
    tol = 5 * TOL if model == "gpt_oss" else TOL
    assert r["loss_abs_diff"] < tol and r["grad_max_abs_diff"] < tol, r
    assert r["grad_norm"][0] == pytest.approx(r["grad_norm"][1], rel=tol) and r["grad_min_norm"] > 1e-4, r
    assert r["update_max_abs_diff"] < tol and r["moved"] > 1e-4, r  # the step moved every adapter tensor
    assert r["merged_same_names"] and r["merged_max_abs_diff"] < tol, r
    if model == "moe":  # --moe-aux-loss-coeff / --moe-z-loss-coeff under LoRA: the same terms on both
        for f, m in r["moe_losses"].values():
            assert f > 0 and m == pytest.approx(f, rel=TOL), r["moe_losses"]


@pytest.mark.parametrize("model", ["engine", "moe_engine", "mla_engine", "gpt_oss_engine"])
def test_the_engine_serving_the_megatron_adapter_gives_the_trainers_log_probs(report, model):
    e = report[model]
    assert e["saved"] == ["adapter_config.json", "adapter_model.safetensors", "base_checkpoint.json"], e
    assert e["logprob_max_abs_diff"] < 1e-4 and e["adapter_changes_policy"], e
    assert e["mixed_batch_rows_as_alone"], e
    assert e["merged_logits_max_abs_diff"] < 1e-4, e  # per-row adapters (experts: each token its row's)
    assert e["resume_identical"], e


LAYOUTS = {  # on 2 ranks: (model, its 1-rank reference, flags)
    "tp2": ("dense", "tp1", dict(tensor_model_parallel_size=2)),
    "tp2_sp": ("dense", "tp1", dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "dp2": ("dense", "tp1", dict()),  # the adapter's gradients averaged over the data-parallel pair
    "cp2": ("dense", "tp1", dict(context_parallel_size=2)),  # each rank its zigzag tokens, the parts added
    "pp2": ("dense", "tp1", dict(pipeline_model_parallel_size=2)),  # each stage its layers' factors
    # MLA's duplicated kv_a (each rank its tokens: the factors' gradients summed over TP), the column-
    # parallel q / kv_b (whole heads, rope rows permuted), row-parallel o_proj, the dense MLP and the
    # shared expert
    "mla_tp2_sp": ("mla_q", "mla_q_tp1", dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    # each rank hooks its 2 of the 4 experts and holds every expert's factors
    "moe_ep2": ("moe", "moe_tp1", dict(expert_model_parallel_size=2)),
}
TARGETS = {"dense": dict(target_modules="attn,mlp,lm_head"),
           "mla_q": dict(target_modules="attn,mlp", exclude_modules="experts"),
           "moe": dict(target_modules="attn,mlp")}  # fmt: skip


def _tp_worker(rank: int, world: int, ports: list[int], paths: dict, out: str) -> None:
    """Each layout in turn on these 2 ranks: the 1-rank step from its start adapter."""
    import traceback

    from safetensors.torch import load_file, save_file

    from miles_platform.training import megatron_shims
    from miles_platform.training.actor import TrainerActor

    torch.set_num_threads(1)
    try:
        for (name, (model, ref, layout)), port in zip(LAYOUTS.items(), ports, strict=True):
            t = TARGETS[model]
            cfg = _cfg(paths[model], "megatron", t["target_modules"], actor_num_gpus_per_node=world,
                       **{k: v for k, v in t.items() if k != "target_modules"}, **layout)  # fmt: skip
            actor = TrainerActor(cfg, rank, world, f"tcp://127.0.0.1:{port}")
            fresh = actor.get_lora_adapter()[0]  # every rank's fresh factors: rank 0's draw
            Path(f"{out}/{name}.rank{rank}.fresh").write_text(
                json.dumps({k: v.double().sum().item() for k, v in fresh.items()})
            )
            actor.backend.load_adapter(load_file(f"{paths['work']}/out/{ref}/start.safetensors"))
            metrics = actor.train(0, _batch())
            merged = actor.get_hf_weights()  # collective; the first rank of the replica keeps it
            if rank == 0:
                save_file({k: v.contiguous() for k, v in merged.items()}, f"{out}/{name}.safetensors")
            Path(f"{out}/{name}.rank{rank}.json").write_text(json.dumps(metrics))
            megatron_shims.destroy_process_group()
    except Exception:
        Path(f"{out}/rank{rank}.error").write_text(traceback.format_exc())


def test_a_tensor_data_and_expert_parallel_lora_step_equals_the_one_rank_step(report, tmp_path):
    """TP2, TP2 + SP, DP2, CP2 and PP2 on 2 gloo ranks, from the dense step's start adapter, DeepSeek-V3's MLA at
    TP2 + SP and the Qwen3-MoE's expert adapters at EP2: the loss, its parts, the grad norm and the merged
    weights (base + updated adapter) of the 1-rank step within 1e-5; a fresh adapter is the same on both
    ranks."""
    from loop_helpers import run_ranks
    from safetensors.torch import load_file

    from miles_platform.cluster.ports import free_port

    out = tmp_path / "tp"
    ports = [free_port() for _ in LAYOUTS]
    run_ranks(_tp_worker, (2, ports, report["paths"], str(out)), 2, out)
    for name, (_, ref_name, _) in LAYOUTS.items():
        ref = Path(report["paths"]["work"], "out", ref_name)
        one, w1 = json.loads((ref / "metrics.json").read_text()), load_file(str(ref / "merged.safetensors"))
        assert (out / f"{name}.rank0.fresh").read_text() == (out / f"{name}.rank1.fresh").read_text(), name
        for rank in (0, 1):
            m = json.loads((out / f"{name}.rank{rank}.json").read_text())
            for key in ("train/loss", "train/pg_loss"):
                assert abs(m[key] - one[key]) <= TOL, (name, key, m[key], one[key])
            assert m["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=TOL), name
        w2 = load_file(str(out / f"{name}.safetensors"))
        assert sorted(w1) == sorted(w2) and max((w1[k] - w2[k]).abs().max().item() for k in w1) <= TOL, name
    assert one["train/grad_norm"] > 1e-3


def test_refused_before_start_by_name(report, tiny_hf_checkpoint, tmp_path):
    from loop_helpers import small_run_config

    from miles_platform.config import ConfigError
    from miles_platform.preflight import validate_before_start
    from miles_platform.training.lora import hf_meta_model, resolve_target_modules

    with pytest.raises(ConfigError, match="--num-layers-per-virtual-pipeline-stage 1: LoRA on the megatron"):
        _cfg(tiny_hf_checkpoint, "megatron", None, pipeline_model_parallel_size=2, actor_num_gpus_per_node=2,
             num_layers_per_virtual_pipeline_stage=1)  # fmt: skip
    with pytest.raises(ConfigError, match="--moe-router-freeze-gate with --lora-rank: no effect"):
        _cfg(tiny_hf_checkpoint, "fsdp", None, moe_router_freeze_gate=True)
    moe_dir = report["paths"]["moe"]
    moe = hf_meta_model(json.loads(Path(moe_dir, "config.json").read_text()))
    # Miles' groups: `mlp` (and the default) takes the packed routed experts; routers never
    experts = [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj")]
    assert resolve_target_modules(moe, None, None) == resolve_target_modules(moe, "attn,mlp", None)
    assert resolve_target_modules(moe, "mlp", None) == experts == resolve_target_modules(moe, "experts", None)
    assert resolve_target_modules(moe, "gate_up_proj", None) == experts[1::2]
    assert len(resolve_target_modules(moe, "attn", None)) == 8
    with pytest.raises(ConfigError, match="an MoE router"):
        resolve_target_modules(moe, "gate", None)
    for backend, kw, match in (("fsdp", dict(lora_dropout=0.1), "--lora-dropout 0.1 with routed-expert targets"),
                               ("megatron", dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                                 actor_num_gpus_per_node=2), "built at tensor parallel 1")):  # fmt: skip
        with pytest.raises(ConfigError, match=match):  # preflight, before Ray
            validate_before_start(
                small_run_config(moe_dir, tmp_path, train_backend=backend, lora_rank=4, **kw)
            )
    validate_before_start(small_run_config(moe_dir, tmp_path, train_backend="megatron", lora_rank=4,
                                           tensor_model_parallel_size=2, sequence_parallel=True,
                                           actor_num_gpus_per_node=2, target_modules="attn"))  # fmt: skip


if __name__ == "__main__":
    _main(*sys.argv[1:])
