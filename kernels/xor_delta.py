"""Byte-level deltas between two versions of a tensor: XOR and changed-position (overwrite) encodings.

Every function works on the raw bytes of a contiguous tensor (`tensor_bytes`), so any dtype
(bf16, fp32, fp8, int) round-trips exactly. Each op has a plain torch uint8 reference
(`*_reference`); the faster paths are in-place XOR application (no allocation) and element
comparison through an integer view of the element width (one compare per element instead of
`itemsize` compares + a reduction). Both are exact; tests check them against each other.
"""

from __future__ import annotations

import torch

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a tensor's bytes (no copy when `t` is contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def element_view(buf: torch.Tensor, itemsize: int) -> torch.Tensor:
    """View flat bytes as integers of the element width (comparisons per element)."""
    return buf.view(_INT_OF_WIDTH[itemsize]) if itemsize in _INT_OF_WIDTH else buf.view(-1, itemsize)


def _aligned(*bufs: torch.Tensor, width: int) -> bool:
    """Whether a dtype view of this width is legal (torch needs storage offsets divisible by it)."""
    return all(b.storage_offset() % width == 0 for b in bufs)


# ---- XOR -------------------------------------------------------------------------------------


def xor_bytes_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_xor(a, b)


def xor_bytes(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a ^ b over flat uint8 buffers of equal length, optionally into `out` (may alias a or b).

    Memory-bound: torch's uint8 kernel is already SIMD, and an int64-word view measured no faster
    (bench/bench_weights.py); what pays is writing in place instead of allocating (page faults).
    """
    if a.numel() != b.numel():
        raise ValueError(f"xor_bytes: length mismatch {a.numel()} != {b.numel()}")
    return torch.bitwise_xor(a, b, out=out) if out is not None else torch.bitwise_xor(a, b)


def apply_xor_(buf: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """In place: buf ^= delta (XOR is its own inverse)."""
    return xor_bytes(buf, delta, out=buf)


def count_nonzero_bytes(delta: torch.Tensor) -> int:
    return int(torch.count_nonzero(delta))


# ---- overwrite: changed element positions + new values ---------------------------------------


def changed_positions_reference(old: torch.Tensor, new: torch.Tensor, itemsize: int):
    o, n = old.view(-1, itemsize), new.view(-1, itemsize)
    idx = (o != n).any(dim=1).nonzero().reshape(-1)
    return idx, n[idx].reshape(-1)


def changed_positions(old: torch.Tensor, new: torch.Tensor, itemsize: int):
    """(indices of changed elements as int64, their new bytes) between two flat byte buffers."""
    if old.numel() != new.numel():
        raise ValueError(f"changed_positions: length mismatch {old.numel()} != {new.numel()}")
    if itemsize not in _INT_OF_WIDTH or not _aligned(old, new, width=itemsize):
        return changed_positions_reference(old, new, itemsize)
    o, n = element_view(old, itemsize), element_view(new, itemsize)
    idx = torch.ne(o, n).nonzero().reshape(-1)
    return idx, n[idx].view(torch.uint8)


def apply_overwrite_(buf: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, itemsize: int):
    """In place: element `indices[i]` of buf takes the bytes values[i*itemsize:(i+1)*itemsize]."""
    if indices.numel() * itemsize != values.numel():
        raise ValueError(f"overwrite: {indices.numel()} indices but {values.numel()} value bytes")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) * itemsize >= buf.numel()):
        raise ValueError("overwrite: index out of range for the tensor")
    if itemsize in _INT_OF_WIDTH and _aligned(buf, values, width=itemsize):
        element_view(buf, itemsize)[indices] = values.view(_INT_OF_WIDTH[itemsize])
    else:
        buf.view(-1, itemsize)[indices] = values.view(-1, itemsize)
    return buf


def encode_indices(idx: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Delta-encode sorted indices (small gaps compress well); int32 when they fit."""
    gaps = torch.diff(idx, prepend=idx.new_zeros(1)) if idx.numel() else idx
    if gaps.numel() == 0 or int(gaps.max()) < 2**31:
        return gaps.to(torch.int32), "int32"
    return gaps, "int64"


def decode_indices(gaps: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(gaps.to(torch.int64), 0)
