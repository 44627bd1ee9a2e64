"""Score centering (Miles' `--loss-type score_centering`; docs/algorithms.md, "Score centering").

An off-policy REINFORCE loss whose score is centered by its expectation under q, the distribution
that sampled, so a constant reward produces no average update even when q differs from the current
policy p. The expectation runs over the engine's recorded candidates H (its top K, or the whole
support under filtered sampling) and models the rest as q = rho * p:

  rho    = max(1 - sum q[H], 1e-6) / max(1 - sum p[H], 1e-6)
  alpha  = rho * f(1 / rho)
  loss_t = -A * ( sg(f(p[tok] / q[tok])) * log p[tok]
                  - sum_{h in H} sg(q[h] * f(p[h] / q[h]) - alpha * p[h]) * log p[h] )

The subtracted sum is E_q[f(p/q) grad log p]: over H the q-weighted scores, over the tail
alpha * sum_tail p grad log p = -alpha * sum_H p grad log p (the full score sums to zero). With
H the whole vocabulary it is exact. f (`--score-centering-is`): none 1; tis min(x, clip); mis x on
[low, high], else 0. q[tok] is the rollout log-prob of the sampled token (inside H or not); every
weight and coefficient is detached (computed in float64). p = softmax(logits / T), over the
recorded support in support mode.

Metrics (train/, averaged like the loss over loss-masked tokens):
  sc_correction          sum_h |q[h] f(p[h]/q[h]) - alpha p[h]|: the centering coefficients' L1
                         size per token (0 on-policy: q = p gives alpha = 1 and zero coefficients)
  sc_train_head_mass     sum p[H];   sc_rollout_head_mass  sum q[H]
  sc_tail_ratio          rho;        sc_importance_weight  f(p[tok] / q[tok])
  train_rollout_logprob_abs_diff   |log p[tok] - log q[tok]|
"""

from __future__ import annotations

from typing import Any

import torch

from miles_platform.config import ConfigError
from miles_platform.training.loss import add_regularizers, get_reducer

EPS = 1e-6
Tensors = list[torch.Tensor]


def importance_weight(x: torch.Tensor, args) -> torch.Tensor:
    """f of `--score-centering-is` applied to ratios x (inf allowed: none 1, tis clip, mis 0)."""
    mode = args.score_centering_is
    if mode == "none":
        return torch.ones_like(x)
    if mode == "tis":
        return x.clamp(max=args.score_centering_tis_clip)
    if mode == "mis":
        keep = (x >= args.score_centering_mis_low) & (x <= args.score_centering_mis_high)
        return torch.where(keep, x, torch.zeros_like(x))
    raise ConfigError(f"--score-centering-is {mode!r}: valid: none, tis, mis")


