"""`--use-distributed-optimizer` on the megatron backend: megatron-core's DistributedOptimizer, built
as Miles builds it (miles/backends/megatron_utils/model.py: `get_megatron_optimizer` over the chunks
wrapped in megatron-core DDP with `use_distributed_optimizer=True`).

Each data-parallel rank keeps the optimizer state (and under --bf16 the fp32 main parameters) of its
1 / DP slice of the contiguous gradient buffer only; DDP reduce-scatters the gradients into those
slices (`finalize_model_grads`), the step updates the slice, and the updated parameters are
all-gathered back into every rank's model (`start_param_sync`, blocking: no overlap on gloo).

The actor drives it as it drives its torch optimizer (`ActorOptimizer`, the face it sees):
`finish_grad_sync` reduce-scatters, the backend's `clip_grad_norm` runs megatron's `prepare_grads`
(the shard's main gradients) and its global norm / clip, `opt.step()` is megatron's
`step_with_ready_grads`, and the actor's LR schedule writes the `lr` of megatron's param groups.
One difference from megatron-core's default: weight decay applies to every parameter, as the
backend's torch AdamW does (megatron's default skips biases and norms; `config_overrides={}`), so
the step with the distributed optimizer is the step without it.

A checkpoint stores megatron's own sharded optimizer state (`sharded_state_dict`, its fully
reshardable format: any TP / PP / DP reads it) in `<iter dir>/optimizer/` with dist_checkpointing.

--optimizer-cpu-offload builds megatron-core's HybridDeviceOptimizer in place of its Adam (as
`get_megatron_optimizer` does): a host copy of every main parameter shard, its gradient copied to the
host, torch's AdamW stepping the copy and its state on the host, the copy written back to the shard
(`offload_placement`). Under --bf16 only: with fp32 parameters megatron's shards are views of the
model's parameters, which a torch optimizer refuses (ValueError "can't optimize a non-leaf Tensor",
measured).

On a machine without CUDA megatron-core's optimizer needs `megatron_shims.apply_optimizer_cpu_shims`.
"""

from __future__ import annotations

from typing import Any

import torch


def optimizer_config(cfg: Any):
    """megatron-core's OptimizerConfig of the run's optimizer flags."""
    from megatron.core.optimizer import OptimizerConfig

    from miles_platform.training.megatron_precision import params_dtype

    bf16, fp16 = bool(getattr(cfg, "bf16", False)), bool(getattr(cfg, "fp16", False))
    scaling = (  # --fp16: megatron builds its grad scaler from these (megatron_precision.grad_scaler)
        dict(loss_scale=cfg.loss_scale, initial_loss_scale=cfg.initial_loss_scale, min_loss_scale=cfg.min_loss_scale,
             loss_scale_window=cfg.loss_scale_window, hysteresis=cfg.hysteresis)
        if fp16 else {}
    )  # fmt: skip
    return OptimizerConfig(
        optimizer="adam" if cfg.optimizer == "adam" else "sgd",
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        sgd_momentum=0.0,  # the actor's torch SGD has none
        clip_grad=cfg.clip_grad,
        bf16=bf16,
        fp16=fp16,
        params_dtype=params_dtype(cfg),
        use_distributed_optimizer=True,
        # --optimizer-cpu-offload: megatron-core's HybridDeviceOptimizer, all of the state on the host
        # (Megatron-LM's --optimizer-offload-fraction default, 1.0)
        optimizer_cpu_offload=bool(getattr(cfg, "optimizer_cpu_offload", False)),
        optimizer_offload_fraction=1.0,
        overlap_cpu_optimizer_d2h_h2d=bool(getattr(cfg, "overlap_cpu_optimizer_d2h_h2d", False)),
        # with offload (config/megatron.py): HybridDeviceOptimizer(param_update_in_fp32=True) holds the fp32
        # master copies; the DistributedOptimizer keeps no fp32 main shards and hands it `decoupled_grad`s
        use_precision_aware_optimizer=bool(getattr(cfg, "use_precision_aware_optimizer", False)),
        **scaling,
    )


def build(cfg: Any, ddp_chunks: list):
    """megatron-core's optimizer (a ChainedOptimizer of DistributedOptimizers: dense and, with
    experts, expert parameters) over the DDP-wrapped chunks."""
    from megatron.core.optimizer import get_megatron_optimizer

    from miles_platform.training import megatron_shims

    megatron_shims.apply_optimizer_cpu_shims()
    return get_megatron_optimizer(optimizer_config(cfg), ddp_chunks, config_overrides={})


