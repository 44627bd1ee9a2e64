"""The cases of --fp16, --optimizer-cpu-offload and Miles' offloaded optimizer trio
(--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer) on the megatron backend, run by one gloo rank in one
process (`run`: its report as a dict), judged by tests/unit/training/test_megatron_fp16_offload.py on
the CPU and tests/gpu/test_megatron_fp16_offload_gpu.py on CUDA (scripts/gpu_checks.py).
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import torch
from loop_helpers import random_train_batch, run_ranks

from miles_platform.cluster.ports import free_port

# the fp16 step against the fp32 step, SGD without clipping (the update is -lr x the gradient, so the
# update's error is the gradient's): fp16 carries 11 significant bits (unit roundoff 2^-11 = 4.9e-4
# per rounding), and the tiny model's forward and backward round a few dozen times along a path;
# measured, the fp16 update is off the fp32 one by 8.2e-4 of its largest entry (megatron-core 0.16,
# torch 2.13 CPU). 1e-2 is twelve times that; gradients left scaled (no unscale) are off by 49.
STEP_RTOL = 1e-2
SCALE = 2.0**10  # --initial-loss-scale of the cases: gradients x 1024 stay far below fp16's 65504


def _cfg(ckpt: str, **kw):
    from miles_platform.config import RunConfig

    base = dict(hf_checkpoint=ckpt, train_backend="megatron", rollout_batch_size=2, n_samples_per_prompt=2,
                global_batch_size=4, micro_batch_size=1, lr=1e-3, num_rollout=1)  # fmt: skip
    return RunConfig(**{**base, **kw}).validate()


def _main(actor) -> dict[str, torch.Tensor]:
    """What the optimizer steps: the fp32 main parameters (fp32: the model's own)."""
    return {n: p.detach().float().clone() for n, p in actor.backend.named_parameters()}


def _train(actor, inf_grad: bool = False) -> dict:
    """One rollout (one optimizer step); `inf_grad`: one weight's gradient made inf in backward."""
    hook = None
    if inf_grad:
        p = next(p for p in actor.backend.module.parameters() if p.requires_grad)
        hook = p.register_hook(lambda g: torch.full_like(g, float("inf")))
    try:
        return actor.train(0, random_train_batch(0))
    finally:
        if hook is not None:
            hook.remove()


def _scaler(actor) -> dict:
    from miles_platform.training.megatron_precision import scaler_state

    b = actor.backend
    return scaler_state(b.loss_scale.scaler if b.loss_scale is not None else b.dist_opt.grad_scaler)


def _delta(after: dict, before: dict) -> dict:
    return {n: after[n] - before[n] for n in before}


def _step_cases(ckpt: str, out: Path, rep: dict) -> None:
    from miles_platform.training import megatron_shims
    from miles_platform.training.actor import TrainerActor

    port = free_port()
    fp32 = TrainerActor(_cfg(ckpt, optimizer="sgd", clip_grad=100.0), 0, 1, f"tcp://127.0.0.1:{port}")
    w0 = _main(fp32)
    rep["fp32"] = _train(fp32)
    d32 = _delta(_main(fp32), w0)
    megatron_shims.destroy_process_group()

    flags = dict(optimizer="sgd", clip_grad=100.0, fp16=True, initial_loss_scale=SCALE, loss_scale_window=2,
                 hysteresis=1)  # fmt: skip
    actor = TrainerActor(_cfg(ckpt, **flags), 0, 1, f"tcp://127.0.0.1:{free_port()}")
    rep["dtypes"] = sorted({str(p.dtype) for p in actor.backend.module.parameters()})
    rep["main_dtypes"] = sorted({str(p.dtype) for p in actor.backend.parameters()})
    w0 = _main(actor)
    rep["fp16"] = _train(actor)  # scale 1024, one clean step of the window of 2
    d16 = _delta(_main(actor), w0)
    top = max(float(d.abs().max()) for d in d32.values())
    rep["step_rel_diff"] = max(float((d16[n] - d32[n]).abs().max()) for n in d32) / top
    rep["scaler_after_step"] = _scaler(actor)
    before = _main(actor)
    model_before = [p.detach().clone() for p in actor.backend.module.parameters()]
    rep["inf"] = _train(actor, inf_grad=True)
    rep["inf_moved_main"] = any(not torch.equal(v, before[n]) for n, v in _main(actor).items())
    rep["inf_moved_model"] = any(
        not torch.equal(a, b) for a, b in zip(model_before, actor.backend.module.parameters(), strict=True)
    )
    rep["scaler_after_inf"] = _scaler(actor)
    _train(actor)
    rep["scaler_after_clean"] = _scaler(actor)
    saved_main = _main(actor)
    actor.backend.save_optimizer(actor.opt, str(out / "ckpt"))
    _train(actor)
    rep["scaler_after_window"] = _scaler(actor)
    rep["loaded"] = actor.backend.load_optimizer(actor.opt, str(out / "ckpt"))
    rep["scaler_loaded"] = _scaler(actor)
    rep["main_loaded"] = all(torch.equal(v, saved_main[n]) for n, v in _main(actor).items())
    rep["export_dtypes"] = sorted({str(v.dtype) for v in actor.get_hf_weights().values()})
    megatron_shims.destroy_process_group()


def _distopt_cases(ckpt: str, out: Path, rep: dict) -> None:
    from miles_platform.training import megatron_shims
    from miles_platform.training.actor import TrainerActor

    flags = dict(fp16=True, use_distributed_optimizer=True, initial_loss_scale=SCALE, hysteresis=1)
    actor = TrainerActor(_cfg(ckpt, **flags), 0, 1, f"tcp://127.0.0.1:{free_port()}")
    before = _main(actor)
    rep["d_inf"] = _train(actor, inf_grad=True)
    rep["d_inf_moved"] = any(not torch.equal(v, before[n]) for n, v in _main(actor).items())
    rep["d_scaler_after_inf"] = _scaler(actor)
    rep["d_clean"] = _train(actor)
    rep["d_clean_moved"] = any(not torch.equal(v, before[n]) for n, v in _main(actor).items())
    b = actor.backend
    b.save_optimizer(actor.opt, str(out / "dckpt"))  # megatron's sharded optimizer state
    saved = _scaler(actor)
    b.dist_opt.grad_scaler.update(True)  # moved off the saved state, then loaded back
    b.load_optimizer(actor.opt, str(out / "dckpt"))
    rep["d_scaler_saved"], rep["d_scaler_loaded"] = saved, _scaler(actor)
    megatron_shims.destroy_process_group()


def _shards(actor) -> list[torch.Tensor]:
    """The fp32 main parameter shards the optimizer steps: the distributed optimizer's own, or with
    --use-precision-aware-optimizer the host optimizer's fp32 copies of its bf16 shards."""
    opt = actor.backend.dist_opt.mcore
    return [
        getattr(o.optimizer, "param_to_fp32_param", {}).get(p, p).detach().clone()
        for o in opt.chained_optimizers
        for g in o.optimizer.param_groups
        for p in g["params"]
    ]


def _masters_off_model(actor) -> float:
    """How far the optimizer's fp32 masters of the bf16 shards (and their host copies) are from the
    model's weights: 0 right after load_model (--no-load-optim) when it refreshes them."""
    out = 0.0
    for o in actor.backend.dist_opt.mcore.chained_optimizers:
        hdo, pairs = o.optimizer, []
        for shards, mains in zip(o.shard_float16_groups, o.shard_fp32_from_float16_groups, strict=True):
            for s, m in zip(shards, mains, strict=True):
                m = hdo.param_to_fp32_param[s] if m is None else m  # the trio: the host's master
                pairs += [(s, m), (s, hdo.gpu_params_map_cpu_copy.get(m, m))]
        out = max([out, *(float((m - s.float()).abs().max()) for s, m in pairs)])
    return out


def _max_diff(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _offload_cases(ckpt: str, out: Path, rep: dict) -> None:
    from miles_platform.training import megatron_distopt, megatron_shims
    from miles_platform.training.actor import TrainerActor

    # fp32 main gradients, as Miles' offloaded recipes run: --use-precision-aware-optimizer clips the
    # main gradients in place (megatron's `decoupled_grad`), in bf16 without the flag (the trio's step
    # then measured 4.5e-6 off the plain one, which clips an fp32 copy; 6e-8 with it)
    base = dict(bf16=True, use_distributed_optimizer=True, global_batch_size=2,
                accumulate_allreduce_grads_in_fp32=True)  # fmt: skip
    shards = {}
    overlap = dict(optimizer_cpu_offload=True, overlap_cpu_optimizer_d2h_h2d=True)
    for name, kw in (("plain", {}), ("offload", dict(optimizer_cpu_offload=True)), ("overlap", overlap),
                     ("trio", dict(overlap, use_precision_aware_optimizer=True))):  # fmt: skip
        actor = TrainerActor(_cfg(ckpt, **base, **kw), 0, 1, f"tcp://127.0.0.1:{free_port()}")
        _train(actor)
        shards[name] = _shards(actor)
        if name != "plain":
            rep[f"{name}_placement"] = megatron_distopt.offload_placement(actor.backend.dist_opt)
            rep[f"{name}_host_optimizers"] = sum(
                len(o.optimizer.cpu_optimizers) for o in actor.backend.dist_opt.mcore.chained_optimizers
            )
            rep[f"{name}_step_diff"] = _max_diff(shards[name], shards["plain"])
            rep[f"{name}_trainer_device"] = str(actor.backend.device)
        if name in ("offload", "trio"):  # saved after step 1, loaded after step 2: step 2 again is step 2
            model = [p.detach().clone() for p in actor.backend.module.parameters()]
            actor.backend.save_optimizer(actor.opt, str(out / f"{name}_ckpt"))
            actor.train(0, random_train_batch(1))
            step2 = _shards(actor)
            rep[f"{name}_loaded"] = actor.backend.load_optimizer(actor.opt, str(out / f"{name}_ckpt"))
            rep[f"{name}_load_diff"] = _max_diff(shards[name], _shards(actor))
            with torch.no_grad():  # the weights, as load_model gives them
                for p, w in zip(actor.backend.module.parameters(), model, strict=True):
                    p.copy_(w)
            actor.train(0, random_train_batch(1))
            rep[f"{name}_resumed_diff"] = _max_diff(step2, _shards(actor))
            # --no-load-optim: weights from a checkpoint (moved on by a step since), no optimizer state
            actor.backend.save_model(str(out / f"{name}_model"))
            actor.train(0, random_train_batch(2))
            rep[f"{name}_stepped_off_model"] = _masters_off_model(actor)  # 0: the step rounds them in
            actor.backend.load_model(str(out / f"{name}_model"))
            rep[f"{name}_reloaded_off_model"] = _masters_off_model(actor)
        megatron_shims.destroy_process_group()


def _worker(rank: int, ckpt: str, out: str) -> None:
    torch.set_num_threads(1)
    rep: dict = {}
    try:
        _step_cases(ckpt, Path(out), rep)
        _distopt_cases(ckpt, Path(out), rep)
        _offload_cases(ckpt, Path(out), rep)
        Path(out, "report.json").write_text(json.dumps(rep))
    except Exception:
        Path(out, "rank0.error").write_text(traceback.format_exc())


def run(ckpt: str, out: Path) -> dict:
    """Every case in one spawned rank (the trainer's device: CUDA when there is one); the report."""
    run_ranks(_worker, (ckpt, str(out)), 1, out)
    return json.loads((out / "report.json").read_text())
