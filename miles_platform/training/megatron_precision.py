"""`--bf16` / `--fp16` on the megatron backend: bf16 (fp16) parameters and forward, fp32 main parameters
for the optimizer, fp16's loss scaling, and the TransformerConfig of Megatron's precision and recompute flags.

What megatron-core's Float16OptimizerWithFloat16Params does, on any device (that class takes CUDA
tensors only): each trainable bf16 parameter has an fp32 main copy carrying its tensor-parallel
attributes; the actor's AdamW steps the main copies, whose gradients are the DDP main_grad buffers
(fp32 with --accumulate-allreduce-grads-in-fp32, else bf16 cast up); after the step the main copies
are rounded into the model. A checkpoint stores the main copies with the optimizer state
(training/megatron_checkpoint.py), so a resume continues from the fp32 values, not their rounding.

--fp16 adds what that class does around its step with a grad scaler (`LossScale`: megatron-core's
DynamicGradScaler, or ConstantGradScaler at --loss-scale, chosen as `get_megatron_optimizer` does):
megatron's schedule multiplies each micro-batch loss by the scale before backward
(`config.grad_scale_func`); the main gradients are unscaled and checked for inf / nan (over the
model-parallel group); an overflow skips the step and the scale backs off (x0.5 after --hysteresis
overflows in a row, not below --min-loss-scale), --loss-scale-window clean steps double it. The
scaler's state is saved with the optimizer state and restored on resume.
"""

from __future__ import annotations

from typing import Any

import torch

_TP_ATTRS = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "shared",
    "sequence_parallel",
    "allreduce",
)


def config_kwargs(cfg: Any) -> dict[str, Any]:
    """TransformerConfig kwargs of --bf16, --attention-softmax-in-fp32, --moe-router-dtype and --recompute-*."""
    out: dict[str, Any] = {}
    for name in ("bf16", "fp16"):
        if getattr(cfg, name, False):
            out.update(
                {name: True}, attention_softmax_in_fp32=bool(getattr(cfg, "attention_softmax_in_fp32", False))
            )
    if getattr(cfg, "moe_router_dtype", None):  # --moe-router-dtype: megatron-core's routers cast to it
        out["moe_router_dtype"] = cfg.moe_router_dtype
    granularity = getattr(cfg, "recompute_granularity", None)
    if granularity:
        out["recompute_granularity"] = granularity
    if granularity == "full":
        out.update(recompute_method=cfg.recompute_method, recompute_num_layers=cfg.recompute_num_layers)
    return out


def params_dtype(cfg: Any) -> torch.dtype:
    if getattr(cfg, "fp16", False):
        return torch.float16
    return torch.bfloat16 if getattr(cfg, "bf16", False) else torch.float32


def reduced_precision(cfg: Any) -> bool:
    """--bf16 or --fp16: the model's parameters are not what the optimizer steps (fp32 main copies)."""
    return bool(getattr(cfg, "bf16", False) or getattr(cfg, "fp16", False))


def grad_scaler(cfg: Any):
    """megatron-core's grad scaler of the run's flags, as `get_megatron_optimizer` picks it:
    ConstantGradScaler at --loss-scale, else DynamicGradScaler (growth x2, backoff x0.5)."""
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    from miles_platform.training import megatron_shims

    megatron_shims.apply_optimizer_cpu_shims()  # its tensors are made with device="cuda"
    if cfg.loss_scale:
        return ConstantGradScaler(cfg.loss_scale)
    return DynamicGradScaler(
        initial_scale=cfg.initial_loss_scale, min_scale=cfg.min_loss_scale, growth_factor=2.0,
        backoff_factor=0.5, growth_interval=cfg.loss_scale_window, hysteresis=cfg.hysteresis,
    )  # fmt: skip


def scaler_state(scaler) -> dict[str, Any]:
    """A grad scaler's state as plain numbers (a checkpoint's common state): megatron's keys."""
    out = {k: v for k, v in scaler.state_dict().items() if k != "scale"}
    return {"scale": float(scaler.scale), **out}


def load_scaler_state(scaler, state: dict[str, Any]) -> None:
    """`scaler_state` back, on the scaler's own device (megatron's load_state_dict moves the scale
    to CUDA)."""
    scaler._scale = torch.tensor([float(state["scale"])], dtype=torch.float, device=scaler.scale.device)
    if "growth_tracker" in state:
        scaler._growth_tracker = int(state["growth_tracker"])
        scaler._hysteresis_tracker = int(state["hysteresis_tracker"])


class LossScale:
    """--fp16 without the distributed optimizer: Float16OptimizerWithFloat16Params' loss scaling
    around the actor's step (see the module docstring)."""

    def __init__(self, scaler, group=None):
        self.scaler, self.group = scaler, group  # group: where found-inf is agreed (model parallel)
        self.skipped = False  # the last step's gradients overflowed at the scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """megatron's `grad_scale_func`: the micro-batch loss times the scale, before backward."""
        return self.scaler.scale.to(loss.device) * loss

    @torch.no_grad()
    def unscale_and_check(self, params) -> bool:
        """Unscale the main gradients in place; True (and the step is to be skipped) when one of
        them, on any rank of the group, is inf / nan. Updates the scaler, as megatron's prepare_grads."""
        grads = [p.grad for p in params if p.grad is not None]
        found = torch.zeros(1, dtype=torch.float, device=grads[0].device if grads else "cpu")
        if grads:
            inv = self.scaler.inv_scale.to(found.device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        if self.group is not None and torch.distributed.get_world_size(self.group) > 1:
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX, group=self.group)
        self.skipped = bool(found.item() > 0)
        self.scaler.update(self.skipped)
        return self.skipped


class MainParams:
    """fp32 main copies of a model's trainable low-precision parameters (see the module docstring)."""

    def __init__(self, named_params):
        self.pairs: list[tuple[str, torch.nn.Parameter, torch.nn.Parameter]] = []
        for name, p in named_params:
            if not p.requires_grad:
                continue
            main = torch.nn.Parameter(p.detach().float().clone())
            for attr in _TP_ATTRS:
                if hasattr(p, attr):
                    setattr(main, attr, getattr(p, attr))
            self.pairs.append((name, p, main))
        self._model_of = {id(main): p for _, p, main in self.pairs}

    def named_parameters(self):
        return [(name, main) for name, _, main in self.pairs]

    def grads_from_model(self) -> None:
        """main.grad = the model parameter's accumulated (DDP: reduced) gradient, in fp32."""
        for _, p, main in self.pairs:
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            main.grad = None if g is None else g.float()

    @torch.no_grad()
    def to_model(self) -> None:
        """Round the stepped main copies into the model's parameters."""
        for _, p, main in self.pairs:
            p.copy_(main)

    @torch.no_grad()
    def from_model(self) -> None:
        for _, p, main in self.pairs:
            main.copy_(p)

    def model_param(self, main: torch.nn.Parameter) -> torch.nn.Parameter:
        """The model parameter a main copy belongs to."""
        return self._model_of[id(main)]
