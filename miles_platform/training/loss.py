"""Loss hub: advantage estimators, PPO-family policy loss, KL, entropy, TIS / MIS, reductions.

Pure torch on lists of per-sample 1-D tensors over response tokens, each with a 0/1
`loss_mask`. Formulas and defaults follow Miles (`loss_hub/advantages.py`, `math_utils.py`,
`losses.py`, `corrections.py`); docs/algorithms.md lists each with its flags.

  ratio    = exp(clamp(log_probs - old_log_probs, -20, 20))   (gspo: the masked mean per sample)
  pg_loss  = max(-ratio * A, -clamp(ratio, 1 - eps_clip, 1 + eps_clip_high) * A)
             dual clip (--eps-clip-c): for A < 0, min(pg_loss, -eps_clip_c * A)
  ppo_kl   = old_log_probs - log_probs
  loss     = pg_loss [* IS weights] [* OPSM mask] - entropy_coef * entropy + kl_loss_coef * KL(pi || ref)
  reduce   = sum over each sample's tokens / its loss-token count, mean over samples
             (--calculate-per-token-loss: sum over all tokens / sum of max(count, 1) per sample)

Guards (Miles'): log-ratios are clamped to [-20, 20] before exp; at tokens with loss mask 0 every
input (log-probs, advantages, weights) is replaced by 0 before it is used, and non-finite values
at trained tokens become 0, so one -inf or NaN at a masked token cannot make the loss or its
gradient non-finite.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from miles_platform.config import ConfigError
from miles_platform.plugins import load_function
from miles_platform.training.segments import Segments

Tensors = list[torch.Tensor]
LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
SumFn = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over data-parallel ranks
Reducer = Callable[..., torch.Tensor]  # (values, loss_masks, denominators=None) -> scalar

ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOG_RATIO_CLAMP = 20.0  # Miles' _LOG_RATIO_EXP_CLAMP: exp(20) is finite in fp32, exp(89) is not


# ---------------------------------------------------------------------------- guards


def safe_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """NaN -> 0, +-inf -> +-20, then clamp to [-20, 20] (the argument of every exp here)."""
    c = LOG_RATIO_CLAMP
    return torch.nan_to_num(log_ratio.float(), nan=0.0, posinf=c, neginf=-c).clamp(-c, c)


def at_active(x: torch.Tensor, mask: torch.Tensor, finite: bool = False) -> torch.Tensor:
    """x at tokens with loss mask > 0, 0 elsewhere (a select: no gradient reaches masked tokens,
    whatever they hold); `finite` also turns NaN / +-inf at active tokens into 0 (Miles' guard on
    ppo_kl, advantages and KL)."""
    if finite:
        x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    return torch.where(mask > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


# ---------------------------------------------------------------------------- reductions


def mask_counts(loss_masks: Tensors) -> torch.Tensor:
    """[n]: each sample's mask sum (its loss-token count), one segment sum over the masks laid end to
    end: a `.sum()` per sample cost ~1.4 us each, four times a 128-sample micro-batch's loss (its
    denominators, then every reduction's). Integer-valued masks sum exactly either way."""
    if not loss_masks:
        return torch.zeros(0)
    flat = torch.cat(loss_masks)
    if not flat.is_floating_point():
        flat = flat.float()
    return Segments([m.numel() for m in loss_masks], flat.device).sum(flat)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (at_active(x, mask) * mask).sum() / mask.sum().clamp_min(1)


