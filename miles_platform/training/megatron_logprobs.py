"""Log-probs, entropy and candidate log-probs from vocab-parallel logits, without gathering the vocabulary.

Under tensor parallelism the output layer leaves each TP rank the logits of its slice of the
(padded) vocabulary, [B, T, V / TP]. Every quantity the loss hub reads is a per-position reduction
over the vocabulary, so each rank reduces its slice and the TP group sums the partial results
(a max for numerical stability, then sums): log softmax(z / T)[target], its entropy, and
log-probs at K recorded ids (sampling-support replay, score centering), with the same formulas as
`loss.token_log_probs` / `loss.candidate_log_probs` (which the 1-rank path uses on full logits).

Gradients: the loss is computed identically on every TP rank (a replicated loss, as megatron's
own vocab-parallel cross entropy), so each cross-rank sum is the identity in backward (megatron's
`reduce_from_tensor_model_parallel_region`): rank r's logits get exactly d loss / d z_r, and the
output layer's input gradient is summed over TP by its column-parallel mapping. That holds as long
as every summed quantity is a function of this rank's slice alone (and the replicated, detached
max): the entropy is lse - sum(e z) / sum(e), not sum(softmax * z) over a reduced denominator. Miles uses
megatron's fused vocab-parallel cross entropy for the log-probs and a custom autograd function for
the entropy; this is one differentiable formulation for both, on any device.

Padded vocabulary rows (zeros up to a multiple of lcm(128, TP)) are masked out: they are not tokens.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from miles_platform.training.backend import ScoreRequest, Scores


class _SumOverGroup(torch.autograd.Function):
    """All-reduce sum in forward, identity in backward (the loss downstream is replicated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class VocabShard:
    """This rank's slice [start, start + width) of the vocabulary and its TP group."""

    def __init__(self, width: int, vocab_size: int, rank: int, size: int, group):
        self.start, self.width, self.vocab_size = rank * width, width, vocab_size
        self.size, self.group = size, group

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else _SumOverGroup.apply(x, self.group)

    def max(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().clone()
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def real_columns(self, device) -> torch.Tensor | None:
        """[width] bool: columns that are tokens (None: all are)."""
        if self.start + self.width <= self.vocab_size:
            return None
        return torch.arange(self.start, self.start + self.width, device=device) < self.vocab_size

    def pick(self, z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """z[..., ids] for global token ids (any shape [..., K]); ids < 0 read 0. Summed over ranks:
        the owner contributes the value (and takes its gradient), the others 0."""
        local = ids - self.start
        owned = (local >= 0) & (local < self.width) & (ids >= 0)
        got = z.gather(-1, local.clamp(0, self.width - 1))
        return self.sum(torch.where(owned, got, torch.zeros_like(got)))


def vocab_parallel_scores(
    logits: torch.Tensor, req: ScoreRequest, shard: VocabShard, following: bool = False
) -> Scores:
    """`Scores` of positions 0..T-2 from this rank's vocab slice [B, T, V / TP] (see module docstring);
    `following`: of every position, `req.input_ids` holding the token after each (`scores_from_logits`)."""
    z = (logits if following else logits[:, :-1]).float()
    targets = req.input_ids if following else req.input_ids[:, 1:]
    if req.temperature != 1.0:
        z = z / req.temperature
    real = shard.real_columns(z.device)  # padding columns: no probability mass, no gradient
    zmax = z.detach() if real is None else z.detach().masked_fill(~real, float("-inf"))
    m = shard.max(zmax.max(dim=-1, keepdim=True).values)
    e = torch.exp(z - m)
    if real is not None:
        e = e * real
    s = shard.sum(e.sum(-1, keepdim=True))
    lse = (m + s.log()).squeeze(-1)
    picked = shard.pick(z, targets.unsqueeze(-1)).squeeze(-1)
    ent = None
    no_grad = contextlib.nullcontext() if req.entropy_grad else torch.no_grad()  # observed only
    if req.with_entropy:
        # H = lse - sum(e z) / s with both sums reduced from this rank's slice alone: a reduced value
        # (s) must not feed another rank-local sum, or backward would miss the other ranks' terms
        with no_grad:
            ent = lse - (shard.sum((e * z).sum(-1, keepdim=True)) / s).squeeze(-1)
    lse_used = lse
    if req.support is not None:  # sampling-support replay: the softmax over the recorded ids
        valid = req.support >= 0
        zs = shard.pick(z, req.support)
        has = valid[..., 0]
        # rows without a support get a finite dummy (their lse is not used): no NaN in backward
        pad = torch.where(has, float("-inf"), 0.0).unsqueeze(-1)
        lse_s = torch.logsumexp(torch.where(valid, zs, pad), dim=-1)
        lse_used = torch.where(has, lse_s, lse)
        if req.with_entropy:
            with no_grad:
                ps = torch.exp(zs - lse_s.unsqueeze(-1)) * valid
                ent = torch.where(has, lse_s - (ps * zs).sum(-1), ent)
    cand = None
    if req.candidates is not None:
        got = shard.pick(z, req.candidates) - lse_used.unsqueeze(-1)
        cand = got.masked_fill(req.candidates < 0, 0.0)
    return Scores(picked - lse_used, ent, cand)
