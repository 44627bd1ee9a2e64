"""Multi-latent attention (DeepSeek-V3, models/bridge/deepseek_v3.py) on megatron's local layer spec.

megatron-core 0.16's MLA builds its core attention with `k_channels` (nope + rope head dim) and
`v_channels` (v head dim), which transformer-engine's attention takes and the local spec's
`DotProductAttention` does not (TypeError). Its arithmetic already handles keys wider than values
(scores over the key width, context over the value width, `kv_channels` x heads wide: the bridge
sets `kv_channels` to the value head dim), and MLA hands it its softmax scale (1 / sqrt(q head dim),
times yarn's mscale squared); so `MLADotProductAttention` is DotProductAttention taking the two
widths and checking them against that.

The latent down projections (`linear_q_down_proj`, `linear_kv_down_proj`) are `DuplicatedLinear`: the
whole weight on every TP rank, as TE's spec builds them (`TELinear(parallel_mode="duplicated")`). The
local spec's own choice, a ColumnParallelLinear whose output MLA gathers, gets one gradient wrong at
TP > 1: the rope key (`k_pos_emb`, one per token, shared by every head) is cut from the gathered output,
each TP rank's heads give it a partial gradient, and the gather's backward keeps each rank's own columns
without summing them (measured: a TP2 + SP step's gradients 1e-5..8e-3 off the 1-rank step's, embeddings
worst). On the duplicated branch MLA gathers `k_pos_emb` from the sequence-parallel region, whose
backward reduce-scatters, i.e. sums the heads' partial gradients: so TP > 1 needs --sequence-parallel
(`DeepseekV3Bridge.layout_refusal`). Under SP each rank projects its slice of the sequence: the weight's
gradient is a partial sum, marked `sequence_parallel` for megatron's finalize_model_grads to sum over TP.
MLA passes `parallel_mode="duplicated"` only to the class its module knows as `TELinear`, which without
transformer-engine is a MagicMock instance: `install_duplicated_linear` names this class there.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


class DuplicatedLinear(torch.nn.Module):
    """A linear layer whose whole weight every TP rank holds, with megatron's linear constructor and
    `(output, bias)` result (see the module docstring)."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 skip_bias_add: bool = False, parallel_mode: str = "duplicated", **_unused):  # fmt: skip
        super().__init__()
        if parallel_mode != "duplicated" or bias:
            raise ValueError(
                f"DuplicatedLinear: MLA's down projections are duplicated and unbiased (got {parallel_mode}, bias={bias})"
            )
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            with torch.no_grad():
                init_method(self.weight)
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor):
        return torch.nn.functional.linear(x, self.weight), None


def install_duplicated_linear() -> None:
    """MLA's module names `DuplicatedLinear` as its `TELinear` when transformer-engine is absent."""
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):  # a mock: TE's real class is kept
        multi_latent_attention.TELinear = DuplicatedLinear


def duplicated_down_projections(spec):
    """The local layer spec with MLA's down projections duplicated (a copy)."""
    import copy

    spec = copy.deepcopy(spec)
    attention = spec.submodules.self_attention.submodules
    attention.linear_q_down_proj = attention.linear_kv_down_proj = DuplicatedLinear
    return spec


class MLADotProductAttention(DotProductAttention):
    """megatron's local DotProductAttention, built by MLA (`k_channels` / `v_channels`)."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None and v_channels != self.config.kv_channels:
            raise ValueError(
                f"MLA core attention: v_channels {v_channels} != kv_channels {self.config.kv_channels} "
                "(the bridge sets kv_channels to v_head_dim: the context is heads x v_head_dim wide)"
            )
        self.k_channels = k_channels
