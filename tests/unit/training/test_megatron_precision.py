"""Megatron's precision and memory flags on CPU: --bf16 (bf16 weights and forward, fp32 main parameters,
--accumulate-allreduce-grads-in-fp32, --attention-softmax-in-fp32) at TP1 and TP2, whose step-0
--ci-test checks hold against an engine's bf16 log-probs (transformers' model in bf16); activation
recompute (--recompute-granularity full | selective) giving the step without it; the flags
megatron-core cannot run here refused by name with the measured reason.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch
from loop_helpers import UNTRAINED_ENTROPY_MAX, random_train_batch, run_ranks
from safetensors.torch import load_file, save_file

from miles_platform.cluster.ports import free_port

BF16 = dict(bf16=True, accumulate_allreduce_grads_in_fp32=True, attention_softmax_in_fp32=True)


def _cfg(ckpt: str, **kw):
    from miles_platform.config import RunConfig

    base = dict(hf_checkpoint=ckpt, train_backend="megatron", rollout_batch_size=2, n_samples_per_prompt=2,
                global_batch_size=4, micro_batch_size=1, lr=1e-3, num_rollout=1)  # fmt: skip
    return RunConfig(**{**base, **kw}).validate()


def engine_batch(ckpt: str, dtype: torch.dtype):
    """The trainer tests' batch with rollout log-probs from the embedded engine's model in `dtype`
    (transformers' model as the engine loads it): what an engine serving the checkpoint reports."""
    from miles_platform.rollout.engine_weights import load_model

    batch = random_train_batch(0)
    model, _ = load_model(ckpt, dtype)
    for i, toks in enumerate(batch.tokens):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([toks])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(toks[1:])[:, None]).squeeze(-1)
        batch.rollout_log_probs[i] = lp[-batch.response_lengths[i] :].tolist()
    return batch


def _worker(rank: int, world: int, port: int, ckpt: str, out: str, overrides: dict) -> None:
    torch.set_num_threads(1)
    from miles_platform.training import megatron_shims
    from miles_platform.training.actor import TrainerActor

    path = Path(out, f"rank{rank}")
    try:
        cfg = _cfg(ckpt, **{"actor_num_gpus_per_node": world, **overrides})
        actor = TrainerActor(cfg, rank, world, f"tcp://127.0.0.1:{port}")
        batch = engine_batch(ckpt, torch.bfloat16) if cfg.bf16 else random_train_batch(0)
        metrics = actor.train(0, batch)
        dtypes = sorted({str(p.dtype) for p in actor.backend.module.parameters()})
        main = sorted({str(p.dtype) for p in actor.backend.parameters()})
        weights = actor.get_hf_weights()
        if weights:
            save_file(weights, f"{path}.safetensors")
        Path(f"{path}.json").write_text(json.dumps({"metrics": metrics, "model": dtypes, "main": main,
                                                   "forward": cfg.train_forward_dtype}))  # fmt: skip
    except Exception:
        Path(f"{path}.error").write_text(traceback.format_exc())
    finally:
        megatron_shims.destroy_process_group()


def train_one_step(ckpt: str, out: Path, world: int, **overrides):
    run_ranks(_worker, (world, free_port(), ckpt, str(out), overrides), world, out)
    return json.loads((out / "rank0.json").read_text()), load_file(out / "rank0.safetensors")


@pytest.fixture(scope="module")
def layout_checkpoint(tiny_hf_checkpoint, tmp_path_factory):
    from miles_platform.models.tiny import save_layout_checkpoint

    return save_layout_checkpoint(tiny_hf_checkpoint, tmp_path_factory.mktemp("precision") / "l4")


@pytest.mark.parametrize("tp", [1, 2])
def test_bf16_with_fp32_main_params_passes_the_step0_ci_checks(layout_checkpoint, tmp_path, tp):
    from miles_platform.training.ci_checks import rollout_checks

    flags = dict(
        BF16,
        ci_test=True,
        ci_entropy_max=UNTRAINED_ENTROPY_MAX,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        actor_num_gpus_per_node=tp,
    )
    info, weights = train_one_step(layout_checkpoint, tmp_path / "out", tp, **flags)
    assert info["model"] == ["torch.bfloat16"] and info["main"] == ["torch.float32"]
    assert info["forward"] == "bf16"  # --bf16 sets the forward (and the engines') dtype
    assert {str(v.dtype) for v in weights.values()} == {"torch.bfloat16"}  # what bf16 engines load
    m = info["metrics"]
    assert m["train/grad_norm"] > 0.1  # the fp32 main copies' gradients, over the TP ranks too
    checks = rollout_checks(_cfg(layout_checkpoint, **flags), 0, m, print)  # raises CITestFailure on a miss
    assert checks["train_rollout_logprob_abs_diff"] > 0  # megatron's bf16 forward is not the engine's
    init = load_file(Path(layout_checkpoint) / "model.safetensors")
    assert any(not torch.equal(init[k].bfloat16(), weights[k]) for k in init)  # the step moved weights