class ActorOptimizer:
    """The torch.optim face of megatron's optimizer that the actor drives (see the module docstring)."""

    def __init__(self, mcore):
        self.mcore = mcore
        self.skipped = False  # --fp16: the last step's gradients overflowed at the loss scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """--fp16: megatron's `grad_scale_func` (the loss times its grad scaler's scale)."""
        return self.mcore.scale_loss(loss)

    def loss_scale(self) -> float:
        return float(self.mcore.get_loss_scale())

    @property
    def grad_scaler(self):
        """--fp16: megatron's grad scaler of the (first) chained optimizer, the one get_loss_scale reads."""
        return getattr(self.mcore, "chained_optimizers", [self.mcore])[0].grad_scaler

    @property
    def param_groups(self) -> list[dict]:
        return self.mcore.param_groups

    @property
    def state(self) -> dict:
        """{main parameter shard: its state} over the chained optimizers (what this rank holds)."""
        out: dict = {}
        for o in getattr(self.mcore, "chained_optimizers", [self.mcore]):
            out.update(o.optimizer.state)
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.mcore.zero_grad(set_to_none)

    def step(self) -> None:
        self.mcore.step_with_ready_grads()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The shard's main gradients (`prepare_grads`), their global L2 norm, clipped to max_norm."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        # --fp16: prepare_grads unscales them, checks for inf / nan and updates the grad scaler;
        # an overflow skips the step (megatron's step returns there): the actor skips on an inf norm
        self.skipped = bool(self.mcore.prepare_grads())
        if self.skipped:
            return torch.tensor(float("inf"), dtype=torch.float64)
        norm = self.mcore.get_grad_norm()
        if max_norm > 0:
            for o in getattr(self.mcore, "chained_optimizers", [self.mcore]):
                params = o.get_parameters()
                if params:  # --use-precision-aware-optimizer: the gradients are `decoupled_grad`s
                    decoupled = o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                    clip_grad_by_total_norm_fp32(params, max_norm, norm, use_decoupled_grad=decoupled)
        return torch.tensor(float(norm), dtype=torch.float64)

    # ---- checkpoints: megatron's sharded optimizer state (resharded like the weights) ----
    def sharded_state_dict(self, model_sharded: dict, is_loading: bool = False) -> dict:
        if is_loading:
            self._empty_state()
        return _no_classes(
            self.mcore.sharded_state_dict(model_sharded, is_loading=is_loading, metadata=SHARDING)
        )

    def _empty_state(self) -> None:
        """Before a load, a fresh optimizer holds no state, and megatron's state_dict (which its
        sharded_state_dict starts from) asserts one Adam step count: give each shard torch AdamW's
        zero state (the load overwrites it; megatron's own dummy step would decay the weights)."""
        for o in getattr(self.mcore, "chained_optimizers", [self.mcore]):
            for group in o.optimizer.param_groups:
                for p in group["params"]:
                    if not o.optimizer.state[p]:
                        o.optimizer.state[p] = {
                            "step": torch.tensor(0.0),
                            "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p),
                        }

    def reload_model_params(self) -> None:
        """The fp32 main parameters (and the offloaded host copies) from the model's, after load_model
        brought weights without optimizer state (--no-load-optim): megatron's `reload_model_params`.
        Without it the first step wrote the stale fp32 values of the weights the optimizer was built
        from back into the model, dropping the loaded ones (measured: moved by the whole difference).
        megatron-core 0.16's own refreshes only the HybridDeviceOptimizer's fp32 copies of bf16 shards
        (--use-precision-aware-optimizer), not the distributed optimizer's main shards under it."""
        for o in getattr(self.mcore, "chained_optimizers", [self.mcore]):
            hdo = o.optimizer
            if o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                hdo.update_fp32_param_by_new_param()  # bf16 shards -> the host's fp32 masters
                continue
            for model_group, main_group in zip(
                o.model_float16_groups, o.shard_fp32_from_float16_groups, strict=True
            ):
                for model_param, main in zip(model_group, main_group, strict=True):
                    r = o._get_model_param_range_map(model_param)["param"]
                    main.data.copy_(model_param.detach().view(-1)[r.start : r.end])
            _refresh_host_copies(hdo)

    def load_sharded(self, state: dict) -> None:
        self.mcore.load_state_dict(state)
        for o in getattr(self.mcore, "chained_optimizers", [self.mcore]):
            if o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                # with --use-precision-aware-optimizer the load puts the saved fp32 master parameters and
                # Adam state into the HybridDeviceOptimizer's state ("master_param") after its own post-load
                # hook rebuilt the host copies from the bf16 shards; its re-sync (the hook's last step) copies
                # them into the fp32 copies the host steps, the state onto the host (measured without it:
                # the masters were the bf16 weights, the resumed step off by 2.5e-3)
                o.optimizer._sync_hdo_state_to_sub_optimizers()
                continue
            # --optimizer-cpu-offload: the load rebuilds the host copies before it writes the loaded
            # main parameters into the device shards; the host copies take them (what the host steps)
            _refresh_host_copies(o.optimizer)


def _refresh_host_copies(inner) -> None:
    """--optimizer-cpu-offload: each HybridDeviceOptimizer host copy (what the host steps) takes its
    device shard's values; no-op for megatron's plain Adam."""
    for p, copy in getattr(inner, "gpu_params_map_cpu_copy", {}).items():
        copy.data.copy_(p.data)


