"""Loss hub: advantage estimators, PPO-family policy loss, KL, entropy, TIS, reductions.

Pure torch on lists of per-sample 1-D tensors over response tokens, each with a 0/1
`loss_mask`. Formulas follow Miles (`miles/utils/ppo_utils.py`, `loss_hub/advantages.py`):

  ratio    = exp(log_probs - old_log_probs)          (gspo: exp(masked mean per sample))
  pg_loss  = max(-ratio * A, -clamp(ratio, 1 - eps_clip, 1 + eps_clip_high) * A)
             dual clip (--eps-clip-c): for A < 0, min(pg_loss, -eps_clip_c * A)
  ppo_kl   = old_log_probs - log_probs
  loss     = pg_loss [* tis weights] - entropy_coef * entropy + kl_loss_coef * KL(pi || ref)
  reduce   = mean over each sample's tokens, then over samples (--calculate-per-token-loss:
             sum over all tokens / number of tokens)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from miles_platform.config import ConfigError
from miles_platform.plugins import load_function
from miles_platform.training.score_centering import score_centering_loss

Tensors = list[torch.Tensor]
LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
SumFn = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over data-parallel ranks

ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")


# ---------------------------------------------------------------------------- reductions


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1)


def sum_of_sample_mean(values: Tensors, loss_masks: Tensors) -> torch.Tensor:
    """Mean over tokens within each sample, then mean over samples (Miles' default)."""
    per_sample = [masked_mean(v, m) for v, m in zip(values, loss_masks, strict=True)]
    return torch.stack(per_sample).mean()


def per_token_mean(values: Tensors, loss_masks: Tensors) -> torch.Tensor:
    """Sum over all tokens of the batch / number of tokens (--calculate-per-token-loss)."""
    return masked_mean(torch.cat(values), torch.cat(loss_masks))


def get_reducer(args) -> Callable[[Tensors, Tensors], torch.Tensor]:
    return per_token_mean if getattr(args, "calculate_per_token_loss", False) else sum_of_sample_mean


def masked_whiten(
    values: Tensors, loss_masks: Tensors, eps: float = 1e-8, all_reduce_sum: SumFn | None = None
) -> Tensors:
    """(x - mean) / sqrt(var + eps) over all masked tokens of the batch; unbiased var as in Miles.

    `all_reduce_sum` (Miles' distributed_masked_whiten): the samples are this rank's share of
    the batch; the sum, sum of squares and count are summed over data-parallel ranks first, so
    every rank whitens with the statistics of the whole batch."""
    flat, mask = torch.cat(values), torch.cat(loss_masks).to(values[0].dtype)
    stats = torch.stack([(flat * mask).sum(), (flat**2 * mask).sum(), mask.sum()])
    if all_reduce_sum is not None:
        stats = all_reduce_sum(stats)
    total, total_sq, n = stats.unbind()
    if n.item() == 0:
        raise ValueError("cannot whiten advantages: every token of the batch is masked out")
    mean = total / n
    var = total_sq / n - mean**2
    if n.item() >= 2:
        var = var * n / (n - 1)
    whitened = (flat - mean) * torch.rsqrt(var + eps)
    return list(torch.split(whitened, [v.numel() for v in values]))


# ---------------------------------------------------------------------------- KL and entropy


def compute_approx_kl(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_loss_type: str
) -> torch.Tensor:
    """Per-token KL(pi || ref) estimators (Schulman, http://joschu.net/blog/kl-approx.html).

    k1 = r, k2 = r^2 / 2, k3 = low_var_kl = exp(-r) - 1 + r with r = log pi - log ref;
    low_var_kl is additionally clamped to [-10, 10].
    """
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kl_loss_type == "k1":
        kl = log_ratio
    elif kl_loss_type == "k2":
        kl = log_ratio**2 / 2.0
    elif kl_loss_type in ("k3", "low_var_kl"):
        kl = (-log_ratio).exp() - 1 + log_ratio
    else:
        raise ConfigError(f"--kl-loss-type {kl_loss_type!r}: valid: {list(KL_TYPES)}")
    if kl_loss_type == "low_var_kl":
        kl = kl.clamp(min=-10, max=10)
    return kl


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum(p * z)."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def token_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    support: torch.Tensor | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of `targets` under the policy that sampled them (Miles' contract).

    logits [..., V], targets [...]: log softmax(z / T)[target]. `support` [..., K] (token ids, -1
    padding; a row of -1 = no recorded support) is sampling-support replay: where a position has a
    support, the softmax runs over those K ids only, so the trainer scores the same truncated
    distribution top-k / top-p sampled from, with gradients through the actor's logits.
    """
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = (lse - (z.softmax(-1) * z).sum(-1)) if with_entropy else None
    if support is None:
        return picked - lse, ent
    valid = support >= 0
    zs = z.gather(-1, support.clamp(min=0)).masked_fill(~valid, float("-inf"))
    has = valid[..., 0]
    lse_s = torch.logsumexp(zs, dim=-1)
    lp = picked - torch.where(has, lse_s, lse)
    if with_entropy:
        ps = zs.softmax(-1).nan_to_num(0.0)
        ent_s = lse_s - torch.where(valid, ps * zs, torch.zeros_like(zs)).sum(-1)
        ent = torch.where(has, ent_s, ent)
    return lp, ent


def candidate_log_probs(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    temperature: float = 1.0,
    support: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs of K candidate ids per position under the same distribution as `token_log_probs`.

    logits [..., V], candidates [..., K] (token ids, -1 = unused slot): log softmax(z / T)[ids],
    over the recorded `support` where a position has one (then the candidates are that support,
    score centering's support mode). Unused slots read 0.0 (no gradient): mask them by id."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    if support is not None:
        valid_s = support >= 0
        zs = z.gather(-1, support.clamp(min=0)).masked_fill(~valid_s, float("-inf"))
        lse = torch.where(valid_s[..., 0], torch.logsumexp(zs, dim=-1), lse)
    valid = candidates >= 0
    picked = z.gather(-1, candidates.clamp(min=0)) - lse.unsqueeze(-1)
    return picked.masked_fill(~valid, 0.0)


# ---------------------------------------------------------------------------- advantages


def group_normalize_rewards(rewards: torch.Tensor, n: int, std_normalize: bool) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + 1e-6); groups are consecutive runs of n samples."""
    if rewards.numel() % n:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of --n-samples-per-prompt={n}")
    grouped = rewards.float().view(-1, n)
    centered = grouped - grouped.mean(dim=-1, keepdim=True)
    if std_normalize and n > 1:
        centered = centered / (grouped.std(dim=-1, keepdim=True) + 1e-6)
    return centered.flatten()


def _kl_for_rewards(args, log_probs: Tensors, ref_log_probs: Tensors | None) -> Tensors:
    if not getattr(args, "kl_coef", 0.0) or ref_log_probs is None:
        return [torch.zeros_like(lp, dtype=torch.float32) for lp in log_probs]
    return [
        compute_approx_kl(lp, ref, args.kl_loss_type)
        for lp, ref in zip(log_probs, ref_log_probs, strict=True)
    ]


def _last_masked_index(mask: torch.Tensor) -> int:
    idx = mask.nonzero(as_tuple=True)[0]
    return int(idx[-1]) if idx.numel() else mask.numel() - 1


def discounted_returns(token_rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1}."""
    out = torch.zeros_like(token_rewards)
    running = token_rewards.new_zeros(())
    for t in reversed(range(token_rewards.numel())):
        running = token_rewards[t] + gamma * running
        out[t] = running
    return out


def gae(token_rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float):
    """GAE (PPO paper): delta_t = r_t + gamma V_{t+1} - V_t (V_T = 0), A_t = delta_t + gamma lambd A_{t+1}."""
    adv = torch.zeros_like(values)
    last = values.new_zeros(())
    for t in reversed(range(values.numel())):
        next_value = values[t + 1] if t + 1 < values.numel() else 0.0
        delta = token_rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lambd * last
        adv[t] = last
    return adv, adv + values


def compute_advantages_and_returns(
    args,
    rewards: torch.Tensor,
    log_probs: Tensors,
    ref_log_probs: Tensors | None,
    values: Tensors | None,
    loss_masks: Tensors,
    all_reduce_sum: SumFn | None = None,
) -> tuple[Tensors, Tensors | None]:
    """Per-token advantages (and returns) for `--advantage-estimator`.

    `rewards` are the raw scalar rewards, one per sample, groups of `--n-samples-per-prompt`
    consecutive samples. Estimators that use a per-token KL penalty take it from
    `compute_approx_kl(log_probs, ref_log_probs, --kl-loss-type) * --kl-coef`.
    `all_reduce_sum`: the samples are one data-parallel rank's share; whitening statistics
    are summed over ranks with it (see masked_whiten).
    """
    est = args.advantage_estimator
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    masks = [m.float() for m in loss_masks]
    n = getattr(args, "n_samples_per_prompt", 1)
    if est in ("grpo", "gspo"):
        scores = group_normalize_rewards(rewards, n, not args.disable_grpo_std_normalization)
        advantages = [torch.full_like(m, float(s)) for s, m in zip(scores, masks, strict=True)]
        return advantages, [a.clone() for a in advantages]
    kl = _kl_for_rewards(args, log_probs, ref_log_probs)
    if est == "reinforce_plus_plus":
        returns = []
        for r, k, m in zip(rewards, kl, masks, strict=True):
            token_rewards = -args.kl_coef * k
            token_rewards[_last_masked_index(m)] += r
            returns.append(discounted_returns(token_rewards, args.gamma))
        return masked_whiten(returns, masks, all_reduce_sum=all_reduce_sum), returns
    if est == "reinforce_plus_plus_baseline":
        centered = group_normalize_rewards(rewards, n, std_normalize=False)
        advantages = [
            torch.full_like(k, float(s)) - args.kl_coef * k for s, k in zip(centered, kl, strict=True)
        ]
        return masked_whiten(advantages, masks, all_reduce_sum=all_reduce_sum), advantages
    if est == "ppo":
        if values is None:
            raise ConfigError("--advantage-estimator ppo needs critic values (per-token) for GAE")
        advantages, returns = [], []
        for r, k, v, m in zip(rewards, kl, values, masks, strict=True):
            token_rewards = -args.kl_coef * k
            token_rewards[_last_masked_index(m)] += r
            a, ret = gae(token_rewards, v.float().detach(), args.gamma, args.lambd)
            advantages.append(a)
            returns.append(ret)
        return masked_whiten(advantages, masks, all_reduce_sum=all_reduce_sum), returns
    raise ConfigError(f"--advantage-estimator {est!r}: valid: {list(ADVANTAGE_ESTIMATORS)}")


# ---------------------------------------------------------------------------- policy loss


def compute_policy_loss(
    log_probs: Tensors,
    old_log_probs: Tensors,
    advantages: Tensors,
    loss_masks: Tensors,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
    sequence_level: bool = False,
) -> tuple[Tensors, Tensors, Tensors]:
    """Clipped surrogate per token -> (pg_losses, clipfrac, ppo_kl), each a list per sample.

    `sequence_level` (gspo): the ratio of a sample is exp(masked mean of its log-ratios),
    shared by all its tokens.
    """
    eps_clip_high = eps_clip if eps_clip_high is None else eps_clip_high
    ppo_kl = []
    for lp, old, m in zip(log_probs, old_log_probs, loss_masks, strict=True):
        kl = old.detach() - lp
        ppo_kl.append(masked_mean(kl, m.float()).expand_as(kl) if sequence_level else kl)
    sizes = [k.numel() for k in ppo_kl]
    kl_flat, adv = torch.cat(ppo_kl), torch.cat(advantages).detach()
    ratio = (-kl_flat).exp()
    loss1 = -ratio * adv
    loss2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * adv
    pg = torch.maximum(loss1, loss2)
    clipfrac = (loss2 > loss1).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ConfigError(f"--eps-clip-c must be > 1.0, got {eps_clip_c}")
        pg = torch.where(adv < 0, torch.minimum(pg, -eps_clip_c * adv), pg)
    split = lambda t: list(torch.split(t, sizes))  # noqa: E731
    return split(pg), split(clipfrac), split(kl_flat)


def compute_tis_weights(
    args, log_probs_old: Tensors, rollout_log_probs: Tensors, loss_masks: Tensors
) -> tuple[Tensors, dict[str, torch.Tensor]]:
    """Importance weights pi_old / pi_rollout for the train/rollout engine mismatch.

    level  token: per token; sequence: exp(sum of log-ratios); geometric: exp(mean of log-ratios)
    mode   truncate: min(w, upper); clip: clamp(w, lower, upper); mask: w inside [lower, upper], else 0
    """
    lo, hi, level, mode = args.tis_lower_bound, args.tis_upper_bound, args.tis_level, args.tis_mode
    raw, weights = [], []
    for old, roll, m in zip(log_probs_old, rollout_log_probs, loss_masks, strict=True):
        log_ratio = (old.detach().float() - roll.float()) * m
        if level == "token":
            w = log_ratio.exp()
        elif level == "sequence":
            w = log_ratio.sum().exp().expand_as(log_ratio)
        elif level == "geometric":
            w = (log_ratio.sum() / m.sum().clamp_min(1)).exp().expand_as(log_ratio)
        else:
            raise ConfigError(f"--tis-level {level!r}: valid: token, sequence, geometric")
        raw.append(w)
        if mode == "truncate":
            weights.append(w.clamp(max=hi))
        elif mode == "clip":
            weights.append(w.clamp(min=lo, max=hi))
        elif mode == "mask":
            weights.append(w * ((w >= lo) & (w <= hi)).float())
        else:
            raise ConfigError(f"--tis-mode {mode!r}: valid: truncate, clip, mask")
    mask = torch.cat(loss_masks).float()
    before, after = torch.cat(raw), torch.cat(weights)
    abs_diff = torch.cat(
        [(o.detach().float() - r.float()).abs() for o, r in zip(log_probs_old, rollout_log_probs)]
    )
    valid = mask > 0
    metrics = {
        "train_rollout_logprob_abs_diff": masked_mean(abs_diff, mask),
        "tis_weight_before_bound": masked_mean(before, mask),
        "tis": masked_mean(after, mask),
        "tis_min": after[valid].min() if valid.any() else after.new_zeros(()),
        "tis_max": after[valid].max() if valid.any() else after.new_zeros(()),
        "tis_clipfrac": masked_mean((before != after).float(), mask),
    }
    return weights, metrics


def policy_loss_function(
    args, batch: dict[str, Any], log_probs: Tensors, entropy: Tensors | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO/GSPO objective of one micro-batch -> (loss, detached metrics).

    batch: "advantages", "old_log_probs", "rollout_log_probs", "ref_log_probs" (optional),
    "loss_masks" — lists with one 1-D tensor per sample. `log_probs` (and `entropy`) carry grad.
    """
    masks = [m.float() for m in batch["loss_masks"]]
    reduce = get_reducer(args)
    old = (
        batch["rollout_log_probs"] if getattr(args, "use_rollout_logprobs", False) else batch["old_log_probs"]
    )
    pg, clipfrac, ppo_kl = compute_policy_loss(
        log_probs,
        old,
        batch["advantages"],
        masks,
        args.eps_clip,
        args.eps_clip_high,
        args.eps_clip_c,
        sequence_level=args.advantage_estimator == "gspo",
    )
    metrics: dict[str, torch.Tensor] = {}
    if getattr(args, "use_tis", False):
        weights, tis_metrics = compute_tis_weights(
            args, batch["old_log_probs"], batch["rollout_log_probs"], masks
        )
        pg = [p * w for p, w in zip(pg, weights, strict=True)]
        metrics.update(tis_metrics)
    pg_loss = reduce(pg, masks)
    loss = pg_loss
    entropy_loss = reduce(entropy, masks) if entropy is not None else pg_loss.new_zeros(())
    if getattr(args, "entropy_coef", 0.0):
        if entropy is None:
            raise ValueError("--entropy-coef > 0 needs the per-token entropy from the forward pass")
        loss = loss - args.entropy_coef * entropy_loss
    kl_loss = pg_loss.new_zeros(())
    ref = batch.get("ref_log_probs")
    if getattr(args, "use_kl_loss", False):
        if ref is None:
            raise ConfigError("--use-kl-loss needs ref_log_probs (a reference model: --ref-load)")
        kl = [compute_approx_kl(lp, r, args.kl_loss_type) for lp, r in zip(log_probs, ref, strict=True)]
        kl_loss = reduce(kl, masks)
        loss = loss + args.kl_loss_coef * kl_loss
    metrics.update(
        pg_loss=pg_loss.detach(),
        pg_clipfrac=reduce(clipfrac, masks).detach(),
        ppo_kl=reduce(ppo_kl, masks).detach(),
        kl_loss=kl_loss.detach(),
        entropy_loss=entropy_loss.detach(),
        loss=loss.detach(),
    )
    return loss, metrics


def sft_loss_function(
    args, batch: dict[str, Any], log_probs: Tensors, entropy: Tensors | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the masked response tokens."""
    masks = [m.float() for m in batch["loss_masks"]]
    loss = -get_reducer(args)(log_probs, masks)
    return loss, {"loss": loss.detach()}


LOSSES: dict[str, LossFn] = {"policy_loss": policy_loss_function, "sft_loss": sft_loss_function}
LOSSES["score_centering"] = score_centering_loss  # training/score_centering.py


def get_loss_function(args) -> LossFn:
    """--loss-type -> fn(args, batch, log_probs, entropy=None) -> (loss, metrics).

    custom_loss loads --custom-loss-function-path, which must take those four arguments.
    """
    loss_type = args.loss_type
    if loss_type == "custom_loss":
        path = getattr(args, "custom_loss_function_path", None)
        if not path:
            raise ConfigError("--loss-type custom_loss needs --custom-loss-function-path")
        return load_function(path, "--custom-loss-function-path", required_params=4)
    if loss_type not in LOSSES:
        raise ConfigError(f"--loss-type {loss_type!r}: valid: {sorted(LOSSES) + ['custom_loss']}")
    return LOSSES[loss_type]
