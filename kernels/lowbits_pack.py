"""The (width, L)-specialized pack kernels of lowbits.py, as a template.

`lowbits._pack_kernels(width, L)` writes a copy of this file with the `W, L = ...` line set, under
a cache dir, and imports it: the constants below are then module globals that numba freezes into
the machine code (constant trip counts, masks, a native-width accumulator: LLVM unrolls and
vectorizes the per-element loops), and `cache=True` keeps that code on disk next to the copy, so a
process that needs the kernels again loads them instead of compiling them (~0.3-0.6 CPU-s each, in
every publisher and engine process before). Imported as itself it is the (4, 12) pair.
"""

import numba
import numpy as np

W, L = 4, 12  # (width in bytes, low bits): the line lowbits rewrites per copy

has_hi = L < 8 * W
pairs = L % 8 == 4
nb = L // 4 if pairs else L // 8  # bytes per pair (nibble-packed) / per element (byte-aligned)
tail_nb = (L + 7) // 8
T = np.uint32 if max(8 * W, 2 * L if pairs else L) <= 32 else np.uint64  # accumulator
mask = T((1 << L) - 1) if L < 8 * np.dtype(T).itemsize else T(np.iinfo(T).max)
sh = T(L % (8 * np.dtype(T).itemsize))
ff, c255, zero = T(0xFF), T(255), T(0)
ks = tuple(T(8 * k) for k in range(max(nb, tail_nb, 1)))

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)


@numba.njit(inline="always", cache=True)
def store_pair(low, p, x0, x1):
    v = (x0 & mask) | ((x1 & mask) << sh)
    for k in range(nb):
        low[p * nb + k] = np.uint8((v >> ks[k]) & ff)


@numba.njit(inline="always", cache=True)
def store_one(low, i, x):
    for k in range(nb):
        low[i * nb + k] = np.uint8((x >> ks[k]) & ff)


@_jit
def enc(a, b, low, hi8, bm):
    """low bits -> low, min(x >> L, 255) -> hi8, (x >> L != 0) -> bitmap words bm (each
    64-element block, the last one partial); returns the number of changed elements."""
    n = a.size
    changed = 0
    for j in range(n // 64):  # one bitmap word per block of 64 elements
        base = 64 * j
        w = np.uint64(0)
        if pairs:  # two elements per step (their nibbles share a byte)
            for k in range(32):
                i = base + 2 * k
                x0 = T(a[i] ^ b[i])
                x1 = T(a[i + 1] ^ b[i + 1])
                store_pair(low, i // 2, x0, x1)
                if has_hi:
                    h0 = min(x0 >> sh, c255)
                    h1 = min(x1 >> sh, c255)
                    hi8[i] = np.uint8(h0)
                    hi8[i + 1] = np.uint8(h1)
                    w |= np.uint64(h0 != zero) << np.uint64(2 * k)
                    w |= np.uint64(h1 != zero) << np.uint64(2 * k + 1)
                changed += (x0 != zero) + (x1 != zero)
        else:  # one element per lane (measured ~5x faster than pairs for L = 0)
            for k in range(64):
                x = T(a[base + k] ^ b[base + k])
                store_one(low, base + k, x)
                if has_hi:
                    h = min(x >> sh, c255)
                    hi8[base + k] = np.uint8(h)
                    w |= np.uint64(h != zero) << np.uint64(k)
                changed += x != zero
        if has_hi:
            bm[j] = w
    start = 64 * (n // 64)
    w = np.uint64(0)
    for i in range(start, n):
        x = T(a[i] ^ b[i])
        if pairs:
            if i % 2 == 0 and i + 1 < n:
                store_pair(low, i // 2, x, T(a[i + 1] ^ b[i + 1]))
            elif i % 2 == 0:  # the last element alone: its nibbles, the top one padded
                v = x & mask
                for k in range(tail_nb):
                    low[(i // 2) * nb + k] = np.uint8((v >> ks[k]) & ff)
        else:
            store_one(low, i, x)
        if has_hi:
            h = min(x >> sh, c255)
            hi8[i] = np.uint8(h)
            w |= np.uint64(h != zero) << np.uint64(i - start)
        changed += x != zero
    if has_hi and n % 64:
        bm[n // 64] = w
    return changed


@_jit
def unpack_xor(cur, low):
    n = cur.size
    if pairs:
        for p in range(n // 2):
            v = zero
            for k in range(nb):
                v |= T(low[p * nb + k]) << ks[k]
            cur[2 * p] ^= v & mask
            cur[2 * p + 1] ^= (v >> sh) & mask
        if n % 2:
            v = zero
            for k in range(tail_nb):
                v |= T(low[(n // 2) * nb + k]) << ks[k]
            cur[n - 1] ^= v & mask
    elif nb:
        for i in range(n):
            v = zero
            for k in range(nb):
                v |= T(low[i * nb + k]) << ks[k]
            cur[i] ^= v
