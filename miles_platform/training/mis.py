"""Masked importance sampling (MIS): Miles' rollout-correction helper (its example `mis.py`).

Selected by any of its flags (--tis-level, --tis-mode, --tis-lower-bound, --tis-upper-bound,
--use-rs, --rs-level, --rs-lower-bound, --rs-upper-bound, --rs-veto-threshold,
--tis-batch-normalize), by Miles' dotted path
`examples.infra_features.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp` (or
`..._fsdp`), or by --get-mismatch-metrics alone (metrics only, the loss unchanged).

Per sample, with d_t = log pi_train(y_t) - log pi_rollout(y_t) over its loss tokens:
  level   token: d_t; sequence: sum of d; geometric: mean of d; clamped to [-20, 20], then exp
  IS      truncate: min(w, upper); clip: clamp(w, lower, upper); mask: w kept, tokens outside
          [lower, upper] rejected (lower defaults to 1 / upper when unset)
  RS      (--use-rs) tokens (or sequences) whose weight at --rs-level lies outside
          [--rs-lower-bound, --rs-upper-bound] (default: the IS bounds) are rejected;
          --rs-veto-threshold rejects a whole sequence holding a token with d_t < log(threshold)
  norm    --tis-batch-normalize divides every weight by the batch's mean weight (token or
          sequence mean, as --tis-level)
Rejected tokens leave the loss numerator; the denominators stay the sample's loss-token count.
Metrics (per token, reduced like the loss, `mis_` prefix): the mismatch set always
(training/rollout log-ppl and ppl, kl, k3_kl, log_ppl_diff, log_ppl_abs_diff, ppl_ratio,
chi2_token, chi2_seq) and, with --use-tis, the weights before / after bounding, the fraction
truncated / clipped / masked, the RS fractions, the veto fractions, batch_norm_factor and the
final weights' mean / min / max.
"""

from __future__ import annotations

import math
from typing import Any

import torch

Tensors = list[torch.Tensor]
SAFETY_BOUND = 20.0  # exp(20) is finite in fp32


def _sum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x * m).sum()


def _mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return _sum(x, m) / m.sum().clamp_min(1)


def _level_log_ratio(d: torch.Tensor, m: torch.Tensor, level: str) -> torch.Tensor:
    if level == "token":
        return d
    if level == "sequence":
        return _sum(d, m).expand_as(d)
    if level == "geometric":
        return _mean(d, m).expand_as(d)
    raise ValueError(f"IS level {level!r}: valid: token, sequence, geometric")


