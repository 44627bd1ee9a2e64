"""DeepSeek sparse attention (DeepSeek-V3.2, models/bridge/deepseek_v32.py) on megatron-core's MLA.

megatron-core 0.16's `DSAttention` (experimental_attention_variant "dsa") is the core attention of an
MLA layer: its `DSAIndexer` scores every preceding token from the layer input `x` and the normalized
query latent `qr` (ReLU'd q . k per indexer head, weighted by `weights_proj(x)`, summed), keeps the top
`index_topk` per query, and the attention runs over those keys only (`unfused_dsa_fn`: the other
scores at -inf, then the causal mask). `dsa_layer_spec` puts it into the bridge's MLA layer spec:

- The indexer's linears are duplicated on every TP rank (its inputs are gathered over the sequence
  first): `DuplicatedLinear` on the local spec (training/megatron_mla.py), TE's duplicated TELinear on
  a GPU. `k_norm` is a LayerNorm with a bias (`IndexerLayerNorm`: the local spec's norm class is
  swapped for our RMSNorm everywhere, megatron_parallel.stage_block_spec).
- The indexer reads `qr` as MLA hands it over: after `q_layernorm` on the local spec. TE's MLA spec
  fuses that norm into `linear_q_up_proj` (its `q_layernorm` an IdentityOp), so there `qr` would be the
  latent before its norm, which neither DeepSeek's reference nor transformers' model feeds the
  indexer; on TE the norm stays apart (`TENorm` + `TEColumnParallelLinear`), and the bridge names it
  `q_layernorm` on both specs.
- `rotate_activation` (a Hadamard transform of the indexer's q and k, CUDA + bf16 only in megatron) is
  the identity here, as in transformers' DeepseekV32Indexer: the transform is orthogonal, so
  q . k is unchanged; DeepSeek applies it ahead of the fp8 index kernel, which neither side runs.
- The indexer is frozen and computes no loss (`DSAttentionFrozenIndexer`), as Miles' native DSA at
  `--dsa-indexer-loss-coeff 0` (its default): the top-k is an integer choice, so the language-model
  loss gives the indexer no gradient (transformers runs it under no_grad), and a zero-gradient
  parameter would still decay under AdamW. megatron's auxiliary KL loss would need the full
  attention matrix of every head; it is not built (no flag takes a coefficient here).

Context parallelism is refused by megatron-core for DSA (and by the bridge, first); packed sequences
are not used by this trainer (right-padded rows with a causal mask).
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.experimental_attention_variant import dsa

INDEXER_NORM_EPS = 1e-6  # DeepSeek's reference and transformers' indexer LayerNorm, whatever rms_norm_eps is


class IndexerLayerNorm(torch.nn.Module):
    """torch.nn.LayerNorm's arithmetic (weight and bias) with megatron's norm constructor; the epsilon
    is the indexer's own (megatron passes the model's RMSNorm epsilon)."""

    def __init__(self, config, hidden_size: int, eps: float = INDEXER_NORM_EPS, **_unused):
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = INDEXER_NORM_EPS
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class DSAttentionFrozenIndexer(dsa.DSAttention):
    """megatron's DSAttention with its indexer frozen and no indexer loss (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config.dsa_indexer_loss_coeff:
            raise ValueError("the DSA indexer loss is not built here: dsa_indexer_loss_coeff must be 0")
        for p in self.indexer.parameters():
            p.requires_grad_(False)

    def forward(self, *args, **kwargs):
        training = self.training  # DSAttention computes the indexer's KL loss when training
        self.training = False
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.training = training


def _identity_rotation(x: torch.Tensor) -> torch.Tensor:
    return x


def install_identity_rotation() -> None:
    """megatron's indexer rotation as transformers' (none: see the module docstring)."""
    dsa.rotate_activation = _identity_rotation


def dsa_layer_spec(spec, use_te: bool):
    """A copy of an MLA layer spec with DSA as its core attention (the module docstring)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    install_identity_rotation()
    spec = copy.deepcopy(spec)
    attention = spec.submodules.self_attention.submodules
    if use_te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TELinear, TENorm

        linear = TELinear
        attention.linear_q_up_proj, attention.q_layernorm = TEColumnParallelLinear, TENorm
    else:
        from miles_platform.training.megatron_mla import DuplicatedLinear

        linear = DuplicatedLinear
    indexer = ModuleSpec(
        module=dsa.DSAIndexer,
        submodules=dsa.DSAIndexerSubmodules(
            linear_wq_b=linear, linear_wk=linear, k_norm=IndexerLayerNorm, linear_weights_proj=linear
        ),
    )
    attention.core_attention = ModuleSpec(
        module=DSAttentionFrozenIndexer, submodules=dsa.DSAttentionSubmodules(indexer=indexer)
    )
    return spec
