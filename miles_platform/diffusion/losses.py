"""Diffusion RL objectives: GRPO advantages, the Flow-GRPO PPO loss, DiffusionNFT, EMA.

Pure torch on per-pair tensors ([P] = one entry per (x_t -> x_next) train pair). Metrics are
detached 0-d tensors keyed by their logged name, as in `miles_platform.training.loss`.

Sources (formulas re-implemented, not copied):
  - GRPO advantages: Miles `miles/backends/fsdp_utils/loss_hub/advantages.py` (radixark/miles_diffusion)
  - Flow-GRPO loss + KL: flow_grpo `scripts/train_sd3.py` (yifan123/flow_grpo), Miles
    `miles/backends/fsdp_utils/loss_hub/flow_grpo.py`
  - NFT loss + decay schedule: DiffusionNFT `scripts/train_nft_sd3.py` (NVlabs/DiffusionNFT), Miles
    `miles/backends/fsdp_utils/loss_hub/nft.py` and `miles/backends/fsdp_utils/ema.py`
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

Metrics = dict[str, torch.Tensor]


def _float(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (float64 stays float64)."""
    return x if x.dtype == torch.float64 else x.float()


def _mean_over_non_batch(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.ndim)), keepdim=keepdim)


# ---------------------------------------------------------------------------- advantages


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    std_normalization: bool = True,
    globalize_mean: bool = False,
    globalize_std: bool = False,
    eps: float = 1e-4,
) -> torch.Tensor:
    """Group-relative advantages of `rewards` [N] (groups = consecutive runs of `group_size`).

    A = (r - mean) / (std + eps): mean per group (`--globalize-reward-mean`: over the batch), std
    per group (`--globalize-reward-std`: over the batch; torch's unbiased std, as Miles). The std
    division is skipped under `--disable-grpo-std-normalization` (std_normalization=False) and
    when group_size == 1 (a one-sample group has no std). eps = 1e-4 is flow_grpo's / Miles'.
    """
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    flat = _float(rewards.reshape(-1))
    groups = flat.view(-1, group_size)
    mean = flat.mean() if globalize_mean else groups.mean(dim=-1, keepdim=True)
    adv = groups - mean
    if std_normalization and group_size > 1:
        std = flat.std() if globalize_std else groups.std(dim=-1, keepdim=True)
        adv = adv / (std + eps)
    return adv.reshape(-1)


# ---------------------------------------------------------------------------- Flow-GRPO