def _safe_exp(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()


def _ppl_metrics(train: torch.Tensor, rollout: torch.Tensor, m: torch.Tensor, out: dict) -> None:
    def add(key, v):
        out.setdefault(key, []).append(v.expand_as(train) if v.dim() == 0 else v)

    lp_train, lp_roll = _mean(train, m), _mean(rollout, m)
    add("training_log_ppl", -lp_train)
    add("training_ppl", (-lp_train).exp())
    add("rollout_log_ppl", -lp_roll)
    add("rollout_ppl", (-lp_roll).exp())
    add("kl", rollout - train)
    d = train - rollout
    add("k3_kl", _safe_exp(d) - d - 1)
    diff = lp_roll - lp_train
    add("log_ppl_diff", diff)
    add("log_ppl_abs_diff", diff.abs())
    add("ppl_ratio", _safe_exp(diff))
    add("chi2_token", _mean(_safe_exp(d) ** 2, m) - 1.0)
    add("chi2_seq", _safe_exp(2.0 * _sum(d, m).clamp(-SAFETY_BOUND, SAFETY_BOUND)) - 1.0)


def _bound(
    args, w: torch.Tensor, m: torch.Tensor, lower: float, out: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """--tis-mode on weights w -> (weights, the sample's mask after IS rejection)."""
    mode, upper = args.tis_mode, args.tis_upper_bound
    add = lambda key, v: out.setdefault(key, []).append(v)  # noqa: E731
    if mode == "truncate":
        add("tis_truncate_fraction", (w > upper).float())
        return w.clamp(0, upper) * m, m
    if mode == "clip":
        add("tis_clip_fraction_low", (w < lower).float())
        add("tis_clip_fraction_high", (w > upper).float())
        return w.clamp(lower, upper) * m, m
    if mode == "mask":
        add("tis_mask_fraction_low", (w < lower).float())
        add("tis_mask_fraction_high", (w > upper).float())
        return w * m, m * ((w >= lower) & (w <= upper)).float()
    raise ValueError(f"--tis-mode {mode!r}: valid: truncate, clip, mask")


def compute_mis_weights(
    args, *, train_log_probs: Tensors, rollout_log_probs: Tensors, loss_masks: Tensors
) -> tuple[Tensors | None, Tensors, dict[str, Tensors]]:
    """-> (weights per sample or None without --use-tis, masks after rejection, metrics: per key a
    per-token tensor per sample). Inputs are per-sample 1-D tensors of the same length."""
    metrics: dict[str, Tensors] = {}
    add = lambda key, v: metrics.setdefault(key, []).append(v)  # noqa: E731
    tis_lower = args.tis_lower_bound if args.tis_lower_bound is not None else 1.0 / args.tis_upper_bound
    rs_lower = args.rs_lower_bound if args.rs_lower_bound is not None else tis_lower
    rs_upper = args.rs_upper_bound if args.rs_upper_bound is not None else args.tis_upper_bound
    masks = [m.float() for m in loss_masks]
    for tr, ro, m in zip(train_log_probs, rollout_log_probs, masks, strict=True):
        if not tr.shape == ro.shape == m.shape:
            raise ValueError(
                f"MIS: shapes differ: train {tuple(tr.shape)}, rollout {tuple(ro.shape)}, mask {tuple(m.shape)}"
            )
        _ppl_metrics(tr.float(), ro.float(), m, metrics)
    if not args.use_tis:
        return None, masks, metrics
    weights, kept = [], []
    for tr, ro, m in zip(train_log_probs, rollout_log_probs, masks, strict=True):
        d = torch.where(m > 0, tr.float() - ro.float(), 0.0)
        log_w = _level_log_ratio(d, m, args.tis_level)
        w = _safe_exp(log_w)
        add("tis_weight_before_bound", w)
        w, keep = _bound(args, w, m, tis_lower, metrics)
        add("tis_weight_after_bound", w)
        if args.use_rs:
            same = args.rs_level == args.tis_level
            rs_w = _safe_exp(log_w if same else _level_log_ratio(d, m, args.rs_level))
            add("rs_mask_fraction_low", (rs_w < rs_lower).float())
            add("rs_mask_fraction_high", (rs_w > rs_upper).float())
            keep = keep * ((rs_w >= rs_lower) & (rs_w <= rs_upper)).float()
            if args.rs_veto_threshold is not None:
                bad = (d < math.log(args.rs_veto_threshold)) & (m > 0)
                add("rs_catastrophic_token_fraction", bad.float())
                add("rs_catastrophic_seq_fraction", bad.any().float().expand_as(d))
                keep = keep * (~bad.any()).float()
        add("is_ratio_mean_after_tis_rs", w)
        weights.append(w.detach())
        kept.append(keep.detach())
    if args.tis_batch_normalize:
        if args.tis_level == "token":
            mean = sum(_sum(w, m) for w, m in zip(weights, masks, strict=True)) / sum(
                m.sum() for m in masks
            ).clamp_min(1)
        elif args.tis_level == "sequence":
            mean = sum(_mean(w, m) for w, m in zip(weights, masks, strict=True)) / len(weights)
        else:
            raise ValueError("--tis-batch-normalize takes --tis-level token or sequence (as Miles)")
        ok = bool(mean > 1e-8)
        weights = [w / mean for w in weights] if ok else weights
        for w in weights:
            add("batch_norm_factor", mean.expand_as(w) if ok else torch.ones_like(w))
    for w, m in zip(weights, masks, strict=True):
        on = m > 0
        add("is_ratio_mean_final", _mean(w, m).expand_as(w))
        add("is_ratio_min_final", (w[on].min() if on.any() else w.new_zeros(())).expand_as(w))
        add("is_ratio_max_final", (w[on].max() if on.any() else w.new_zeros(())).expand_as(w))
    return weights, kept, metrics


def compute_mis_weights_with_cp(
    args,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: Tensors,
    rollout_log_probs: Tensors,
    loss_masks: Tensors,
    **_: Any,
) -> tuple[torch.Tensor, Tensors, dict[str, torch.Tensor]]:
    """The TIS-function form (Miles' signature): the flat per-token pg loss times the weights,
    the masks after rejection, and the metrics flattened with the `mis_` prefix. No context
    parallelism here, so Miles' `_with_cp` and `_fsdp` entry points are the same function."""
    weights, kept, metrics = compute_mis_weights(
        args, train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs, loss_masks=loss_masks
    )
    if weights is not None:
        pg_loss = pg_loss * torch.cat(weights)
    return pg_loss, kept, {f"mis_{k}": torch.cat(v) for k, v in metrics.items()}
