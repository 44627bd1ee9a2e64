"""The trainer's `rollout/*` metrics, as Miles' log_rollout_data reduces a rollout's training data:
each token-level field (the trainer's `log_probs` before the step, the reference's `ref_log_probs`, the
engine's `rollout_log_probs`, `advantages`, a critic's `returns` / `values`, the trainer's `entropy`) is
the mean over samples of each sample's loss-masked token mean; a fully masked sample counts 0.

Each rank reduces its own samples; the actor averages the ranks (every rank holds the same number of
samples of a rollout: the global batch is split round-robin)."""

from __future__ import annotations

import torch

# Miles' key -> what it is (docs/miles_flags.md): the order they are logged in
TOKEN_FIELDS = (
    "log_probs",
    "ref_log_probs",
    "rollout_log_probs",
    "advantages",
    "returns",
    "values",
    "entropy",
)


def sample_mean(values: dict[int, torch.Tensor], masks: dict[int, torch.Tensor], idx: list[int]) -> float:
    """Mean over samples `idx` of each one's masked token mean (Miles' sum_of_sample_mean / count)."""
    total = 0.0
    for i in idx:
        m = masks[i].float()
        total += float((values[i].detach().float() * m).sum() / m.sum().clamp_min(1))
    return total / max(len(idx), 1)


def rollout_data_metrics(
    idx: list[int], masks: dict[int, torch.Tensor], **fields: dict[int, torch.Tensor] | None
) -> dict[str, float]:
    """{"rollout/<field>": sample mean} of each field given (None or empty: not measured, not logged);
    a field must have a value for every sample of `idx`."""
    out = {}
    for name in TOKEN_FIELDS:
        values = fields.get(name)
        if values and all(i in values and len(values[i]) == len(masks[i]) for i in idx):
            out[f"rollout/{name}"] = sample_mean(values, masks, idx)
    unknown = set(fields) - set(TOKEN_FIELDS)
    if unknown:
        raise ValueError(f"not a rollout field: {sorted(unknown)}")
    return out
