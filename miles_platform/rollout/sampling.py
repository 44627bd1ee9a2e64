"""The one token sampler: temperature, top-k, top-p, min-p and a seeded draw, vectorized over a batch.

Every row's draw comes from a counter-based generator keyed by (its seed, its position in the
response), so a seeded request gives the same tokens whatever else shares its batch, and the
whole batch is sampled with a handful of tensor ops instead of one `torch.multinomial` and one
`torch.Generator` per row. Greedy rows (temperature 0 or top_k 1) take the argmax.

The draw is inverse-CDF sampling: u ~ U[0, 1) from splitmix64(seed, step), the token is the first
index whose cumulative probability exceeds u * total. Masked tokens (probability 0) are never drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def uniforms(seeds: Sequence[int], steps: Sequence[int]) -> torch.Tensor:
    """One U[0, 1) float64 per (seed, step), from splitmix64's finalizer (wrapping uint64 math)."""
    s = np.asarray(seeds, dtype=np.uint64)
    z = s * _GOLDEN + (np.asarray(steps, dtype=np.uint64) + np.uint64(1)) * _M2
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    z = z ^ (z >> np.uint64(31))
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)))


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor):
    """Mask (to -inf) what top-k / top-p / min-p remove, per row, in the original vocab order (so a
    row's draw is the same whether or not its batch mates needed filtering)."""
    lg, order = logits.sort(dim=-1, descending=True)
    probs = lg.softmax(-1)
    vocab = lg.shape[-1]
    ks = torch.where(top_k > 0, top_k, vocab)
    remove = torch.arange(vocab)[None, :] >= ks[:, None]
    remove |= (probs.cumsum(-1) - probs) > top_p[:, None]
    remove |= probs < min_p[:, None] * probs[:, :1]
    return logits.masked_fill(torch.zeros_like(remove).scatter(1, order, remove), float("-inf"))


def sample_tokens(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_p: Sequence[float],
    top_k: Sequence[int],
    min_p: Sequence[float],
    seeds: Sequence[int],
    steps: Sequence[int],
) -> torch.Tensor:
    """Next token per row of fp32 `logits` [B, V]; each sequence argument has one entry per row."""
    out = logits.argmax(dim=-1)
    temp = torch.tensor(temperature, dtype=torch.float32)
    tk = torch.tensor(top_k, dtype=torch.long)
    rows = ((temp > 0) & (tk != 1)).nonzero().flatten()
    if not len(rows):
        return out
    r = rows.tolist()
    lg = logits[rows] / temp[rows, None]
    tp = torch.tensor([top_p[i] for i in r], dtype=torch.float32)
    mp = torch.tensor([min_p[i] for i in r], dtype=torch.float32)
    if bool((tk[rows] > 0).any() or (tp < 1).any() or (mp > 0).any()):
        lg = filter_logits(lg, tk[rows], tp, mp)
    cdf = lg.softmax(-1).double().cumsum(-1)
    u = uniforms([seeds[i] for i in r], [steps[i] for i in r]) * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None], right=True)
    last = (cdf < cdf[:, -1:]).sum(-1, keepdim=True)  # first index reaching the total: never masked
    out[rows] = torch.minimum(pick, last)[:, 0]
    return out
