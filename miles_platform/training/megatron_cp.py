"""Context parallelism (`--context-parallel-size`) on megatron's local layer spec, without
transformer-engine.

megatron-core's own attention for the local spec (`DotProductAttention`) asserts CP == 1 ("Context
parallelism is only supported by TEDotProductAttention!"); TE's does CP with its ring / all-gather
kernels. Here:

- Layout: megatron's load-balanced zigzag. A micro-batch's width (padded to a multiple of 2 x CP, and
  of TP under sequence parallelism) is cut into 2 x CP chunks; CP rank r holds chunks r and
  2CP - 1 - r, so every rank gets as much of the causal triangle. megatron's RoPE already slices its
  position table so (`get_pos_emb_on_this_cp_rank`), given the full width.
- Attention (`ContextParallelAttention`): megatron's DotProductAttention arithmetic over keys and
  values all-gathered from the CP group (forward all-gather, backward reduce-scatter: each rank's
  K/V gradient sums every rank's queries' use of it), with the causal mask of the tokens' global
  positions. The gathered K/V cost CP x the local ones (TE's ring attention exchanges them in
  steps instead; the same result).
- Scores (`context_parallel_scores`): each CP rank scores its own positions (log-probs of the next
  token, entropy, candidates) from its vocab-parallel logits; the per-position scores are
  all-gathered and put back in sequence order, so the loss hub sees whole samples on every CP rank
  (Miles gathers log-probs over CP as well). The gather's backward hands each rank the gradient of
  its own positions only: the loss is replicated over the CP group, each rank's backward covers its
  tokens, and the schedule's CP factor with DDP's average over data x context parallel ranks adds
  the ranks' parts up (megatron_step).
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


def _cp() -> tuple[int, int, object]:
    from megatron.core import parallel_state as ps

    return (ps.get_context_parallel_rank(), ps.get_context_parallel_world_size(),
            ps.get_context_parallel_group())  # fmt: skip


def zigzag_slice(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """CP rank `rank`'s chunks (rank, 2CP - 1 - rank) of `x` cut into 2 x CP along `dim`."""
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim)


def zigzag_positions(width: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of CP rank `rank`'s tokens of a micro-batch `width` wide."""
    return zigzag_slice(torch.arange(width, device=device), 0, cp, rank)


def unzigzag(x: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """Every rank's chunks, concatenated in rank order along `dim`, back in sequence order."""
    parts = x.chunk(2 * cp, dim)  # rank r: parts 2r (its chunk r) and 2r + 1 (its chunk 2CP - 1 - r)
    order = [None] * (2 * cp)
    for r in range(cp):
        order[r], order[2 * cp - 1 - r] = parts[2 * r], parts[2 * r + 1]
    return torch.cat(order, dim)


def local_tokens(ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, W] token ids and positions -> this CP rank's [B, W / CP] (W a multiple of 2 x CP)."""
    rank, cp, _ = _cp()
    return zigzag_slice(ids, 1, cp, rank), zigzag_slice(pos, 1, cp, rank)


class ContextParallelAttention(DotProductAttention):
    """The local spec's core attention under CP (see the module docstring). It takes the same
    constructor arguments as DotProductAttention; the inner arithmetic runs on a copy of the config
    at CP 1, with an arbitrary-mask softmax (its causal kernel assumes square masks)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, *args, **kwargs):
        local = dataclasses.replace(config, context_parallel_size=1)
        super().__init__(local, layer_number, AttnMaskType.padding, attention_type, *args, **kwargs)
        self.causal = attn_mask_type == AttnMaskType.causal

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        rank, cp, group = _cp()
        key = gather_from_sequence_parallel_region(key.contiguous(), True, group)
        value = gather_from_sequence_parallel_region(value.contiguous(), True, group)
        width = query.shape[0] * cp
        q_pos = zigzag_positions(width, cp, rank, query.device)
        k_pos = torch.cat([zigzag_positions(width, cp, r, query.device) for r in range(cp)])
        mask = None
        if self.causal:  # True: masked (a key after the query)
            mask = (k_pos[None, :] > q_pos[:, None])[None, None]
        return super().forward(query, key, value, mask, attn_mask_type, attention_bias, packed_seq_params)


def gather_positions(x: torch.Tensor) -> torch.Tensor:
    """[B, W / CP, ...] scores of this rank's positions -> [B, W, ...] in sequence order on every CP
    rank; backward keeps this rank's positions' gradient (module docstring)."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    _, cp, group = _cp()
    seq_first = x.transpose(0, 1).contiguous()
    full = gather_from_sequence_parallel_region(seq_first, False, group)
    return unzigzag(full, 0, cp).transpose(0, 1)


def _positions_padded(x: torch.Tensor | None, width: int, fill) -> torch.Tensor | None:
    """[B, T - 1, K] per-position ids -> [B, width, K] (`fill` after), this rank's zigzag slice."""
    if x is None:
        return None
    rank, cp, _ = _cp()
    x = torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[1]), value=fill)
    return zigzag_slice(x, 1, cp, rank)


def context_parallel_scores(out: torch.Tensor, req, score_positions):
    """`Scores` [B, T - 1] of a request from this CP rank's logits `out` [B, W / CP, V'] (its zigzag
    positions of the padded width W). `score_positions(logits, local_req)` scores every position of
    `logits` against `local_req.input_ids`, the token that follows each position."""
    from miles_platform.training.backend import Scores

    rank, cp, _ = _cp()
    rows, t = req.input_ids.shape
    width = out.shape[1] * cp
    following = torch.nn.functional.pad(req.input_ids[:, 1:], (0, width - t + 1))  # [B, W]
    local = dataclasses.replace(
        req,
        input_ids=zigzag_slice(following, 1, cp, rank),
        support=_positions_padded(req.support, width, -1),
        candidates=_positions_padded(req.candidates, width, -1),
    )
    got = score_positions(out, local)
    return Scores(*(None if s is None else gather_positions(s)[:, : t - 1] for s in got))
