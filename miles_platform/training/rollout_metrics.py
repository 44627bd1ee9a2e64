"""The trainer's `rollout/*` metrics, as Miles' log_rollout_data reduces a rollout's training data:
each token-level field (the trainer's `log_probs` before the step, the reference's `ref_log_probs`, the
engine's `rollout_log_probs`, `advantages`, a critic's `returns` / `values`, the trainer's `entropy`) is
the mean over samples of each sample's loss-masked token mean; a fully masked sample counts 0.

Each rank reduces its own samples; the actor averages the ranks (every rank holds the same number of
samples of a rollout: the global batch is split round-robin)."""

from __future__ import annotations

import torch

from miles_platform.training.segments import Segments

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


class _Segments:
    """The samples `idx` laid end to end: their masks and each token's sample, built once per call
    and shared by every field (one reduction per field instead of a loop over samples)."""

    def __init__(self, masks: dict[int, torch.Tensor], idx: list[int]):
        ms = [masks[i].reshape(-1) for i in idx]
        self.idx = idx
        self.mask = torch.cat(ms).float()
        self.segments = Segments([m.numel() for m in ms], self.mask.device)
        self.count = self.segments.sum(self.mask).clamp_min(1)

    def mean(self, values: dict[int, torch.Tensor]) -> float:
        with torch.no_grad():  # one cat and one cast per field, not per sample
            v = torch.cat([values[i].reshape(-1) for i in self.idx]).float().to(self.mask.device)
            return float((self.segments.sum(v * self.mask) / self.count).mean())


def rollout_data_metrics(
    idx: list[int], masks: dict[int, torch.Tensor], **fields: dict[int, torch.Tensor] | None
) -> dict[str, float]:
    """{"rollout/<field>": sample mean} of each field given (None or empty: not measured, not logged);
    a field must have a value for every sample of `idx`."""
    unknown = set(fields) - set(TOKEN_FIELDS)
    if unknown:
        raise ValueError(f"not a rollout field: {sorted(unknown)}")
    out, segs = {}, None
    for name in TOKEN_FIELDS:
        values = fields.get(name)
        if values and idx and all(i in values and values[i].shape[:1] == masks[i].shape[:1] for i in idx):
            segs = segs or _Segments(masks, idx)
            out[f"rollout/{name}"] = segs.mean(values)
    return out
