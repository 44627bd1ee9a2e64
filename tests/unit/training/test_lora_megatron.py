"""LoRA on the megatron backend (training/megatron_lora.py) against the fsdp backend's PEFT LoRA, fp32:
the same adapter in both, one GRPO step on the same batch gives the same loss, adapter gradients and
updated adapter (1e-5), and the megatron export is PEFT's files key for key. A dense model (GQA with 2
query groups, untied: attention, MLP and lm_head adapters) and the tiny Qwen3-MoE (attention adapters)
on both backends; the embedded engine serving the megatron export gives the trainer's log-probs (the
--ci-test check). Refused before anything starts: megatron model parallelism, router / expert targets.

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


def _step_pair(hf: str, targets: str) -> tuple[dict, object]:
    """fsdp vs megatron LoRA: one step from the same random adapter. Returns (numbers, megatron actor)."""
    from loop_helpers import random_train_batch

    from miles_platform.training.actor import TrainerActor

    actors = {b: TrainerActor(_cfg(hf, b, targets)) for b in ("fsdp", "megatron")}
    (f_state, f_conf), (m_state, m_conf) = (actors[b].get_lora_adapter() for b in ("fsdp", "megatron"))
    g = torch.Generator().manual_seed(3)
    start = {k: 0.5 * torch.randn(v.shape, generator=g) for k, v in sorted(f_state.items())}
    for a in actors.values():
        a.backend.load_adapter(start)
    batch = random_train_batch(0, rewards=[1.0, 0.0, 0.0, 1.0])
    metrics = {b: a.train(0, batch) for b, a in actors.items()}
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
        grad_norm=[metrics[b]["train/grad_norm"] for b in ("fsdp", "megatron")],
        grad_max_abs_diff=max((grads["fsdp"][n] - grads["megatron"][n]).abs().max().item() for n in grads["fsdp"]),
        grad_min_norm=min(g.norm().item() for g in grads["fsdp"].values()),
        update_max_abs_diff=max((after["fsdp"][k] - after["megatron"][k]).abs().max().item() for k in start),
        moved=min((after["megatron"][k] - start[k]).abs().max().item() for k in start),
        merged_max_abs_diff=max((merged["fsdp"][k] - merged["megatron"][k]).abs().max().item() for k in merged["fsdp"]),
        merged_same_names=sorted(merged["fsdp"]) == sorted(merged["megatron"]),
    )  # fmt: skip
    return out, actors["megatron"]


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
    finally:
        server.stop()
    ids = out["output_ids"]
    engine_lp = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
    seq = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = actor.backend.logits(seq, torch.arange(seq.shape[1])[None])[0, len(prompt) - 1 : -1]
    trainer_lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    # the resumed adapter is the saved one
    before = actor.get_lora_adapter()[0]
    actor.backend.load_model(str(ckpt))
    return dict(
        logprob_max_abs_diff=(engine_lp - trainer_lp).abs().max().item(),
        adapter_changes_policy=ids != base["output_ids"],
        saved=sorted(os.listdir(ckpt / "adapter")),
        resume_identical=all(torch.equal(before[k], v) for k, v in actor.get_lora_adapter()[0].items()),
    )


def _main(dense: str, moe: str, work: str) -> None:
    torch.set_num_threads(1)
    report = {}
    report["dense"], actor = _step_pair(dense, "attn,mlp,lm_head")
    report["engine"] = _engine_vs_trainer(dense, actor, Path(work))
    report["moe"], _ = _step_pair(moe, "attn")
    print(json.dumps(report))


@pytest.fixture(scope="module")
def report(tiny_hf_checkpoint, tmp_path_factory):
    from loop_helpers import warm_python
    from test_moe_megatron import save_moe_checkpoint

    from miles_platform.models.tiny import save_untied_checkpoint

    work = tmp_path_factory.mktemp("lora_megatron")
    dense = save_untied_checkpoint(tiny_hf_checkpoint, work / "dense")
    moe = save_moe_checkpoint(tiny_hf_checkpoint, work / "moe")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    proc = subprocess.run([*warm_python(), __file__, dense, moe, str(work / "out")], capture_output=True,
                          text=True, env=env, timeout=300, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_a_megatron_lora_step_equals_the_fsdp_lora_step(report, model):
    r = report[model]
    assert r["same_keys"] and r["same_config"] and r["fresh_b_zero"], r
    assert r["adapters"] == (2 * 7 + 1 if model == "dense" else 2 * 4), r  # every projection, every layer
    assert r["loss_abs_diff"] < TOL and r["grad_max_abs_diff"] < TOL, r
    assert r["grad_norm"][0] == pytest.approx(r["grad_norm"][1], rel=TOL) and r["grad_min_norm"] > 1e-4, r
    assert r["update_max_abs_diff"] < TOL and r["moved"] > 1e-4, r  # the step moved every adapter tensor
    assert r["merged_same_names"] and r["merged_max_abs_diff"] < TOL, r


def test_the_engine_serving_the_megatron_adapter_gives_the_trainers_log_probs(report):
    e = report["engine"]
    assert e["saved"] == ["adapter_config.json", "adapter_model.safetensors", "base_checkpoint.json"], e
    assert e["logprob_max_abs_diff"] < 1e-4 and e["adapter_changes_policy"], e
    assert e["resume_identical"], e


def _random_adapter_dir(hf: str, out: Path, targets: str) -> str:
    """A PEFT adapter dir with random A and B over `targets`, as a LoRA checkpoint writes it."""
    from peft import LoraConfig, get_peft_model

    from miles_platform.models.checkpoint import content_hash, load_hf_model
    from miles_platform.training import lora

    model = load_hf_model(hf)
    names = lora.resolve_target_modules(model, targets, None)
    torch.manual_seed(11)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=names, init_lora_weights=False))
    state = {lora.adapter_key(n): p.detach() for n, p in peft.named_parameters() if lora.is_adapter_param(n)}
    return lora.write_adapter_dir(str(out), state, lora.adapter_config_dict(peft), hf, content_hash(hf))


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp"])
def test_a_tensor_parallel_lora_step_equals_the_one_rank_step(layout, tiny_hf_checkpoint, tmp_path):
    """TP2 (and TP2 + SP) on 2 gloo ranks: the step from the same random adapter (--lora-adapter-path)
    gives the 1-rank step's loss, grad norm and merged weights (base + updated adapter) within 1e-5."""
    from test_megatron_layouts import train_one_step

    from miles_platform.models.tiny import save_layout_checkpoint

    hf = save_layout_checkpoint(tiny_hf_checkpoint, tmp_path / "l4")
    targets = "attn,mlp,lm_head"
    lora = dict(lora_rank=4, lora_alpha=8, target_modules=targets, use_kl_loss=False, kl_loss_coef=0.0,
                lora_adapter_path=_random_adapter_dir(hf, tmp_path / "adapter", targets))  # fmt: skip
    split = dict(tensor_model_parallel_size=2, sequence_parallel=layout == "tp2_sp")
    (one,), w1, _ = train_one_step(hf, tmp_path / "tp1", 1, **lora)
    metrics, w2, _ = train_one_step(hf, tmp_path / layout, 2, **lora, **split)
    for m in metrics:
        for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm"):
            assert abs(m[key] - one[key]) <= TOL, (key, m[key], one[key])
    assert one["train/grad_norm"] > 1e-3 and sorted(w1) == sorted(w2)
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) <= TOL


