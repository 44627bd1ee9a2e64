"""Apply a compiled precision plan with FSDP2 (`fully_shard`), and the forward autocast.

`shard_model` wraps one `fully_shard` unit per compiled `WrapUnit`, deepest first, each with its own
`MixedPrecisionPolicy(param_dtype, reduce_dtype, cast_forward_inputs)`. Units whose parameters need
two gather dtypes get `ParamDtypeMixedPrecisionPolicy`, whose per-parameter map is honoured by a small
`FSDPParam` subclass; that reaches into FSDP2 internals, so it is gated on the pinned torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from miles_platform.training.precision import (
    DTYPES,
    PrecisionError,
    PrecisionPlan,
    PrecisionPolicy,
    apply_input_dtype_policy,
    compile_policy,
    normalize_fqn,
)

PINNED_TORCH = "2.13.0"


@dataclass(frozen=True)
class ParamDtypeMixedPrecisionPolicy(MixedPrecisionPolicy):
    """`MixedPrecisionPolicy` + gather dtype overrides keyed by wrap-local parameter name."""

    param_dtype_map: Mapping[str, torch.dtype] = field(default_factory=dict, hash=False, compare=False)


def _check_torch_version() -> None:
    found = torch.__version__.split("+")[0]
    if found != PINNED_TORCH:
        raise PrecisionError(
            f"per-parameter gather dtypes patch FSDP2 internals verified on torch=={PINNED_TORCH}, found "
            f"{torch.__version__}; pin torch=={PINNED_TORCH} or express the rules as module rules"
        )


def _param_dtype_fsdp_param_cls() -> type:
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    class ParamDtypeFSDPParam(FSDPParam):
        """Honours `param_dtype_map` and keeps the group's gradients and reduce dtype uniform."""

        wrap_local_name: str

        def init_dtype_attrs(self, mp_policy: MixedPrecisionPolicy) -> None:
            super().init_dtype_attrs(mp_policy)
            override = getattr(mp_policy, "param_dtype_map", {}).get(self.wrap_local_name)
            target = override or mp_policy.param_dtype or self.orig_dtype
            self.param_dtype = (
                None if target == self.orig_dtype or not self.orig_dtype.is_floating_point else target
            )
            # FSDP2 asserts one reduce dtype and one grad dtype per group; grads here come in mixed
            # dtypes, so every member reduces in the explicit reduce dtype (upcast in unsharded_grad_data).
            self.reduce_dtype = mp_policy.reduce_dtype or self.orig_dtype

        @property
        def unsharded_grad_data(self) -> torch.Tensor:
            grad = super().unsharded_grad_data
            return grad if self.reduce_dtype is None else grad.to(self.reduce_dtype)

    return ParamDtypeFSDPParam


def _install_param_dtype_map(module: nn.Module, fsdp_param_cls: type) -> None:
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:
        return
    local = {id(m): normalize_fqn(name) for name, m in module.named_modules()}
    for fp in group.fsdp_params:
        prefix = local[id(fp._module_info.module)]
        fp.__class__ = fsdp_param_cls
        fp.wrap_local_name = (
            f"{prefix}.{fp._module_info.param_name}" if prefix else fp._module_info.param_name
        )


def _ensure_process_group(device: torch.device) -> None:
    # A single-process run (census, world_size 1 with rules or a bf16 forward) still needs a group
    # for fully_shard: NCCL for a model on CUDA (gloo cannot all-gather CUDA tensors), else gloo.
    if not dist.is_initialized():
        from miles_platform.cluster.devices import group_backend

        dist.init_process_group(group_backend(device), store=dist.HashStore(), rank=0, world_size=1)


def apply_precision_plan(
    model: nn.Module, plan: PrecisionPlan, policy: PrecisionPolicy, mesh=None
) -> nn.Module:
    """`fully_shard` every unit of `plan` (deepest first) with its policy; returns the model."""
    if plan.needs_param_maps:
        _check_torch_version()
        fsdp_param_cls = _param_dtype_fsdp_param_cls()
    modules = dict(model.named_modules())
    reduce = DTYPES[policy.reduce]
    for unit in plan.units:
        common: dict[str, Any] = dict(
            param_dtype=DTYPES[unit.param_dtype],
            reduce_dtype=reduce,
            cast_forward_inputs=policy.cast_forward_inputs,
        )
        if unit.param_dtype_map:
            mp = ParamDtypeMixedPrecisionPolicy(
                **common, param_dtype_map={k: DTYPES[v] for k, v in unit.param_dtype_map.items()}
            )
        else:
            mp = MixedPrecisionPolicy(**common)
        fully_shard(modules[unit.fqn], mesh=mesh, mp_policy=mp)
        if unit.param_dtype_map:
            _install_param_dtype_map(modules[unit.fqn], fsdp_param_cls)
    return model


def shard_model(model: nn.Module, cfg: Any, mesh=None, *, gather_dtype: str | None = None) -> nn.Module:
    """Cast to the master dtype, compile the precision rules, and apply FSDP2 per the plan.

    With no rules and no autocast this is the plain per-layer + root wrap. `cfg` is a RunConfig
    (or a resolved `PrecisionPolicy`); `gather_dtype` defaults to the master dtype.
    """
    policy = cfg if isinstance(cfg, PrecisionPolicy) else PrecisionPolicy.from_config(cfg, gather_dtype)
    if any(p.dtype != DTYPES[policy.master] for p in model.parameters()):  # (diffusers warns on a no-op .to)
        model.to(DTYPES[policy.master])
    plan = compile_policy(model, policy)
    if mesh is None:
        _ensure_process_group(next(model.parameters()).device)
    apply_precision_plan(model, plan, policy, mesh)
    apply_input_dtype_policy(model, policy.input_dtype_policy, policy.compute)
    model.precision_plan = plan  # for logs and the census
    return model


def wrap_units(model: nn.Module) -> list[str]:
    """Root-relative names of the FSDP2 units on `model` (what `shard_model` produced)."""
    return [normalize_fqn(n) for n, m in model.named_modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def forward_autocast(cfg: Any, device_type: str | None = None) -> Iterator[None]:
    """Autocast to the compute dtype (`--train-forward-dtype`); a no-op for fp32."""
    compute = (cfg if isinstance(cfg, PrecisionPolicy) else PrecisionPolicy.from_config(cfg)).compute
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if compute == "fp32":
        yield
        return
    with torch.autocast(device_type, dtype=DTYPES[compute]):
        yield
