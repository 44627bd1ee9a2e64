"""The running batch of the embedded engine: its requests and their shared, left-padded KV cache.

Rows of the cache line up with `Batch.reqs`. Newly prefilled requests join with `merge_batches`
(the shorter cache is left-padded; the mask hides padding); finished or failed rows leave with
`keep_rows`, which also drops cache columns that became padding for every row left.

The cache is transformers' own `DynamicCache` built from the model's config, so each layer is the
kind its family needs, and the row / column operations here act on every kind:
- attention layers (`keys` / `values` `[B, heads, T, d]`, DeepSeek-V3.2's indexer keys `[B, T, d]`):
  columns right-aligned with the mask; a sliding-window layer keeps at most its last `window - 1`
  columns and counts the mask's width as its `cumulative_length` (what its attention mask offsets by);
- linear-attention / Mamba layers (`conv_states`, `recurrent_states`: one state per row, no time
  axis): rows only. Left padding leaves them exact: padded inputs are zeroed, so the state a row
  carries is the one of its own tokens;
- layers without a cache (an MoE-only or KV-sharing layer): nothing to move.
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache

from miles_platform.rollout.engine_requests import Request

# per-token tensors of an attention cache layer and their time axis
_TIME_AXES = (("keys", -2), ("values", -2), ("indexer_keys", 1))
_STATE_DICTS = ("conv_states", "recurrent_states")  # per-row states of linear-attention layers
_FLAG_DICTS = ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
               "conv_kernel_size")  # fmt: skip


class Batch:
    """Running requests and their shared left-padded KV cache (rows aligned with `reqs`)."""

    def __init__(self):
        self.reqs: list[Request] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, T] 1 = real token in cache
        self.pos: torch.Tensor | None = None  # [B] next position id per row

    def __len__(self) -> int:
        return len(self.reqs)


def new_cache(config) -> DynamicCache:
    """An empty cache with the layer kinds of the model's config (full, sliding, linear, ...)."""
    return DynamicCache(config=config)


def _time_tensor(layer, name: str) -> torch.Tensor | None:
    t = getattr(layer, name, None)
    return t if torch.is_tensor(t) and t.numel() else None


def _window(layer) -> int | None:
    """How many past columns a sliding-window layer keeps (None: all)."""
    if getattr(layer, "is_sliding", False) and not getattr(layer, "record_past", False):
        return int(layer.sliding_window) - 1
    return None


def _align(t: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    """The last `n` columns of `t` along `axis`, left-padded with zeros when it has fewer."""
    axis = axis % t.dim()
    have = t.shape[axis]
    if have >= n:
        return t.narrow(axis, have - n, n)
    pad = [0, 0] * (t.dim() - 1 - axis) + [n - have, 0]
    return torch.nn.functional.pad(t, pad)


def _reshaped_layer(layer, rows: torch.Tensor | None, width: int | None):
    """A copy of one cache layer with batch rows `rows` (all when None) and its columns right-aligned
    to a mask of `width` columns (unchanged when None)."""
    out = copy.copy(layer)
    for name, axis in _TIME_AXES:
        t = _time_tensor(layer, name)
        if t is None:
            continue
        if rows is not None:
            t = t[rows.to(t.device)]
        if width is not None:
            keep = _window(layer)
            t = _align(t, axis, width if keep is None else min(width, keep))
        setattr(out, name, t)
    if width is not None and hasattr(layer, "cumulative_length"):
        out.cumulative_length = width
    for name in _STATE_DICTS:
        states = getattr(layer, name, None)
        if isinstance(states, dict):
            setattr(
                out,
                name,
                {i: s if s is None or rows is None else s[rows.to(s.device)] for i, s in states.items()},
            )
    for name in _FLAG_DICTS:  # the copy's own: a forward updates them in place
        if isinstance(getattr(layer, name, None), dict):
            setattr(out, name, dict(getattr(layer, name)))
    return out


def _concat_layers(a, b):
    """One layer holding `a`'s rows then `b`'s (both aligned to the same mask width)."""
    out = _reshaped_layer(a, None, None)
    for name, _ in _TIME_AXES:
        ta, tb = _time_tensor(a, name), _time_tensor(b, name)
        if ta is not None and tb is not None:
            setattr(out, name, torch.cat([ta, tb]))
    for name in _STATE_DICTS:
        sa, sb = getattr(a, name, None), getattr(b, name, None)
        if isinstance(sa, dict):
            setattr(out, name, {i: None if sa[i] is None else torch.cat([sa[i], sb[i]]) for i in sa})
    return out


def reshaped_cache(cache: DynamicCache, rows: torch.Tensor | None = None, width: int | None = None):
    """The cache with batch rows `rows` (a long index, repeats allowed) and its columns aligned to a
    mask of `width` columns."""
    out = copy.copy(cache)
    out.layers = [_reshaped_layer(layer, rows, width) for layer in cache.layers]
    return out


def merge_batches(a: Batch, b: Batch, config) -> Batch:
    """Concatenate two batches, left-padding the shorter KV cache (padding is masked out)."""
    if not len(a):
        return b
    ta, tb = a.mask.shape[1], b.mask.shape[1]
    width = max(ta, tb)
    ca, cb = reshaped_cache(a.cache, width=width), reshaped_cache(b.cache, width=width)
    out = Batch()
    out.reqs = a.reqs + b.reqs
    out.cache = copy.copy(ca)
    out.cache.layers = [_concat_layers(la, lb) for la, lb in zip(ca.layers, cb.layers, strict=True)]
    out.mask = torch.cat(
        [torch.nn.functional.pad(a.mask, (width - ta, 0)), torch.nn.functional.pad(b.mask, (width - tb, 0))]
    )
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
    out.cache = reshaped_cache(b.cache, rows=idx, width=out.mask.shape[1])
    return out