def kl_to_ref(prev_mean: torch.Tensor, ref_prev_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """flow_grpo's KL to the reference: mean((mu - mu_ref)^2) / (2 std^2) per pair, [P].

    `std` is StepOut.std_dev_t (flow_grpo divides by the diffusion scale, not the transition std),
    [P] or [P, 1, ...]."""
    sq = _mean_over_non_batch((_float(prev_mean) - _float(ref_prev_mean)) ** 2)
    return sq / (2 * _float(std).reshape(sq.shape[0]) ** 2)


def flow_grpo_loss(
    new_log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    adv_clip_max: float,
    kl: torch.Tensor | None = None,
    kl_beta: float = 0.0,
) -> tuple[torch.Tensor, Metrics]:
    """PPO-clip on per-transition log-probs, mean over pairs, + kl_beta * mean(kl).

    A = clamp(advantages, +-adv_clip_max); ratio = exp(new - old);
    pg_loss = mean(max(-A ratio, -A clamp(ratio, 1 - c, 1 + c))). `kl` is `kl_to_ref(...)` [P].
    """
    new, old = _float(new_log_prob), _float(old_log_prob).detach()
    adv = torch.clamp(_float(advantages).detach(), -adv_clip_max, adv_clip_max)
    log_ratio = new - old
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    pg_loss = torch.maximum(unclipped, clipped).mean()
    loss = pg_loss
    metrics: Metrics = {}
    if kl is not None and kl_beta > 0:
        kl_loss = _float(kl).mean()
        loss = loss + kl_beta * kl_loss
        metrics["train/kl_loss"] = kl_loss.detach()
    with torch.no_grad():
        metrics.update(
            {
                "train/loss": loss.detach(),
                "train/pg_loss": pg_loss.detach(),
                "train/pg_clipfrac": ((ratio - 1.0).abs() > clip_range).float().mean(),
                "train/ppo_kl": (-log_ratio).mean(),
                "train/ratio_abs_minus_1": (ratio - 1.0).abs().mean(),
                "train/log_prob_mean_abs_diff": log_ratio.abs().mean(),
            }
        )
    return loss, metrics


# ---------------------------------------------------------------------------- DiffusionNFT


def nft_reward_weight(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """r = clamp(A, +-max) / max / 2 + 0.5 in [0, 1]: 1 = pull fully toward the positive policy."""
    a = torch.clamp(_float(advantages), -adv_clip_max, adv_clip_max)
    return torch.clamp(a / adv_clip_max / 2.0 + 0.5, 0.0, 1.0)


def _x0_loss(x0_pred: torch.Tensor, x0: torch.Tensor, adaptive_weight: bool) -> torch.Tensor:
    sq = (x0_pred - x0) ** 2
    if adaptive_weight:
        # Per-sample mean |x0_pred - x0| (float64, clipped at 1e-5, no grad) normalises the scale.
        with torch.no_grad():
            w = _mean_over_non_batch((x0_pred.double() - x0.double()).abs(), keepdim=True).clamp(min=1e-5)
        sq = sq / w.to(sq.dtype)
    return _mean_over_non_batch(sq)


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    sigma: torch.Tensor,
    r: torch.Tensor,
    *,
    beta: float,
    adv_clip_max: float,
    adaptive_weight: bool = True,
    kl_beta: float = 0.0,
    v_ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """DiffusionNFT's loss on pairs (x_t = (1 - sigma) x0 + sigma eps, sigma [P]); v_old is pi_old
    (the EMA), detached. Computed in float32 (float64 inputs stay float64).

    pos = beta v_theta + (1 - beta) v_old;  neg = (1 + beta) v_old - beta v_theta
    l_pos / l_neg = mean((x_t - sigma * pos|neg - x0)^2 [/ adaptive weight]) per pair
    loss = mean(adv_clip_max * (r l_pos / beta + (1 - r) l_neg / beta)) + kl_beta mean((v_theta - v_ref)^2)
    """
    if beta <= 0:
        raise ValueError(f"--diffusion-nft-beta {beta}: must be > 0")
    v_new = _float(v_theta)
    v_o = _float(v_old).detach()
    xt, x0f = _float(x_t).detach(), _float(x0).detach()
    s = _float(sigma).detach().reshape(-1, *([1] * (xt.ndim - 1)))
    r = _float(r).detach()
    positive = beta * v_new + (1.0 - beta) * v_o
    negative = (1.0 + beta) * v_o - beta * v_new
    pos_loss = _x0_loss(xt - s * positive, x0f, adaptive_weight)
    neg_loss = _x0_loss(xt - s * negative, x0f, adaptive_weight)
    per_pair = r * pos_loss / beta + (1.0 - r) * neg_loss / beta
    policy_loss = (per_pair * adv_clip_max).mean()
    loss = policy_loss
    metrics: Metrics = {}
    if kl_beta > 0:
        if v_ref is None:
            raise ValueError("nft_loss: kl_beta > 0 needs v_ref (the --ref-mode model's prediction)")
        kl_loss = _mean_over_non_batch((v_new - _float(v_ref).detach()) ** 2).mean()
        loss = loss + kl_beta * kl_loss
        metrics["train/kl_loss"] = kl_loss.detach()
    with torch.no_grad():
        metrics.update(
            {
                "train/loss": loss.detach(),
                "train/nft_loss": policy_loss.detach(),
                "train/nft_pos_loss": pos_loss.mean(),
                "train/nft_neg_loss": neg_loss.mean(),
                "train/nft_r_mean": r.mean(),
                "train/nft_old_deviate": ((v_new - v_o) ** 2).mean(),
            }
        )
    return loss, metrics


# ---------------------------------------------------------------------------- EMA (pi_old)


def ema_decay(step: int, *, init: float, ramp: float, max: float, flat_steps: int) -> float:
    """The EMA decay after `step` actor optimizer steps (DiffusionNFT's global_step).

    `init` through the flat period (step <= flat_steps), then a ramp restarting from zero:
    (step - flat_steps) * ramp, capped at `max`. Decay weighs the old EMA:
    ema <- decay * ema + (1 - decay) * model, so decay 0 copies the model.
    """
    if step <= flat_steps:
        return float(init)
    return float(min((step - flat_steps) * ramp, max))


def ema_init(model: nn.Module, *, trainable_only: bool = True) -> dict[str, torch.Tensor]:
    """A detached copy of the model's (trainable) parameters, keyed by name: a fresh EMA."""
    return {
        n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad or not trainable_only
    }


@torch.no_grad()
def ema_update(ema: Mapping[str, torch.Tensor] | nn.Module, model: nn.Module, decay: float) -> None:
    """In place: ema <- decay * ema + (1 - decay) * model, for every parameter the EMA holds
    (a name -> tensor dict, or a module with the model's parameter names)."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"EMA decay {decay}: must be in [0, 1]")
    shadow = dict(ema.named_parameters()) if isinstance(ema, nn.Module) else ema
    live = dict(model.named_parameters())
    missing = sorted(set(shadow) - set(live))
    if missing:
        raise KeyError(f"EMA holds parameters the model does not have: {missing[:5]}")
    for name, sh in shadow.items():
        sh.mul_(decay).add_(live[name].detach().to(device=sh.device, dtype=sh.dtype), alpha=1.0 - decay)
