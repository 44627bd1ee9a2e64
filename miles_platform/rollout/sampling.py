"""The one token sampler: temperature, top-k, top-p, min-p and a seeded draw, vectorized over a batch.

Every row's draw comes from a counter-based generator keyed by (its seed, the absolute position of
the token in the sequence: prompt + response so far), so a seeded request gives the same tokens
whatever else shares its batch, and a request continued from its own partial response (the prompt
and the partial response as input, --partial-rollout) draws what the uninterrupted one would; the
whole batch is sampled with a handful of tensor ops instead of one `torch.multinomial` and one
`torch.Generator` per row. Greedy rows (temperature 0 or top_k 1) take the argmax.

The draw is inverse-CDF sampling: u ~ U[0, 1) from splitmix64(seed, step), the token is the first
index whose cumulative probability exceeds u * total. Masked tokens (probability 0) are never drawn.

Everything runs where the logits are (the engine's device); the uniforms are computed on the host
(exact uint64 arithmetic) and copied once; tokens and log-probs come back as Python lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def _on(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row sampling parameters as a tensor where the logits are."""
    return torch.tensor(values, dtype=dtype, device=device)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor):
    """Mask (to -inf) what top-k / top-p / min-p remove, per row, in the original vocab order (so a
    row's draw is the same whether or not its batch mates needed filtering)."""
    lg, order = logits.sort(dim=-1, descending=True)
    probs = lg.softmax(-1)
    vocab = lg.shape[-1]
    ks = torch.where(top_k > 0, top_k, vocab)
    remove = torch.arange(vocab, device=logits.device)[None, :] >= ks[:, None]
    remove |= (probs.cumsum(-1) - probs) > top_p[:, None]
    remove |= probs < min_p[:, None] * probs[:, :1]
    return logits.masked_fill(torch.zeros_like(remove).scatter(1, order, remove), float("-inf"))


@dataclass
class Draw:
    """One sampling step for a batch: the tokens and what the trainer needs to replay the step.

    `logprobs[i]`: log softmax(logits / T) of the drawn token over the full vocabulary (SGLang's
    default, SGLANG_RETURN_ORIGINAL_LOGPROB=0; greedy rows score at T = 1, as SGLang does).
    `supports[i]` (rows that asked): the ascending token ids left after top-k / top-p / min-p,
    the set the token was drawn from; `support_logprobs[i]`: the drawn token's log-prob
    renormalized over that support; `support_row_logprobs[i]`: every support id's, in the order of
    `supports[i]` (SGLang's sampling_logprobs_mode "support"). A greedy row's support is its argmax
    alone (log-prob 0)."""

    tokens: list[int]
    logprobs: list[float]
    supports: list[list[int] | None]
    support_logprobs: list[float | None]
    support_row_logprobs: list[list[float] | None] | None = None


def draw(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_p: Sequence[float],
    top_k: Sequence[int],
    min_p: Sequence[float],
    seeds: Sequence[int],
    steps: Sequence[int],
    want_support: Sequence[bool] | None = None,
) -> Draw:
    """Next token per row of fp32 `logits` [B, V]; each sequence argument has one entry per row."""
    n, dev = logits.shape[0], logits.device
    temp = _on(temperature, torch.float32, dev)
    tk = _on(top_k, torch.long, dev)
    scaled = logits / torch.where(temp > 0, temp, torch.ones_like(temp))[:, None]
    out = logits.argmax(dim=-1)
    rows = ((temp > 0) & (tk != 1)).nonzero().flatten()
    r = rows.tolist()
    lg = None
    if r:
        lg = scaled[rows]
        tp = _on([top_p[i] for i in r], torch.float32, dev)
        mp = _on([min_p[i] for i in r], torch.float32, dev)
        if bool((tk[rows] > 0).any() or (tp < 1).any() or (mp > 0).any()):
            lg = filter_logits(lg, tk[rows], tp, mp)
        cdf = lg.softmax(-1).double().cumsum(-1)
        u = uniforms([seeds[i] for i in r], [steps[i] for i in r]).to(dev) * cdf[:, -1]
        pick = torch.searchsorted(cdf, u[:, None], right=True)
        last = (cdf < cdf[:, -1:]).sum(-1, keepdim=True)  # first index reaching the total: never masked
        out[rows] = torch.minimum(pick, last)[:, 0]
    tokens = out.tolist()
    logprobs = torch.log_softmax(scaled, dim=-1).gather(1, out[:, None])[:, 0].tolist()
    supports: list[list[int] | None] = [None] * n
    support_lps: list[float | None] = [None] * n
    row_lps: list[list[float] | None] = [None] * n
    if want_support is not None and any(want_support):
        where = {row: j for j, row in enumerate(r)}
        for i in range(n):
            if not want_support[i]:
                continue
            if i not in where:  # greedy: the argmax alone
                supports[i], support_lps[i], row_lps[i] = [tokens[i]], 0.0, [0.0]
                continue
            row = lg[where[i]]
            keep = torch.isfinite(row)
            ids = keep.nonzero().flatten()
            lps = row[ids] - torch.logsumexp(row[ids], dim=-1)
            supports[i], row_lps[i] = ids.tolist(), lps.tolist()
            support_lps[i] = float(row[tokens[i]] - torch.logsumexp(row[keep], dim=-1))
    return Draw(tokens, logprobs, supports, support_lps, row_lps)


def sample_tokens(logits, temperature, top_p, top_k, min_p, seeds, steps) -> torch.Tensor:
    """The drawn tokens alone, as a LongTensor (see `draw`)."""
    return torch.tensor(draw(logits, temperature, top_p, top_k, min_p, seeds, steps).tokens, dtype=torch.long)
