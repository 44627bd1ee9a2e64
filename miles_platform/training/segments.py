"""Per-sample tensors laid end to end, one segment each: per-segment sums in one pass
(`index_add_`) instead of a Python loop over samples. The loss hub's ESS metric and the
rollout-data metrics reduce over a micro-batch's samples this way."""

from __future__ import annotations

import torch


class Segments:
    """Segments of `sizes` elements, laid end to end on `device`."""

    def __init__(self, sizes: list[int], device: torch.device | str | None = None):
        self.n = len(sizes)
        self.seg = torch.repeat_interleave(
            torch.arange(self.n, device=device), torch.tensor(sizes, device=device)
        )

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """[n]: the sum of each segment of the flat `x`."""
        return torch.zeros(self.n, dtype=x.dtype, device=x.device).index_add_(0, self.seg, x)
