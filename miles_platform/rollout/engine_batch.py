"""The running batch of the embedded engine: its requests and their shared, left-padded KV cache.

Rows of the cache line up with `Batch.reqs`. Newly prefilled requests join with `merge_batches`
(the shorter cache is left-padded; the mask hides padding); finished or failed rows leave with
`keep_rows`, which also drops cache columns that became padding for every row left.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from miles_platform.rollout.engine_requests import Request


class Batch:
    """Running requests and their shared left-padded KV cache (rows aligned with `reqs`)."""

    def __init__(self):
        self.reqs: list[Request] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, T] 1 = real token in cache
        self.pos: torch.Tensor | None = None  # [B] next position id per row

    def __len__(self) -> int:
        return len(self.reqs)


def cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of each layer, [B, heads, T, head_dim] each."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_from_tensors(tensors, config) -> DynamicCache:
    """A DynamicCache holding the given per-layer (keys, values)."""
    cache = DynamicCache(config=config)
    for i, (k, v) in enumerate(tensors):
        cache.update(k, v, i)
    return cache


def merge_batches(a: Batch, b: Batch, config) -> Batch:
    """Concatenate two batches, left-padding the shorter KV cache (padding is masked out)."""
    if not len(a):
        return b
    ta, tb = a.mask.shape[1], b.mask.shape[1]
    width = max(ta, tb)

    def pad(x, t):
        return (
            torch.nn.functional.pad(x, (0, 0, width - t, 0))
            if x.dim() == 4
            else torch.nn.functional.pad(x, (width - t, 0))
        )

    tensors = [
        (torch.cat([pad(ka, ta), pad(kb, tb)]), torch.cat([pad(va, ta), pad(vb, tb)]))
        for (ka, va), (kb, vb) in zip(cache_tensors(a.cache), cache_tensors(b.cache))
    ]
    out = Batch()
    out.reqs = a.reqs + b.reqs
    out.cache = cache_from_tensors(tensors, config)
    out.mask = torch.cat([pad(a.mask, ta), pad(b.mask, tb)])
    out.pos = torch.cat([a.pos, b.pos])
    return out


def keep_rows(b: Batch, keep: list[int], config) -> Batch:
    """Keep rows `keep`, and drop cache columns that are padding for every remaining row."""
    out = Batch()
    if not keep:
        return out
    idx = torch.tensor(keep, device=b.mask.device)
    mask = b.mask[idx]
    start = int((mask.sum(0) > 0).nonzero()[0])
    out.reqs = [b.reqs[i] for i in keep]
    out.mask = mask[:, start:]
    out.pos = b.pos[idx]
    out.cache = cache_from_tensors(
        [(k[idx, :, start:], v[idx, :, start:]) for k, v in cache_tensors(b.cache)], config
    )
    return out