def _no_classes(state):
    """The optimizer state without the classes in its param groups: --optimizer-cpu-offload's
    HybridDeviceOptimizer keeps its host / device optimizer classes there (its constructor's defaults),
    which the checkpoint's common state would pickle and torch.load (weights_only) refuses to read
    ("Unsupported global: torch.optim.adamw.AdamW", measured); the optimizer keeps them itself."""
    if isinstance(state, dict):
        if isinstance(state.get("param_groups"), list):
            for g in state["param_groups"]:
                for k in [k for k, v in g.items() if isinstance(v, type)]:
                    del g[k]
        for v in state.values():
            _no_classes(v)
    elif isinstance(state, list):
        for v in state:
            _no_classes(v)
    return state


def offload_placement(opt: ActorOptimizer) -> dict[str, Any]:
    """--optimizer-cpu-offload: where megatron's HybridDeviceOptimizer keeps what, over the chained
    optimizers: the devices of the parameter shards it offloads (the trainer's), of their host copies,
    of the gradients copied to the host and of the optimizer state (the host's); how many host copies
    share storage with their device shard (none should) and how many device-side optimizers it built
    (none: Megatron-LM's --optimizer-offload-fraction default 1.0 offloads every shard). With
    --use-precision-aware-optimizer the shards are the model's bf16 ones and the host copies its fp32
    masters (`master`: their devices); `main_shards` counts the fp32 main shards the distributed
    optimizer keeps itself (none then)."""
    out: dict[str, Any] = {k: set() for k in ("param", "host_copy", "host_grad", "state", "master", "dtypes")}
    out["offloaded"] = out["shared"] = out["device_optimizers"] = out["main_shards"] = 0
    for o in getattr(opt.mcore, "chained_optimizers", [opt.mcore]):
        hdo = o.optimizer
        out["device_optimizers"] += hdo.gpu_optimizer is not None
        out["main_shards"] += sum(p is not None for g in o.shard_fp32_from_float16_groups for p in g)
        out["master"].update(str(c.device) for c in hdo.param_to_fp32_param.values())
        for p, copy in hdo.gpu_params_map_cpu_copy.items():
            out["param"].add(str(p.device))
            out["host_copy"].add(str(copy.device))
            out["dtypes"].add(f"{p.dtype} -> {copy.dtype}".replace("torch.", ""))
            out["offloaded"] += 1
            out["shared"] += copy.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
        out["host_grad"].update(str(g.device) for g in hdo.cpu_copy_map_grad.values())
        for sub in hdo.sub_optimizers:
            for st in sub.state.values():
                out["state"].update(str(t.device) for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    return {k: sorted(v) if isinstance(v, set) else v for k, v in out.items()}


# megatron-core 0.16's fully reshardable format (its default, 'fully_sharded_model_space', raises
# "ShardedTensor.flattened_range is not supported" at save: measured), "ShardedTensor.flattened_range is not supported": measured), gathered over the data-parallel
# group's gloo twin (its other variant all-gathers CUDA tensors: `.cuda()`)
SHARDING = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
}
MARKER = "distributed_optimizer"  # in the saved common state: which optimizer wrote it


def save(opt: ActorOptimizer, model_sharded: dict, ckpt_dir: str, save_strategy) -> None:
    """Collective: megatron's sharded optimizer state into `<ckpt_dir>/optimizer/`."""
    import os

    from megatron.core import dist_checkpointing

    from miles_platform.training.megatron_checkpoint import OPTIMIZER_DIR

    path = os.path.join(ckpt_dir, OPTIMIZER_DIR)
    os.makedirs(path, exist_ok=True)
    state = {"optimizer": opt.sharded_state_dict(model_sharded), MARKER: True}
    dist_checkpointing.save(state, path, sharded_strategy=save_strategy)


def load(opt: ActorOptimizer, model_sharded: dict, ckpt_dir: str) -> bool:
    """Collective: `save`'s state back (resharded); False when the checkpoint has no optimizer."""
    import os

    from megatron.core import dist_checkpointing

    from miles_platform.errors import CheckpointError
    from miles_platform.training.megatron_checkpoint import OPTIMIZER_DIR

    path = os.path.join(ckpt_dir, OPTIMIZER_DIR)
    if not os.path.isdir(path):
        return False
    if not dist_checkpointing.load_common_state_dict(path).get(MARKER):
        raise CheckpointError(
            f"{path}: saved without --use-distributed-optimizer (the backend's AdamW state, by parameter); "
            "resume with the flag as saved, or --no-load-optim"
        )
    state = dist_checkpointing.load(
        {"optimizer": opt.sharded_state_dict(model_sharded, is_loading=True)}, path
    )
    opt.load_sharded(state["optimizer"])
    return True
