"""The tiny DiT family's train-pipeline config: tasks, the dtype contract, and THE DiT forward.

Engine and trainer both call `dit_forward`, so the boundary casts (`input_dtype_policy`) and the
interior autocast are one implementation; the only difference left between the two sides is how
weights reach the forward (the engine holds them at `--sglang-dit-precision`, the trainer gathers
them through FSDP2 at `--diffusion-forward-dtype`), which is what the alignment metrics measure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from miles_platform.training.precision import DTYPES, PrecisionPolicy, Rule, cast_boundary_inputs


@dataclass(frozen=True)
class TrainPipelineConfig:
    name: str
    tasks: tuple[str, ...]
    # over the three boundary inputs, as Miles documents them ("default" = --diffusion-forward-dtype)
    input_dtype_policy: Mapping[str, str | None]
    # root-relative parameter globs that keep their own dtype in a low-precision forward; later wins
    param_dtype_patterns: Mapping[str, str] = field(default_factory=dict)
    # the boundary names -> the transformer's keyword arguments they cover
    input_names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def kwarg_policy(self) -> dict[str, str | None]:
        return {kw: v for name, v in self.input_dtype_policy.items() for kw in self.input_names[name]}

    def rules(self) -> list[Rule]:
        return [Rule(dtype, param=pattern) for pattern, dtype in self.param_dtype_patterns.items()]


TINY_DIT = TrainPipelineConfig(
    name="tiny_dit",
    tasks=("t2i",),
    # as sglang-d feeds an SD3-style DiT: latents and text conditioning at the DiT precision, the
    # timestep (sigma * 1000) as the scheduler holds it
    input_dtype_policy={"latents": "default", "cond": "default", "timestep": None},
    # the timestep embedder and the final AdaLN modulation table stay fp32 (Miles' rule for
    # timestep embedders / scale-shift modulation parameters)
    param_dtype_patterns={"time_text_embed.timestep_embedder.*": "fp32", "norm_out.linear.*": "fp32"},
    input_names={
        "latents": ("hidden_states",),
        "cond": ("encoder_hidden_states", "pooled_projections"),
        "timestep": ("timestep",),
    },
)
FAMILIES = {"tiny_dit": TINY_DIT}


def family_for(name: str | None, hf_checkpoint: str) -> TrainPipelineConfig:
    """`--diffusion-model-family`, else the family the pipeline's model_index.json names."""
    import json

    from miles_platform.errors import ConfigError
    from miles_platform.store.remote import read_bytes

    if name is None:
        raw = read_bytes(f"{hf_checkpoint}/model_index.json")
        try:
            name = json.loads(raw).get("family") if raw is not None else None
        except ValueError:
            name = None
        if name is None:
            raise ConfigError(
                f"--hf-checkpoint {hf_checkpoint}: no model_index.json naming a family; pass a DiT pipeline "
                "dir (`miles-platform quickstart --task diffusion` builds one) or --diffusion-model-family"
            )
    if name not in FAMILIES:
        raise ConfigError(f"--diffusion-model-family {name!r}: registered families: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def precision_policy(cfg, family: TrainPipelineConfig = TINY_DIT) -> PrecisionPolicy:
    """The trainer's three axes: master --fsdp-master-dtype, gather and compute --diffusion-forward-dtype
    (Miles: "FSDP param_dtype and the input cast"), the family's per-parameter rules first, then
    the operator's --fsdp-precision-rules (later wins)."""
    from miles_platform.training.precision import parse_precision_rules

    fwd = cfg.diffusion_forward_dtype
    rules = (*family.rules(), *parse_precision_rules(cfg.fsdp_precision_rules)) if fwd != "fp32" else ()
    return PrecisionPolicy(master=cfg.fsdp_master_dtype, gather=fwd, compute=fwd, reduce=cfg.fsdp_reduce_dtype,
                           rules=tuple(rules), input_dtype_policy=family.kwarg_policy())  # fmt: skip


def engine_cast(transformer: nn.Module, dit_precision: str, family: TrainPipelineConfig = TINY_DIT) -> None:
    """The engine's DiT at its precision, the family's fp32 parameters kept fp32 (as the trainer gathers them)."""
    from miles_platform.training.precision import resolve_param_dtypes

    if dit_precision == "fp32":
        return
    # per tensor, not ModelMixin.to(): the rules, not diffusers' keep-in-fp32 list, say what stays fp32
    per_param = resolve_param_dtypes(transformer, family.rules(), dit_precision)
    # buffers (the positional table) stay as loaded: FSDP2 casts parameters only, so does this
    for name, p in transformer.named_parameters():
        p.data = p.data.to(DTYPES[per_param.get(name, dit_precision)])


@contextlib.contextmanager
def _autocast(dtype: str) -> Iterator[None]:
    if dtype == "fp32":
        yield
        return
    with torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=DTYPES[dtype]):
        yield


def dit_forward(
    transformer: nn.Module,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    cond: torch.Tensor,
    pooled: torch.Tensor,
    forward_dtype: str,
    family: TrainPipelineConfig = TINY_DIT,
) -> torch.Tensor:
    """noise_pred v [B,C,H,W] in fp32 (the scheduler's dtype). SD3 convention: timestep = sigma * 1000."""
    kwargs = {"hidden_states": latents, "encoder_hidden_states": cond, "pooled_projections": pooled,
              "timestep": sigma.float() * 1000.0}  # fmt: skip
    kwargs = cast_boundary_inputs(kwargs, family.kwarg_policy(), forward_dtype)
    with _autocast(forward_dtype):
        out = transformer(**kwargs, return_dict=False)[0]
    return out.float()
