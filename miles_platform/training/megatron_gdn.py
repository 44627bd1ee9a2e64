"""Gated-DeltaNet layers (Qwen3.5) on megatron-core: their layer spec, and a pure-torch `fla` for the CPU.

megatron-core 0.16's `GatedDeltaNet` (megatron/core/ssm/gated_delta_net.py) is the linear-attention layer;
its own block spec (`get_transformer_block_with_experimental_attention_variant_spec`) is transformer-engine only,
so `gdn_layer_spec` swaps it into the layer spec the backend already builds (local or TE) for the layers
`linear_attention_freq` marks 1. Its output norm is `GatedOutNorm`, x * w, whatever the model's
`layernorm_zero_centered_gamma` (HF's Qwen3_5RMSNormGated is not zero-centered; every other Qwen3.5 norm is).

GatedDeltaNet imports flash-linear-attention (`fla`: triton kernels, CUDA only) at import time and refuses to
build without it. On a machine without CUDA, `install_cpu_fla` (called by megatron_shims.apply_cpu_shims) gives
megatron's module the two functions it takes from fla, in torch: `l2norm` (fla's and HF's arithmetic, eps 1e-6)
and `chunk_gated_delta_rule` (megatron's own `torch_chunk_gated_delta_rule`, the chunked form HF's reference
computes); its torch.compiled gated norm runs eagerly there like every megatron `jit_fuser` function
(megatron_shims). It sets the names inside megatron's module rather than
registering an `fla` package: transformers would then take that package for the real library in the same
process (the embedded engine's HF model). With CUDA, the real fla is required (`check_fla`, the `gpu` extra).
"""

from __future__ import annotations

import copy

import torch

from miles_platform.errors import ConfigError


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla.modules.l2norm.l2norm: x / sqrt(sum x^2 + eps), as transformers' Qwen3.5 computes it."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def chunk_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_unused,
):  # fmt: skip
    """fla.ops.gated_delta_rule.chunk_gated_delta_rule over [B, T, heads, dim] rows (no packed sequences)."""
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

    if cu_seqlens is not None:
        raise NotImplementedError("the CPU chunk_gated_delta_rule takes padded rows, not packed sequences")
    if scale is not None and scale != q.shape[-1] ** -0.5:
        raise NotImplementedError(f"the CPU chunk_gated_delta_rule scales q by 1/sqrt(dim) only, not {scale}")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state
    )


def fla_available() -> bool:
    try:
        import fla  # noqa: F401
    except ImportError:
        return False
    return True


def install_cpu_fla() -> bool:
    """Give megatron's GatedDeltaNet the torch `fla` functions (no real fla, no CUDA). True when installed."""
    if fla_available():
        return False
    from megatron.core.ssm import gated_delta_net as gdn

    gdn.HAVE_FLA = True
    gdn.l2norm = l2norm
    gdn.chunk_gated_delta_rule = chunk_gated_delta_rule
    return True


def check_fla(device: torch.device) -> None:
    """A GatedDeltaNet model on CUDA needs flash-linear-attention (megatron's kernels); the CPU has the torch one."""
    if device.type == "cuda" and not fla_available():
        raise ConfigError(
            "gated-DeltaNet layers (Qwen3.5 / Qwen3-Next) on --train-backend megatron with CUDA need flash-linear-attention "
            "(`pip install .[gpu]`, or flash-linear-attention==0.5.2); or use --train-backend fsdp"
        )


class GatedOutNorm(torch.nn.Module):
    """GatedDeltaNet's output RMSNorm: x * w (HF's Qwen3_5RMSNormGated weight), never zero-centered."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # replicated over TP, but each TP rank normalizes its own value heads: its gradient is a partial sum,
        # which megatron's finalize_model_grads sums over TP for weights so marked under sequence parallelism
        # (Qwen35Bridge.layout_refusal: Qwen3.5 at TP > 1 needs --sequence-parallel)
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight, self.eps)


def gdn_layer_spec(layer_spec, use_te: bool):
    """A copy of a GPT layer spec with megatron's GatedDeltaNet as its token mixer. Local spec: the layer keeps
    its input_layernorm and in_proj is a ColumnParallelLinear; TE: the norm is fused into in_proj."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.deepcopy(layer_spec)
    if use_te:
        from megatron.core.extensions.transformer_engine import (
            TELayerNormColumnParallelLinear,
            TERowParallelLinear,
        )

        in_proj, out_proj = TELayerNormColumnParallelLinear, TERowParallelLinear
        spec.submodules.input_layernorm = IdentityOp
    else:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        in_proj, out_proj = ColumnParallelLinear, RowParallelLinear
    spec.submodules.self_attention = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=in_proj, out_norm=GatedOutNorm, out_proj=out_proj),
    )
    return spec