def sum_of_sample_mean(
    values: Tensors, loss_masks: Tensors, denominators: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum over each sample's loss tokens / its token count, then the mean over samples (Miles'
    default). `denominators`: per-sample counts to divide by instead (the original masks' when
    rejection sampling removed tokens from `loss_masks`: rejected tokens leave the numerator only)."""
    if denominators is None:
        denominators = mask_counts(loss_masks)
    mask = torch.cat(loss_masks)
    masked = at_active(torch.cat(values), mask) * mask  # one select for the batch, then per sample
    sums = torch.stack([x.sum() for x in masked.split([m.numel() for m in loss_masks])])
    return (sums / denominators.clamp_min(1)).mean()


def per_token_mean(
    values: Tensors, loss_masks: Tensors, denominators: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum over all loss tokens of the batch / the sum of max(token count, 1) per sample
    (--calculate-per-token-loss, Miles' normalizer)."""
    if denominators is None:
        denominators = mask_counts(loss_masks)
    # one sum over the concatenated tokens (not a sum of per-sample sums): the same rounding as a
    # plain token mean, so runs without masked-out samples train bit for bit as before
    mask = torch.cat(loss_masks)
    return (at_active(torch.cat(values), mask) * mask).sum() / denominators.clamp_min(1).sum()


def get_reducer(args) -> Reducer:
    return per_token_mean if getattr(args, "calculate_per_token_loss", False) else sum_of_sample_mean


def masked_whiten(
    values: Tensors, loss_masks: Tensors, eps: float = 1e-8, all_reduce_sum: SumFn | None = None
) -> Tensors:
    """(x - mean) / sqrt(var + eps) over all masked tokens of the batch; unbiased var as in Miles.

    `all_reduce_sum` (Miles' distributed_masked_whiten): the samples are this rank's share of
    the batch; the sum, sum of squares and count are summed over data-parallel ranks first, so
    every rank whitens with the statistics of the whole batch."""
    masks = [m.to(values[0].dtype) for m in loss_masks]
    flat, mask = torch.cat([at_active(v, m) for v, m in zip(values, masks, strict=True)]), torch.cat(masks)
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
    whitened = (torch.cat(values).float() - mean) * torch.rsqrt(var + eps)
    return list(torch.split(whitened, [v.numel() for v in values]))


# ---------------------------------------------------------------------------- KL and entropy


