"""On-policy distillation in the trainer: the advantage penalty (every estimator) and the frozen
in-trainer teacher of `--opd-type megatron` (on either --train-backend). docs/opd.md.

    A_t <- A_t - opd_kl_coef * reverse_KL_t                        (Miles' additive OPD)
    reverse_KL_t = log pi_student(y_t) - log pi_teacher(y_t)     (sampled-token OPD; the student's
                                                                   old log-probs, as Miles)
                 = sample.opd_reverse_kl[t]                       (--opd-log-prob-top-k > 0)

The penalty lands after the estimator built its advantages (GRPO, GSPO, PPO, REINFORCE++ ...) and
before --normalize-advantages whitens them (Miles' order), so the estimator itself is untouched;
returns (the PPO critic's targets) are not changed.
"""

from __future__ import annotations

import os

import torch


def build_teacher(cfg, rank: int, world_size: int, device="cpu"):
    """The frozen teacher backend, like the reference model. --opd-teacher-load is an HF dir (any
    size sharing the tokenizer) or a checkpoint dir of this backend's layout (the student's shape)."""
    from miles_platform.training.backends import get_backend_class

    path = cfg.opd_teacher_load
    teacher = get_backend_class(cfg.train_backend)(cfg, rank, world_size, device)
    hf = os.path.isfile(os.path.join(path, "config.json"))
    teacher.build(path if hf else cfg.hf_checkpoint, trainable=False)
    if not hf:
        teacher.load_model(path)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


class OPDPenalty:
    """One rollout's teacher signal; `apply(idx, adv, old)` subtracts it from adv[i] for i in idx,
    once old (the student's log-probs before the step) exists for them, and logs opd/* metrics."""

    def __init__(self, cfg, batch, teacher: dict[int, torch.Tensor] | None, add, device="cpu"):
        """`teacher`: in-trainer teacher log-probs by sample index (else the batch's sglang scores);
        `device`: the rank's, where the penalty meets the advantages."""
        self.coef, self.batch, self.add, self.device = cfg.opd_kl_coef, batch, add, device
        self.teacher = teacher
        self.topk = batch.opd_reverse_kl if cfg.opd_log_prob_top_k > 0 else None
        if self.teacher is None and self.topk is None:
            scored = batch.teacher_log_probs
            self.teacher = {i: self._tensor(t) for i, t in enumerate(scored or []) if t is not None}

    def _tensor(self, data) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.float32).to(self.device)

    def reverse_kl(self, i: int, old: dict[int, torch.Tensor]) -> torch.Tensor | None:
        n = self.batch.response_lengths[i]
        if self.topk is not None:
            rkl = self.topk[i]
            return None if rkl is None else _sized(self._tensor(rkl), n, i, "opd_reverse_kl")
        t = self.teacher.get(i)
        return None if t is None else old[i].detach().float() - _sized(t, n, i, "teacher_log_probs")

    def apply(self, idx: list[int], adv: dict[int, torch.Tensor], old: dict[int, torch.Tensor]) -> None:
        kls, tlps, masks = [], [], []
        for i in idx:
            rkl = self.reverse_kl(i, old)
            if rkl is None:  # not scored (empty or removed response): no penalty
                continue
            adv[i] = adv[i] - self.coef * rkl
            kls.append(rkl)
            masks.append(self._tensor(self.batch.loss_masks[i]))
            if self.teacher is not None:
                tlps.append(self.teacher[i].float())
        if not kls:
            return
        mask = torch.cat(masks)
        denom = mask.sum().clamp_min(1)
        self.add("opd/reverse_kl", (torch.cat(kls) * mask).sum() / denom)
        if tlps:
            self.add("opd/teacher_log_probs", (torch.cat(tlps) * mask).sum() / denom)


def _sized(t: torch.Tensor, n: int, i: int, name: str) -> torch.Tensor:
    if t.numel() != n:
        raise ValueError(f"sample {i}: {t.numel()} {name} for {n} response tokens")
    return t
