"""Byte planes: byte k of every element gathered into plane k, optionally XOR-ing two versions of a
tensor on the way (and the inverse), plus sparse packing of a plane as a bitmap + its nonzero bytes.

Why: one optimizer step moves the low mantissa bytes of most fp32/bf16 elements and the high
(sign/exponent) bytes of almost none. Interleaved, the XOR delta is a 25-50%-dense byte stream that
zstd compresses at ~0.4 GB/s; split into planes, the high planes are all zero or sparse (a bitmap +
a few bytes), the lowest plane is noise that zstd recognizes and stores raw at ~10 GB/s, and the
wire shrinks (bench/bench_weights.py measures both).

Planes are little-endian byte positions of the element as stored (plane 0 = lowest byte on x86/ARM).
Every function has a torch/numpy reference (`*_reference`) that the tests compare with. The fast
path is numba: the fixed-width loops below are vectorized by LLVM (the stride-2/4/8 interleave
becomes shuffles), ~10-30 GB/s on one core against ~3 GB/s for numpy's transposed copy.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import numba

    _jit = numba.njit(cache=True, nogil=True, boundscheck=False)
    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - numba is a declared dependency; the references still work
    numba, _jit, HAVE_NUMBA = None, None, False

WIDTHS = (1, 2, 4, 8)


def _np(t) -> np.ndarray:
    return t.numpy() if isinstance(t, torch.Tensor) else t


# ---- references (torch) ----------------------------------------------------------------------


def xor_split_reference(a: torch.Tensor, b: torch.Tensor | None, width: int) -> torch.Tensor:
    """(a ^ b) as (width, n) planes; b=None splits `a` itself."""
    x = a if b is None else torch.bitwise_xor(a, b)
    return x.view(-1, width).t().contiguous()


def xor_merge_reference(cur: torch.Tensor | None, planes: torch.Tensor, width: int) -> torch.Tensor:
    """cur ^ interleave(planes) as flat bytes; cur=None interleaves the planes."""
    x = planes.t().contiguous().reshape(-1)
    return x if cur is None else torch.bitwise_xor(cur, x)


# ---- fast paths -------------------------------------------------------------------------------

if HAVE_NUMBA:

    @_jit
    def _xs2(a, b, out):
        for i in range(out.shape[1]):
            out[0, i] = a[2 * i] ^ b[2 * i]
            out[1, i] = a[2 * i + 1] ^ b[2 * i + 1]

    @_jit
    def _xs4(a, b, out):
        for i in range(out.shape[1]):
            out[0, i] = a[4 * i] ^ b[4 * i]
            out[1, i] = a[4 * i + 1] ^ b[4 * i + 1]
            out[2, i] = a[4 * i + 2] ^ b[4 * i + 2]
            out[3, i] = a[4 * i + 3] ^ b[4 * i + 3]

    @_jit
    def _xs8(a, b, out):
        for i in range(out.shape[1]):
            for k in range(8):
                out[k, i] = a[8 * i + k] ^ b[8 * i + k]

    @_jit
    def _xm2(cur, planes, out):
        for i in range(planes.shape[1]):
            out[2 * i] = cur[2 * i] ^ planes[0, i]
            out[2 * i + 1] = cur[2 * i + 1] ^ planes[1, i]

    @_jit
    def _xm4(cur, planes, out):
        for i in range(planes.shape[1]):
            out[4 * i] = cur[4 * i] ^ planes[0, i]
            out[4 * i + 1] = cur[4 * i + 1] ^ planes[1, i]
            out[4 * i + 2] = cur[4 * i + 2] ^ planes[2, i]
            out[4 * i + 3] = cur[4 * i + 3] ^ planes[3, i]

    @_jit
    def _xm8(cur, planes, out):
        for i in range(planes.shape[1]):
            for k in range(8):
                out[8 * i + k] = cur[8 * i + k] ^ planes[k, i]

    @_jit
    def _compact(plane, out):
        """Nonzero bytes of `plane` in order into `out` (len(plane)+1); returns their count.
        Branch-free: always store, advance on nonzero (no mispredictions on 50%-dense planes)."""
        c = 0
        for i in range(plane.size):
            v = plane[i]
            out[c] = v
            c += v != 0
        return c

    @_jit
    def _expand(mask, values, out):
        """out[i] = next value where mask[i] else 0; values carries one padding byte at the end."""
        c = 0
        for i in range(out.size):
            m = mask[i]
            out[i] = values[c] * m
            c += m
        return c

    @_jit
    def _sparse_xor_bits(out, bitmap, values, n, width, plane):
        """out[i*width + plane] ^= next value for each marked i, walking only nonzero bitmap bytes.
        Marks past n (the last byte's padding) are ignored, as `np.unpackbits(count=n)` does.
        Returns the values used, or -1 (stopping) when the marks outnumber the stored values."""
        c = 0
        nv = values.size
        for j in range(bitmap.size):
            b = bitmap[j]
            if b:
                for t in range(8):
                    if (b >> t) & 1:
                        i = 8 * j + t
                        if i >= n:
                            break
                        if c >= nv:
                            return -1
                        out[i * width + plane] ^= values[c]
                        c += 1
        return c

    _SPLIT = {2: _xs2, 4: _xs4, 8: _xs8}
    _MERGE = {2: _xm2, 4: _xm4, 8: _xm8}


def _zeros_like_np(n: int) -> np.ndarray:
    return np.zeros(n, np.uint8)  # calloc: untouched zero pages, cheap to read


def xor_split(a: torch.Tensor, b: torch.Tensor | None, width: int, out: torch.Tensor | None = None):
    """(a ^ b) (flat uint8, len n*width) split into `out` (width, n) planes; b=None: split `a`."""
    if a.numel() % width or (b is not None and b.numel() != a.numel()):
        raise ValueError(f"xor_split: {a.numel()} / {None if b is None else b.numel()} bytes, width {width}")
    n = a.numel() // width
    out = torch.empty((width, n), dtype=torch.uint8) if out is None else out
    if width == 1:
        out[0].copy_(a if b is None else torch.bitwise_xor(a, b))
    elif HAVE_NUMBA and width in _SPLIT:
        _SPLIT[width](_np(a), _zeros_like_np(a.numel()) if b is None else _np(b), _np(out))
    else:
        out.copy_(xor_split_reference(a, b, width))
    return out


def xor_merge(cur: torch.Tensor | None, planes: torch.Tensor, width: int, out: torch.Tensor | None = None):
    """cur ^ interleave(planes) into flat uint8 `out` (may not alias cur); cur=None: interleave."""
    nbytes = planes.numel()
    if planes.dim() != 2 or planes.shape[0] != width or (cur is not None and cur.numel() != nbytes):
        raise ValueError(
            f"xor_merge: planes {tuple(planes.shape)}, width {width}, base {cur and cur.numel()}"
        )
    out = torch.empty(nbytes, dtype=torch.uint8) if out is None else out
    if width == 1:
        out.copy_(planes[0] if cur is None else torch.bitwise_xor(cur, planes[0]))
    elif HAVE_NUMBA and width in _MERGE:
        _MERGE[width](_zeros_like_np(nbytes) if cur is None else _np(cur), _np(planes), _np(out))
    else:
        out.copy_(xor_merge_reference(cur, planes, width))
    return out


# ---- sparse planes: bitmap (LSB-first, one bit per byte) + the nonzero bytes ---------------------


def sparse_pack_reference(plane: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    p = _np(plane)
    mask = p != 0
    return np.packbits(mask, bitorder="little"), p[mask]


def sparse_unpack_reference(bitmap: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    mask = np.unpackbits(bitmap, count=n, bitorder="little").view(bool)
    if int(mask.sum()) != values.size:
        raise ValueError(f"sparse plane: bitmap marks {int(mask.sum())} bytes, {values.size} values stored")
    out = np.zeros(n, np.uint8)
    out[mask] = values
    return out


def sparse_pack(plane: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(bitmap of nonzero bytes, the nonzero bytes in order) of a flat uint8 plane."""
    p = _np(plane)
    mask = p != 0
    bitmap = np.packbits(mask, bitorder="little")
    if not HAVE_NUMBA or bitmap.size > 2 * int(np.count_nonzero(bitmap)):
        return bitmap, p[mask]  # numpy's masked gather is fast while few bytes are marked
    vals = np.empty(p.size + 1, np.uint8)
    k = _compact(p, vals)
    return bitmap, vals[:k]


def sparse_unpack(bitmap, values, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `sparse_pack` into a flat uint8 tensor of n bytes; a bitmap that marks a different
    number of bytes than `values` holds raises ValueError (corrupt payload)."""
    bitmap, values = np.frombuffer(bitmap, np.uint8), np.frombuffer(values, np.uint8)
    if bitmap.size != (n + 7) // 8:
        raise ValueError(f"sparse plane: bitmap is {bitmap.size} bytes for {n} elements")
    out = torch.empty(n, dtype=torch.uint8) if out is None else out
    mask = np.unpackbits(bitmap, count=n, bitorder="little")
    marked = int(np.count_nonzero(mask))
    if marked != values.size:  # checked before the unchecked loop reads values[marked]
        raise ValueError(f"sparse plane: bitmap marks {marked} bytes, {values.size} values stored")
    if not HAVE_NUMBA or 16 * marked < n:  # few marked: numpy's masked scatter is fast
        o = _np(out)
        o.fill(0)
        o[mask.view(bool)] = values
        return out
    padded = np.empty(values.size + 1, np.uint8)
    padded[:-1], padded[-1] = values, 0
    _expand(mask, padded, _np(out))
    return out


def sparse_positions(bitmap, n: int) -> np.ndarray:
    """Ascending positions (< n) marked in an LSB-first bitmap, touching only its nonzero bytes."""
    bitmap = np.frombuffer(bitmap, np.uint8)
    if bitmap.size != (n + 7) // 8:
        raise ValueError(f"sparse plane: bitmap is {bitmap.size} bytes for {n} elements")
    nzb = np.flatnonzero(bitmap)
    f = np.flatnonzero(np.unpackbits(bitmap[nzb], bitorder="little"))
    pos = nzb[f >> 3] * 8 + (f & 7)
    return pos[pos < n] if pos.size and pos[-1] >= n else pos


def sparse_xor_(out: np.ndarray, bitmap, values, n: int, width: int, plane: int) -> None:
    """In place: byte `plane` of element i of `out` (flat uint8, n*width) ^= the i-th marked value.
    A bitmap that marks a different number of elements (< n) than `values` holds raises ValueError;
    `out` may then be partly updated (callers apply into a copy)."""
    values = np.frombuffer(values, np.uint8)
    if HAVE_NUMBA:
        bitmap = np.frombuffer(bitmap, np.uint8)
        if bitmap.size != (n + 7) // 8:
            raise ValueError(f"sparse plane: bitmap is {bitmap.size} bytes for {n} elements")
        if out.size != n * width:
            raise ValueError(f"sparse plane: {out.size} bytes is not {n} elements of {width}")
        used = _sparse_xor_bits(out, bitmap, values, n, width, plane)
        if used != values.size:  # -1: the bitmap marks more than stored
            marked = int(sparse_positions(bitmap, n).size)
            raise ValueError(f"sparse plane: bitmap marks {marked} bytes, {values.size} values stored")
        return
    pos = sparse_positions(bitmap, n)
    if pos.size != values.size:
        raise ValueError(f"sparse plane: bitmap marks {pos.size} bytes, {values.size} values stored")
    out[pos * width + plane] ^= values


def count_nonzero_rows(planes: torch.Tensor) -> list[int]:
    """Nonzero bytes per plane (numpy's count is ~40 GB/s on uint8, torch's ~6)."""
    p = _np(planes)
    return [int(np.count_nonzero(row)) for row in p]