def test_qwen3_5_under_bf16_keeps_a_log_fp32_in_the_trainer_and_the_engine(tiny_hf_checkpoint, tmp_path):
    """Qwen3.5's log decay rates (models/gdn.py): fp32 in the megatron trainer under --bf16 (model, main
    copy and export) and in the engine serving bf16, as Miles and SGLang hold them; every other weight bf16.
    The step-0 --ci-test checks hold against that engine's log-probs."""
    import sys

    from miles_platform.rollout.engine_weights import load_model
    from miles_platform.training.ci_checks import rollout_checks

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_megatron_layouts import bridge_checkpoint

    ckpt = bridge_checkpoint("qwen3_5", tiny_hf_checkpoint, tmp_path / "hf")
    flags = dict(BF16, ci_test=True, ci_entropy_max=UNTRAINED_ENTROPY_MAX)
    info, weights = train_one_step(ckpt, tmp_path / "out", 1, **flags)
    assert info["model"] == ["torch.bfloat16", "torch.float32"] and info["main"] == ["torch.float32"]
    a_log = sorted(k for k in weights if k.endswith(".A_log"))
    assert a_log and {str(weights[k].dtype) for k in a_log} == {"torch.float32"}
    assert {str(v.dtype) for k, v in weights.items() if k not in a_log} == {"torch.bfloat16"}
    served, _ = load_model(ckpt, torch.bfloat16)
    dtypes = {n: str(p.dtype) for n, p in served.named_parameters()}
    assert {dtypes[k] for k in a_log} == {"torch.float32"}
    assert {d for n, d in dtypes.items() if n not in a_log} == {"torch.bfloat16"}
    rollout_checks(_cfg(ckpt, **flags), 0, info["metrics"], print)  # raises CITestFailure on a miss


@pytest.fixture(scope="module")
def plain_step(layout_checkpoint, tmp_path_factory):
    """The step without activation recompute (the recompute cases' reference, trained once)."""
    return train_one_step(layout_checkpoint, tmp_path_factory.mktemp("plain") / "out", 1)


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
        dict(recompute_granularity="selective"),
    ],  # fmt: skip
)
def test_recompute_gives_the_step_without_it(layout_checkpoint, plain_step, tmp_path, recompute):
    got = train_one_step(layout_checkpoint, tmp_path / "rc", 1, **recompute)
    for key in ("train/loss", "train/grad_norm"):
        assert got[0]["metrics"][key] == plain_step[0]["metrics"][key]
    assert all(torch.equal(got[1][k], v) for k, v in plain_step[1].items())


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (dict(fp16=True, bf16=True), "--fp16 with --bf16"),
        (
            dict(initial_loss_scale=2.0**16),
            "--initial-loss-scale: megatron's loss scaling, which only --fp16",
        ),
        (dict(train_backend="fsdp", fp16=True, loss_scale=8.0), "--loss-scale: Megatron's precision"),
        (dict(fp16=True, min_loss_scale=4.0, initial_loss_scale=2.0), "--min-loss-scale 4.0 > --initial"),
        (dict(fp16=True, lora_rank=4), "--fp16 with LoRA"),
        (
            dict(fp16=True, train_forward_dtype="bf16"),
            "--fp16 with --train-forward-dtype / --rollout-dtype bf16",
        ),
        (dict(use_distributed_optimizer=True, optimizer="sgd"), "steps Adam only"),
        (dict(use_distributed_optimizer=True, async_save=True, save="/tmp/x"), "with --async-save"),
        (dict(train_backend="fsdp", use_distributed_optimizer=True), "for --train-backend megatron"),
        (
            dict(optimizer_cpu_offload=True, bf16=True),
            "--optimizer-cpu-offload: .*add --use-distributed-optimizer",
        ),
        (
            dict(optimizer_cpu_offload=True, use_distributed_optimizer=True),
            "--optimizer-cpu-offload needs --bf16",
        ),
        (
            dict(overlap_cpu_optimizer_d2h_h2d=True),
            "--overlap-cpu-optimizer-d2h-h2d .*add --optimizer-cpu-offload",
        ),
        (
            dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True, bf16=True),
            "--use-precision-aware-optimizer without --optimizer-cpu-offload: .*FusedAdam",
        ),
        (
            dict(compat_flags={"exp_avg_dtype": "bf16"}),
            "--exp-avg-dtype bf16: Adam's first moment: fp32 only",
        ),
        (dict(compat_flags={"main_params_dtype": "fp16"}), "--main-params-dtype fp16: .*fp32 only"),
        (dict(train_backend="fsdp", bf16=True), "--bf16: Megatron's precision"),
        (dict(train_forward_dtype="bf16", rollout_dtype="bf16"), "--train-forward-dtype bf16: not supported"),
        (dict(recompute_granularity="full"), "needs --recompute-method"),
    ],
)
def test_precision_flags_megatron_cannot_run_here_are_refused(tiny_hf_checkpoint, flags, match):
    from miles_platform.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        _cfg(tiny_hf_checkpoint, **flags)


def test_miles_offloaded_optimizer_trio_validates(tiny_hf_checkpoint):
    """Miles' most common optimizer line (44 of its launch scripts), with its fp32 optimizer dtypes."""
    dtypes = dict.fromkeys(
        ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"), "fp32"
    )
    cfg = _cfg(tiny_hf_checkpoint, bf16=True, use_distributed_optimizer=True, optimizer_cpu_offload=True,
               overlap_cpu_optimizer_d2h_h2d=True, use_precision_aware_optimizer=True, compat_flags=dtypes)  # fmt: skip
    assert cfg.use_precision_aware_optimizer and cfg.optimizer_cpu_offload


@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_fp16_sets_the_forward_and_engine_dtype(tiny_hf_checkpoint, backend):
    """Miles' --fp16 on either trainer: fp16 forward, engines serving float16; fsdp's is Miles' FSDP
    one (fp16 compute, fp32 master parameters, no loss scaling)."""
    cfg = _cfg(tiny_hf_checkpoint, train_backend=backend, fp16=True)
    assert (cfg.train_forward_dtype, cfg.rollout_dtype) == ("fp16", "fp16")