def centered_token_loss(
    args,
    log_p: torch.Tensor,
    log_q: torch.Tensor,
    cand_log_p: torch.Tensor,
    cand_log_q: torch.Tensor,
    cand_ids: torch.Tensor,
    advantages: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss of one sample -> (loss [n], per-token diagnostics [n]).

    log_p [n] and cand_log_p [n, K] carry grad (the trainer's log p at the sampled token and the
    candidates); log_q [n] and cand_log_q [n, K] are the engine's; cand_ids [n, K] marks unused slots
    with -1."""
    valid = cand_ids >= 0
    with torch.no_grad():
        lp, lq = log_p.detach().double(), log_q.double()
        clp, clq = cand_log_p.detach().double(), cand_log_q.double()
        p_h = torch.where(valid, clp.exp(), 0.0)
        q_h = torch.where(valid, clq.exp(), 0.0)
        head_p, head_q = p_h.sum(-1), q_h.sum(-1)
        rho = (1 - head_q).clamp_min(EPS) / (1 - head_p).clamp_min(EPS)
        alpha = rho * importance_weight(1 / rho, args)
        # q[h] = 0 contributes q[h] * f(.) = 0 whatever f(inf) is
        weighted_q = torch.where(q_h > 0, q_h * importance_weight((clp - clq).exp(), args), 0.0)
        coef = torch.where(valid, weighted_q - alpha[:, None] * p_h, 0.0)
        w_tok = importance_weight((lp - lq).exp(), args)
    centering = (coef.to(cand_log_p.dtype) * cand_log_p.masked_fill(~valid, 0.0)).sum(-1)
    loss = -advantages.detach() * (w_tok.to(log_p.dtype) * log_p - centering)
    stats = {
        "sc_correction": coef.abs().sum(-1),
        "sc_train_head_mass": head_p,
        "sc_rollout_head_mass": head_q,
        "sc_tail_ratio": rho,
        "sc_importance_weight": w_tok,
        "train_rollout_logprob_abs_diff": (lp - lq).abs(),
    }
    return loss, {k: v.float() for k, v in stats.items()}


def score_centering_loss(
    args, batch: dict[str, Any], log_probs: Tensors, entropy: Tensors | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """--loss-type score_centering on one micro-batch -> (loss, detached metrics).

    batch: "advantages", "rollout_log_probs", "loss_masks", "ref_log_probs" (optional), and the
    candidates: "rollout_topk_token_ids" / "rollout_topk_log_probs" (the engine's, [n, K] per
    sample) and "candidate_log_probs" (the trainer's log p at those ids, with grad; the actor adds
    them because this function sets `needs_candidate_log_probs`)."""
    if "candidate_log_probs" not in batch:
        raise ConfigError(
            "--loss-type score_centering: the batch has no candidate_log_probs (the trainer adds them "
            "for a loss with needs_candidate_log_probs; call it through TrainerActor)"
        )
    masks = [m.float() for m in batch["loss_masks"]]
    reduce = get_reducer(args)
    per_token, stats = [], {}
    for i, lp in enumerate(log_probs):
        loss_t, st = centered_token_loss(
            args, lp, batch["rollout_log_probs"][i], batch["candidate_log_probs"][i],
            batch["rollout_topk_log_probs"][i], batch["rollout_topk_token_ids"][i], batch["advantages"][i],
        )  # fmt: skip
        per_token.append(torch.where(masks[i] > 0, loss_t, torch.zeros_like(loss_t)))
        for k, v in st.items():
            stats.setdefault(k, []).append(torch.where(masks[i] > 0, v, torch.zeros_like(v)))
    pg_loss = reduce(per_token, masks)
    old = batch["rollout_log_probs"]  # q: --use-rollout-logprobs is required
    loss, reg = add_regularizers(args, pg_loss, log_probs, old, batch.get("ref_log_probs"), entropy, masks)
    metrics = {k: reduce(v, masks).detach() for k, v in stats.items()}
    metrics.update(pg_loss=pg_loss.detach(), **reg, loss=loss.detach())
    return loss, metrics


score_centering_loss.needs_candidate_log_probs = True  # the actor hands "candidate_log_probs" (above)


# ---------------------------------------------------------------------------- the trainer's side


def rollout_candidates(batch, i: int, k: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Sample i of a TrainBatch: its recorded candidates as ([n, K] ids, [n, K] log-probs) on
    `device`, checked (one row of K per response token, no repeated id). A sample with nothing
    trained may lack them."""
    n = batch.response_lengths[i]
    ids = (batch.rollout_topk_token_ids or [None] * len(batch))[i]
    lps = (batch.rollout_topk_log_probs or [None] * len(batch))[i]
    how = (
        "the rollout must record the engine's candidates of the generating call (the default rollout "
        "and the single_turn / multi_turn generate functions do; a custom producer posts "
        "generate_hub.endpoint.request_payload's body and records with append_output)"
    )
    if ids is None or lps is None:
        if any(batch.loss_masks[i]):
            raise ValueError(f"--loss-type score_centering: sample {i} has no rollout_topk_token_ids; {how}")
        return (
            torch.full((n, k), -1, dtype=torch.long, device=device),
            torch.full((n, k), float("-inf"), device=device),
        )
    widths = {len(r) for r in ids} | {len(r) for r in lps}
    if len(ids) != n or len(lps) != n or widths - {k}:
        raise ValueError(
            f"--loss-type score_centering: sample {i} has {len(ids)} / {len(lps)} candidate rows of "
            f"widths {sorted(widths)} for {n} response tokens and --rollout-top-logprobs-num {k}; {how}"
        )
    ids_t = torch.tensor(ids, dtype=torch.long).reshape(n, k)
    lps_t = torch.tensor(lps, dtype=torch.float32).reshape(n, k)
    s = ids_t.sort(-1).values
    if bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()):
        raise ValueError(f"--loss-type score_centering: sample {i} repeats a candidate id within a row")
    return ids_t.to(device), lps_t.to(device)