def compute_approx_kl(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    kl_loss_type: str,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL(pi || ref) estimators (Schulman, http://joschu.net/blog/kl-approx.html).

    k1 = r, k2 = r^2 / 2, k3 = low_var_kl = exp(-r) - 1 + r with r = log pi - log ref;
    low_var_kl takes r through safe_log_ratio first and clamps the result to [-10, 10].
    `importance_ratio` (--use-unbiased-kl): the estimate is weighted by pi_theta / pi_old
    (DeepSeek-V3.2), before low_var_kl's clamp.
    """
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kl_loss_type == "k1":
        kl = log_ratio
    elif kl_loss_type == "k2":
        kl = log_ratio**2 / 2.0
    elif kl_loss_type in ("k3", "low_var_kl"):
        neg = -log_ratio
        if kl_loss_type == "low_var_kl":
            neg = safe_log_ratio(neg)
        kl = neg.exp() - 1 - neg
    else:
        raise ConfigError(f"--kl-loss-type {kl_loss_type!r}: valid: {list(KL_TYPES)}")
    if importance_ratio is not None:
        kl = importance_ratio * kl
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
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of `targets` under the policy that sampled them (Miles' contract).
    `entropy_grad` False: the entropy is computed outside autograd (no [..., V] tensor kept for it).

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
    no_grad = contextlib.nullcontext() if entropy_grad else torch.no_grad()
    with no_grad:
        ent = (lse - (z.softmax(-1) * z).sum(-1)) if with_entropy else None
    if support is None:
        return picked - lse, ent
    valid = support >= 0
    zs = z.gather(-1, support.clamp(min=0)).masked_fill(~valid, float("-inf"))
    has = valid[..., 0]
    lse_s = torch.logsumexp(zs, dim=-1)
    lp = picked - torch.where(has, lse_s, lse)
    if with_entropy:
        with no_grad:
            ps = zs.softmax(-1).nan_to_num(0.0)
            # not where(valid, ps * zs, 0): its unused branch is 0 * -inf, whose backward is NaN
            ent_s = lse_s - (ps * zs.masked_fill(~valid, 0.0)).sum(-1)
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
    """(r - group mean) [/ (group std + 1e-6) when the std is > 0]; groups are consecutive runs
    of n samples (Miles' rollout-side reward normalization)."""
    if rewards.numel() % n:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of --n-samples-per-prompt={n}")
    grouped = rewards.float().view(-1, n)
    if not torch.isfinite(grouped).all():
        return _group_normalize_finite(grouped, std_normalize).flatten()
    centered = grouped - grouped.mean(dim=-1, keepdim=True)
    if std_normalize and n > 1:
        std = grouped.std(dim=-1, keepdim=True)
        centered = torch.where(std > 0, centered / (std + 1e-6), centered)
    return centered.flatten()


def _group_normalize_finite(grouped: torch.Tensor, std_normalize: bool) -> torch.Tensor:
    """As above over each group's finite rewards only; a non-finite reward (its sample is removed
    from the loss, rollout/nonfinite_samples) gets 0 and moves neither the mean nor the std."""
    ok = torch.isfinite(grouped)
    x = torch.where(ok, grouped, 0.0)
    cnt = ok.sum(dim=-1, keepdim=True)
    mean = x.sum(dim=-1, keepdim=True) / cnt.clamp_min(1)
    centered = torch.where(ok, x - mean, 0.0)
    if std_normalize:
        var = (centered**2).sum(dim=-1, keepdim=True) / (cnt - 1).clamp_min(1)
        std = torch.where(cnt > 1, var.sqrt(), 0.0)
        centered = torch.where(std > 0, centered / (std + 1e-6), centered)
    return centered


def normalized_rewards(args, rewards: torch.Tensor) -> torch.Tensor:
    """The scalar rewards the estimator sees: grpo / gspo / reinforce_plus_plus_baseline subtract
    the group mean (grpo / gspo also divide by the std unless --disable-grpo-std-normalization),
    unless --disable-rewards-normalization; the other estimators take the raw rewards."""
    est = args.advantage_estimator
    if est not in ("grpo", "gspo", "reinforce_plus_plus_baseline") or args.disable_rewards_normalization:
        return rewards.float()
    std = est != "reinforce_plus_plus_baseline" and not args.disable_grpo_std_normalization
    return group_normalize_rewards(rewards, getattr(args, "n_samples_per_prompt", 1), std)


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


def gae_over_trainable_tokens(
    reward: float,
    kl_penalty: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lambd: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE on the loss-mask-1 tokens only (Miles): a masked token (a tool answer) is no MDP
    transition, so it carries no reward, KL shaping or value, and the carry crosses it without a
    gamma * lambda decay. The reward lands on the last trainable token; advantages and returns are
    0 at masked tokens, and a fully masked sample gets zeros (its reward is dropped)."""
    idx = (mask > 0).nonzero(as_tuple=True)[0]
    adv, ret = torch.zeros_like(values), torch.zeros_like(values)
    if idx.numel():
        token_rewards = kl_penalty[idx].clone()
        token_rewards[-1] += reward
        a, r = gae(token_rewards, values[idx], gamma, lambd)
        adv[idx], ret[idx] = a, r
    return adv, ret


def compute_advantages_and_returns(
    args,
    rewards: torch.Tensor,
    log_probs: Tensors,
    ref_log_probs: Tensors | None,
    values: Tensors | None,
    loss_masks: Tensors,
    normalize: bool = True,
) -> tuple[Tensors, Tensors]:
    """Per-token advantages and returns of `--advantage-estimator`, before OPD and whitening
    (`normalize_advantages` whitens with --normalize-advantages, after the OPD penalty, as Miles).

    `rewards` are the raw scalar rewards, one per sample, groups of `--n-samples-per-prompt`
    consecutive samples. Estimators that use a per-token KL penalty take it from
    `compute_approx_kl(log_probs, ref_log_probs, --kl-loss-type) * --kl-coef`.
    """
    est = args.advantage_estimator
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    # normalize False: --custom-reward-post-process-path's rewards, taken as they are (Miles')
    rewards = normalized_rewards(args, rewards) if normalize else rewards
    if est in ("grpo", "gspo"):  # each sample's reward at each of its tokens: one repeat, split in views
        sizes = [m.numel() for m in loss_masks]
        device = loss_masks[0].device if loss_masks else rewards.device
        flat = torch.repeat_interleave(rewards.to(device), torch.tensor(sizes, device=device))
        return list(flat.split(sizes)), list(flat.clone().split(sizes))
    masks = [m.float() for m in loss_masks]
    kl = _kl_for_rewards(args, log_probs, ref_log_probs)
    if est == "reinforce_plus_plus":
        returns = []
        for r, k, m in zip(rewards, kl, masks, strict=True):
            token_rewards = -args.kl_coef * k
            if m.numel():  # a response without tokens (an abort before the first) has none to credit
                token_rewards[_last_masked_index(m)] += r
            returns.append(discounted_returns(token_rewards, args.gamma))
        return [r.clone() for r in returns], returns
    if est == "reinforce_plus_plus_baseline":
        advantages = [
            torch.full_like(k, float(s)) - args.kl_coef * k for s, k in zip(rewards, kl, strict=True)
        ]
        return advantages, [a.clone() for a in advantages]
    if est == "ppo":
        if values is None:
            raise ConfigError("--advantage-estimator ppo needs critic values (per-token) for GAE")
        pairs = [
            gae_over_trainable_tokens(
                float(r), -args.kl_coef * k, v.float().detach(), m, args.gamma, args.lambd
            )
            for r, k, v, m in zip(rewards, kl, values, masks, strict=True)
        ]
        return [a for a, _ in pairs], [r for _, r in pairs]
    raise ConfigError(f"--advantage-estimator {est!r}: valid: {list(ADVANTAGE_ESTIMATORS)}")


def normalize_advantages(
    advantages: Tensors, loss_masks: Tensors, all_reduce_sum: SumFn | None = None
) -> Tensors:
    """--normalize-advantages: whiten over every loss token of the batch, any estimator (Miles).
    `all_reduce_sum`: the samples are one data-parallel rank's share; the statistics are summed
    over ranks with it (see masked_whiten)."""
    return masked_whiten(advantages, [m.float() for m in loss_masks], all_reduce_sum=all_reduce_sum)


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
    shared by all its tokens. ppo_kl and advantages are 0 at masked tokens (and where not
    finite); the ratio is exp of the log-ratio clamped to [-20, 20].
    """
    eps_clip_high = eps_clip if eps_clip_high is None else eps_clip_high
    sizes = [lp.numel() for lp in log_probs]
    m_flat = torch.cat(loss_masks)
    if sequence_level:
        ppo_kl = []
        for lp, old, m in zip(log_probs, old_log_probs, loss_masks, strict=True):
            kl = at_active(old.detach().float(), m) - at_active(lp.float(), m)
            ppo_kl.append(at_active(masked_mean(kl, m).expand_as(kl), m, finite=True))
        kl_flat = torch.cat(ppo_kl)
    else:  # token by token: the same elementwise ops on the micro-batch's tokens laid end to end
        old_flat = torch.cat(old_log_probs).detach().float()
        kl = at_active(old_flat, m_flat) - at_active(torch.cat(log_probs).float(), m_flat)
        kl_flat = at_active(kl, m_flat, finite=True)
    adv_flat = at_active(torch.cat(advantages).detach().float(), m_flat, finite=True)
    ratio = safe_log_ratio(-kl_flat).exp()
    loss1 = -ratio * adv_flat
    loss2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * adv_flat
    pg = torch.maximum(loss1, loss2)
    clipfrac = (loss2 > loss1).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ConfigError(f"--eps-clip-c must be > 1.0, got {eps_clip_c}")
        pg = torch.where(adv_flat < 0, torch.minimum(pg, -eps_clip_c * adv_flat), pg)
    split = lambda t: list(torch.split(t, sizes))  # noqa: E731
    return split(pg), split(clipfrac), split(kl_flat)


def opsm_mask(
    args, log_probs: Tensors, old_log_probs: Tensors, advantages: Tensors, loss_masks: Tensors
) -> tuple[Tensors, torch.Tensor]:
    """Off-policy sequence masking (--use-opsm): a token whose advantage is negative in a sample
    whose masked mean of (old - new) log-prob exceeds --opsm-delta is dropped (mask 0). Returns
    the masks and the mean over samples of the dropped share of each sample's loss tokens."""
    out, fracs = [], []
    for lp, old, a, m in zip(log_probs, old_log_probs, advantages, loss_masks, strict=True):
        seq_kl = masked_mean(at_active(old.detach().float(), m) - at_active(lp.detach().float(), m), m)
        drop = ((at_active(a.float(), m, finite=True) < 0) & (seq_kl > args.opsm_delta)).float()
        out.append(1 - drop)
        fracs.append(drop.sum() / m.sum().clamp_min(1))
    return out, torch.stack(fracs).mean()


def vanilla_tis_function(
    args,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: Tensors,
    rollout_log_probs: Tensors,
    loss_masks: Tensors,
    **_,
) -> tuple[torch.Tensor, Tensors, dict[str, torch.Tensor]]:
    """Miles' built-in TIS: w = exp(old - rollout) clamped to [--tis-clip-low, --tis-clip],
    multiplied into the per-token pg loss. Metrics are per token (reduced like the loss): `tis`
    the ratio before the clamp, `tis_clipfrac`, `tis_abs` = |ratio - 1|."""
    tis = safe_log_ratio(torch.cat(train_log_probs) - torch.cat(rollout_log_probs)).exp()
    weights = tis.clamp(min=args.tis_clip_low, max=args.tis_clip)
    metrics = {"tis": tis, "tis_clipfrac": (weights != tis).float(), "tis_abs": (tis - 1).abs()}
    return pg_loss * weights, loss_masks, metrics


def mis_selected(args) -> bool:
    """The MIS flags (Miles' mis.py: --tis-level/-mode/-lower-bound/-upper-bound, --use-rs,
    --rs-*, --tis-batch-normalize) select the MIS correction, as its dotted path does."""
    from miles_platform.config import MIS_FLAGS, RunConfig
    from miles_platform.config.flags import field_default

    return any(getattr(args, n) != field_default(RunConfig, n) for n in MIS_FLAGS)


def get_tis_function(args) -> Callable[..., tuple[torch.Tensor, Tensors, dict[str, torch.Tensor]]]:
    """--custom-tis-function-path (Miles' signature: fn(args, *, pg_loss, train_log_probs,
    rollout_log_probs, loss_masks, total_lengths, response_lengths, **kwargs) -> (pg_loss,
    modified_masks, metrics)); else MIS when its flags are set or only mismatch metrics are
    asked for (--get-mismatch-metrics without --use-tis); else Miles' vanilla TIS."""
    path = getattr(args, "custom_tis_function_path", None)
    if path:
        return load_function(path, "--custom-tis-function-path")
    if mis_selected(args) or not args.use_tis:
        from miles_platform.training.mis import compute_mis_weights_with_cp

        return compute_mis_weights_with_cp
    return vanilla_tis_function


def _ess_ratio(ppo_kl: Tensors, masks: Tensors, per_token: bool) -> torch.Tensor:
    """Effective sample size of the per-token weights exp(-ppo_kl), per sample:
    (sum w)^2 / (n sum w^2); mean over samples (per-token mode: weighted by n). Per-sample sums
    over the tokens laid end to end (one pass, not a loop over samples)."""
    m = torch.cat(masks)
    per_sample = Segments([x.numel() for x in masks], m.device).sum
    w = at_active(safe_log_ratio(-torch.cat(ppo_kl).detach()).exp(), m) * m
    n_t = per_sample(m).clamp_min(1)
    ess_t = per_sample(w) ** 2 / (n_t * per_sample(w * w).clamp_min(1e-8))
    return (ess_t * n_t).sum() / n_t.sum() if per_token else ess_t.mean()


def policy_loss_function(
    args, batch: dict[str, Any], log_probs: Tensors, entropy: Tensors | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO/GSPO objective of one micro-batch -> (loss, detached metrics).

    batch: "advantages", "old_log_probs" (the trainer's), "rollout_log_probs", "ref_log_probs"
    (optional), "loss_masks" — lists with one 1-D tensor per sample. `log_probs` (and `entropy`)
    carry grad.
    """
    masks = [m.float() for m in batch["loss_masks"]]
    counts = mask_counts(masks)  # denominators: rejection leaves them as they are
    reduce = get_reducer(args)
    scored, rollout = batch["old_log_probs"], batch["rollout_log_probs"]
    old = rollout if getattr(args, "use_rollout_logprobs", False) else scored
    sizes = [m.numel() for m in masks]
    split = lambda t: list(torch.split(t, sizes))  # noqa: E731
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
    pg_flat = torch.cat(pg)
    metrics: dict[str, torch.Tensor] = {}
    if getattr(args, "use_opsm", False):
        keep, metrics["opsm_clipfrac"] = opsm_mask(args, log_probs, old, batch["advantages"], masks)
        pg_flat = pg_flat * torch.cat(keep)
    pg_masks = masks
    if getattr(args, "use_tis", False) or getattr(args, "get_mismatch_metrics", False):
        pg_flat, pg_masks, tis_metrics = get_tis_function(args)(
            args,
            pg_loss=pg_flat,
            train_log_probs=[at_active(s.detach().float(), m) for s, m in zip(scored, masks, strict=True)],
            rollout_log_probs=[at_active(r.float(), m) for r, m in zip(rollout, masks, strict=True)],
            loss_masks=masks,
            total_lengths=batch.get("total_lengths"),
            response_lengths=sizes,
            parallel_state=None,
            max_seq_lens=None,
        )
        pg_masks = [torch.as_tensor(m).float() for m in pg_masks]
        metrics["ois"] = reduce([safe_log_ratio(-k.detach()).exp() for k in ppo_kl], masks).detach()
        for key, value in tis_metrics.items():
            metrics[key] = reduce(split(value.detach().float()), masks).detach()
    pg_loss = reduce_pg_loss(args, pg_flat, pg_masks, counts, batch)
    loss, reg = add_regularizers(args, pg_loss, log_probs, old, batch.get("ref_log_probs"), entropy, masks)
    metrics.update(
        pg_loss=pg_loss.detach(),
        pg_clipfrac=reduce(clipfrac, masks).detach(),
        ppo_kl=reduce(ppo_kl, masks).detach(),
        ess_ratio=_ess_ratio(ppo_kl, masks, getattr(args, "calculate_per_token_loss", False)),
        **reg,
        loss=loss.detach(),
    )
    return loss, metrics


def reduce_pg_loss(
    args, pg_flat: torch.Tensor, masks: Tensors, counts: torch.Tensor, batch: dict[str, Any]
) -> torch.Tensor:
    """pg_loss of the micro-batch: the run's reduction, or the reducer that
    --custom-pg-loss-reducer-function-path builds (Miles' contract: from (total_lengths,
    response_lengths, loss_masks, calculate_per_token_loss), a function that sums over the micro-batch's
    samples, Miles dividing the loss by the global batch). Divided here by the micro-batch's sample count
    (its token count with --calculate-per-token-loss), as the built-in reductions are micro-batch means
    that the trainer weighs into the global batch."""
    sizes = [m.numel() for m in masks]
    path = getattr(args, "custom_pg_loss_reducer_function_path", None)
    if not path:
        return get_reducer(args)(list(torch.split(pg_flat, sizes)), masks, counts)
    per_token = bool(getattr(args, "calculate_per_token_loss", False))
    build = load_function(path, "--custom-pg-loss-reducer-function-path", required_params=4)
    total_lengths = batch.get("total_lengths") or sizes
    reducer = build(list(total_lengths), sizes, masks, per_token)
    total = reducer(at_active(pg_flat, torch.cat(masks)))
    return total / (counts.clamp_min(1).sum() if per_token else len(sizes))


def add_regularizers(
    args, pg_loss: torch.Tensor, log_probs: Tensors, old: Tensors, ref: Tensors | None,
    entropy: Tensors | None, masks: Tensors,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """pg_loss - --entropy-coef * entropy + --kl-loss-coef * KL(pi || ref) (--use-kl-loss; weighted
    by pi / pi_old with --use-unbiased-kl), guarded at masked tokens -> (loss, detached
    entropy_loss and kl_loss). Every policy-gradient loss of the hub ends here."""
    reduce, loss = get_reducer(args), pg_loss
    entropy_loss = reduce(entropy, masks) if entropy is not None else pg_loss.new_zeros(())
    if getattr(args, "entropy_coef", 0.0):
        if entropy is None:
            raise ValueError("--entropy-coef > 0 needs the per-token entropy from the forward pass")
        loss = loss - args.entropy_coef * entropy_loss
    kl_loss = pg_loss.new_zeros(())
    if getattr(args, "use_kl_loss", False):
        if ref is None:
            raise ConfigError("--use-kl-loss needs ref_log_probs (a reference model: --ref-load)")
        kl = []
        for lp, r, o, m in zip(log_probs, ref, old, masks, strict=True):
            lp_a = at_active(lp.float(), m)
            ratio = None
            if getattr(args, "use_unbiased_kl", False):  # pi_theta / pi_old, with its gradient
                ratio = safe_log_ratio(lp_a - at_active(o.detach().float(), m)).exp()
            k = compute_approx_kl(lp_a, at_active(r.float(), m), args.kl_loss_type, ratio)
            kl.append(at_active(k, m, finite=True))
        kl_loss = reduce(kl, masks)
        loss = loss + args.kl_loss_coef * kl_loss
    return loss, {"kl_loss": kl_loss.detach(), "entropy_loss": entropy_loss.detach()}


def sft_loss_function(
    args, batch: dict[str, Any], log_probs: Tensors, entropy: Tensors | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the masked response tokens."""
    masks = [m.float() for m in batch["loss_masks"]]
    loss = -get_reducer(args)(log_probs, masks)
    return loss, {"loss": loss.detach()}


def value_loss(
    args, values: Tensors, old_values: Tensors, returns: Tensors, loss_masks: Tensors
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO critic loss (Miles): max((v - R)^2, (v_old + clamp(v - v_old, +-value_clip) - R)^2),
    reduced like the policy loss; value_clipfrac = share of tokens with |v - v_old| > value_clip."""
    reduce, clip = get_reducer(args), args.value_clip
    masks = [m.float() for m in loss_masks]
    losses, clipped = [], []
    for v, vo, ret in zip(values, old_values, returns, strict=True):
        vo, ret = vo.detach().float(), ret.detach().float()
        v_clipped = vo + (v.float() - vo).clamp(-clip, clip)
        losses.append(torch.maximum((v_clipped - ret) ** 2, (v.float() - ret) ** 2))
        clipped.append(((v.detach().float() - vo).abs() > clip).float())
    loss = reduce(losses, masks)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": reduce(clipped, masks).detach()}


# a built-in loss in a module of its own is named by its dotted path: it imports this hub, so the hub
# cannot import it back (scripts/import_cycles.py)
LOSSES: dict[str, LossFn | str] = {
    "policy_loss": policy_loss_function,
    "sft_loss": sft_loss_function,
    "score_centering": "miles_platform.training.score_centering.score_centering_loss",
}


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
    fn = LOSSES[loss_type]
    return load_function(fn, "--loss-type") if isinstance(fn, str) else fn