def test_refused_before_start_by_name(tiny_hf_checkpoint, tmp_path):
    from loop_helpers import small_run_config
    from test_moe_megatron import save_moe_checkpoint

    from miles_platform.config import ConfigError
    from miles_platform.preflight import validate_before_start
    from miles_platform.training.lora import hf_meta_model, resolve_target_modules

    with pytest.raises(ConfigError, match="--context-parallel-size 2: LoRA on the megatron backend"):
        _cfg(tiny_hf_checkpoint, "megatron", None, context_parallel_size=2, actor_num_gpus_per_node=2)
    with pytest.raises(ConfigError, match="--moe-router-freeze-gate with --lora-rank: no effect"):
        _cfg(tiny_hf_checkpoint, "fsdp", None, moe_router_freeze_gate=True)
    moe_dir = save_moe_checkpoint(tiny_hf_checkpoint, tmp_path / "m")
    with pytest.raises(
        ConfigError, match="all-linear .the default.: on an MoE model"
    ):  # preflight, before Ray
        validate_before_start(small_run_config(moe_dir, tmp_path, train_backend="megatron", lora_rank=4))
    validate_before_start(small_run_config(moe_dir, tmp_path, train_backend="megatron", lora_rank=4,
                                           target_modules="attn"))  # fmt: skip
    moe = hf_meta_model(json.loads(Path(moe_dir, "config.json").read_text()))
    for targets, match in ((None, "all-linear .the default.: on an MoE model"), ("attn,mlp", "--target-modules mlp: on an MoE"),
                           ("gate", "an MoE router"), ("experts", "routed MoE experts"),
                           ("gate_up_proj", "routed MoE experts")):  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            resolve_target_modules(moe, targets, None)
    assert len(resolve_target_modules(moe, "attn", None)) == 8


if __name__ == "__main__":
    _main(*sys.argv[1:])
