"""Low bits + exceptions: an XOR delta as a fixed-width pack of every element's low L bits, plus the
few elements whose XOR reaches above bit L (position and high part, LEB128 varints).

Why: after one optimizer step every fp32 element's XOR with its previous value is a short run of low
mantissa bits (bit length ~8-10 at lr 1e-6) and a bf16 element's is almost always zero. zstd spends
~2 ns per byte finding that out; this layout is written by branch-free, vectorized loops (a few
cycles per element) and only the exceptions (~7% of fp32 elements at L=12, the ~0.7% changed bf16
elements at L=0) take a scalar path. L is chosen per tensor from a bit-length histogram of a sample.

Layout of one tensor of n elements of `width` bytes (x = a ^ b as little-endian words):
  low        n*L/8 bytes (rounded up): the nibble stream of x & (2^L - 1), element after element,
             low nibble first (L is a multiple of 4; for L % 8 == 0 it is plain little-endian bytes)
  positions  the exception positions (x >> L != 0), ascending: LEB128 gaps (the first gap is the
             position + 1), or an LSB-first bitmap of n bits when more than 1 in 32 elements are
             exceptions (no per-exception work for positions)
  highs      x >> L of each exception, LEB128 (nonzero, < 2^(8*width - L))

Every function has a numpy reference (`*_reference`) that the tests compare byte for byte.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys

import numba
import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)

WIDTHS = (1, 2, 4, 8)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SAMPLE_CHUNK, SAMPLE_CHUNKS = 512, 8
# an exception is costed at this many bytes on top of its own bytes (it takes the scalar path)
EXCEPTION_PENALTY = 1.0
BITMAP_DENSITY = 32  # exceptions denser than 1 in this many elements: positions as a bitmap


def low_bits_choices(width: int) -> tuple[int, ...]:
    """L in 0..8*width, multiples of 4 (nibble pairs of elements must fit a 64-bit word)."""
    return tuple(L for L in range(0, 8 * width + 1, 4) if L % 8 == 0 or 2 * L <= 64)


def low_len(n: int, low_bits: int) -> int:
    return (n * low_bits + 7) // 8


def words(buf, width: int) -> np.ndarray:
    """A flat uint8 buffer (tensor or array) as little-endian unsigned words of `width` bytes."""
    a = buf.numpy() if hasattr(buf, "numpy") else np.asarray(buf)
    return a.view(_UINT[width])


def _varints(values) -> bytes:
    out = bytearray()
    for v in values:
        v = int(v)
        while v >= 128:
            out.append((v & 127) | 128)
            v >>= 7
        out.append(v)
    return bytes(out)


# ---- references (numpy) ----------------------------------------------------------------------


def encode_reference(a: np.ndarray, b: np.ndarray, low_bits: int):
    """(low bytes, exception positions, exception highs, changed elements) of words a ^ b."""
    width = a.dtype.itemsize
    x = (a ^ b).astype(np.uint64)
    cols = [(x >> np.uint64(4 * j)) & np.uint64(15) for j in range(low_bits // 4)]
    nib = np.stack(cols, axis=1).reshape(-1).astype(np.uint8) if cols else np.zeros(0, np.uint8)
    if nib.size % 2:
        nib = np.append(nib, np.uint8(0))
    low = (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)
    if low_bits < 8 * width:
        high = x >> np.uint64(low_bits)
        pos = np.flatnonzero(high)
        highs = high[pos]
    else:
        pos, highs = np.zeros(0, np.int64), np.zeros(0, np.uint64)
    return low.tobytes(), pos, highs, int(np.count_nonzero(a ^ b))


def positions_gaps_reference(pos: np.ndarray) -> bytes:
    return _varints(np.diff(pos, prepend=-1))


def positions_bitmap_reference(pos: np.ndarray, n: int) -> bytes:
    mask = np.zeros(n, bool)
    mask[pos] = True
    return np.packbits(mask, bitorder="little").tobytes()


def highs_reference(highs: np.ndarray) -> bytes:
    return _varints(highs)


def apply_reference(cur: np.ndarray, low: bytes, pos, highs, low_bits: int) -> np.ndarray:
    """cur ^ delta (a new array): the inverse of `encode_reference` given cur = a."""
    n, width = cur.size, cur.dtype.itemsize
    lo = np.frombuffer(low, np.uint8)
    nib = np.stack([lo & 15, lo >> 4], axis=1).reshape(-1)[: n * low_bits // 4].astype(np.uint64)
    x = np.zeros(n, np.uint64)
    if low_bits:
        nib = nib.reshape(n, low_bits // 4)
        for j in range(low_bits // 4):
            x |= nib[:, j] << np.uint64(4 * j)
    if len(pos):
        x[np.asarray(pos, np.int64)] |= np.asarray(highs, np.uint64) << np.uint64(low_bits)
    return cur ^ x.astype(_UINT[width])


# ---- fast paths (numba) ------------------------------------------------------------------------

_KERNELS: dict = {}
_PACK_TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lowbits_pack.py")
_PACK_LINE = "W, L = 4, 12  # (width in bytes, low bits): the line lowbits rewrites per copy"


def kernel_cache_dir() -> str:
    """Where the (width, L) kernel copies and their compiled code live: $MILES_KERNEL_CACHE, else
    $XDG_CACHE_HOME/miles-platform/kernels (~/.cache/...)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("MILES_KERNEL_CACHE") or os.path.join(base, "miles-platform", "kernels")


def _pack_kernels(width: int, low_bits: int):
    """(encode, unpack-xor) numba kernels specialized for (width, L): a copy of lowbits_pack.py with
    its constants set, compiled once per machine (numba's on-disk cache) rather than per process.
    A copy is named by the template's hash, so a changed template never reuses old code."""
    key = (width, low_bits)
    if key in _KERNELS:
        return _KERNELS[key]
    with open(_PACK_TEMPLATE, encoding="utf-8") as f:
        src = f.read()
    if _PACK_LINE not in src:
        raise AssertionError(f"{_PACK_TEMPLATE}: the `W, L = ...` line is missing")
    name = f"lowbits_pack_{hashlib.sha256(src.encode()).hexdigest()[:12]}_w{width}_l{low_bits}"
    d = kernel_cache_dir()
    path = os.path.join(d, name + ".py")
    if not os.path.exists(path):  # written whole, then renamed: a concurrent writer writes the same
        os.makedirs(d, mode=0o700, exist_ok=True)  # code this process will import: the user's only
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(src.replace(_PACK_LINE, f"W, L = {width}, {low_bits}"))
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    _KERNELS[key] = (module.enc, module.unpack_xor)
    return _KERNELS[key]


@_jit
def _popcount64(w):
    w = w - ((w >> np.uint64(1)) & np.uint64(0x5555555555555555))
    w = (w & np.uint64(0x3333333333333333)) + ((w >> np.uint64(2)) & np.uint64(0x3333333333333333))
    w = (w + (w >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return (w * np.uint64(0x0101010101010101)) >> np.uint64(56)


@_jit
def _popcount(words):
    c = 0
    for j in range(words.size):
        c += np.int64(_popcount64(words[j]))
    return c


@_jit
def _scan(a, b, hi8, sh, bm, want_gaps, gaps, highs):
    """Walk the set bits of bm: LEB128 gap (if want_gaps) and LEB128 high part (x >> sh) of each
    exception. Returns (exceptions, gap bytes, high bytes)."""
    e, g, c, prev = 0, 0, 0, -1
    for j in range(bm.size):
        w = bm[j]
        while w:
            i = 64 * j + trailing_zeros(w)
            w &= w - np.uint64(1)
            d = i - prev
            prev = i
            if not want_gaps:
                pass
            elif d < 16384:  # 1 or 2 bytes, branch-free (the length is data-dependent: unpredictable)
                two = d >= 128
                gaps[g] = np.uint8((d & 127) | (two << 7))
                gaps[g + 1] = np.uint8(d >> 7)
                g += 1 + two
            else:
                while d >= 128:
                    gaps[g] = np.uint8((d & 127) | 128)
                    g += 1
                    d >>= 7
                gaps[g] = np.uint8(d)
                g += 1
            hv = hi8[i]
            if hv < 255:  # 1 or 2 bytes, branch-free
                two = hv >= 128
                highs[c] = np.uint8((hv & 127) | (two << 7))
                highs[c + 1] = np.uint8(hv >> 7)
                c += 1 + two
            else:
                h = np.uint64(a[i] ^ b[i]) >> sh
                while h >= np.uint64(128):
                    highs[c] = np.uint8((h & np.uint64(127)) | np.uint64(128))
                    c += 1
                    h >>= np.uint64(7)
                highs[c] = np.uint8(h)
                c += 1
            e += 1
    return e, g, c


@_jit
def _read_varint(buf, p):
    """(value, next offset); next offset -1 on a truncated or overlong (> 64-bit) varint."""
    v = np.uint64(0)
    s = 0
    while True:
        if p >= buf.size or s > 63:
            return np.uint64(0), -1
        byte = buf[p]
        p += 1
        v |= np.uint64(byte & 127) << np.uint64(s)
        if byte < 128:
            return v, p
        s += 7


@_jit
def _parse(positions, highs, n, e, high_bits, pos_out, h_out):
    """Decode and validate gap-coded exception streams into pos_out/h_out (length e). Returns 0, or
    an error code: 1 positions stream malformed, 2 position out of order or >= n, 3 count differs
    from e, 4 highs stream malformed, 5 a high part is zero or too wide, 6 trailing bytes.
    (Bitmap-positioned deltas: `_check_bitmap_highs` + `_apply_bitmap`, no arrays.)"""
    p, prev = 0, -1
    for c in range(e):
        d, p = _read_varint(positions, p)
        if p < 0:
            return 1
        if d == 0 or d > np.uint64(n):
            return 2
        prev += np.int64(d)
        if prev >= n:
            return 2
        pos_out[c] = prev
    if p != positions.size:
        return 6
    p = 0
    for c in range(e):
        h, p = _read_varint(highs, p)
        if p < 0:
            return 4
        if h == 0 or (high_bits < 64 and (h >> np.uint64(high_bits)) != 0):
            return 5
        h_out[c] = h
    if p != highs.size:
        return 6
    return 0


@_jit
def _check_bitmap_highs(positions, highs, n, e, high_bits):
    """Validation of a bitmap-positioned delta without decoding it (branch-free counting): e marks,
    none past n; e LEB128 highs, none ending in a zero byte (a zero or overlong value), none longer
    than an element's high part, nothing trailing. 0 or an error code as `_parse`. (A value wider
    than the element within that length XORs fewer bits: the final checksum refuses it.)"""
    nw = positions.size // 8
    words = positions[: 8 * nw].view(np.uint64)
    c = _popcount(words)
    for t in range(8 * nw, positions.size):
        c += np.int64(_popcount64(np.uint64(positions[t])))
    if c != e:
        return 3
    if n % 8 and positions[positions.size - 1] >> (n % 8):
        return 2
    terms, zero, run, longest = 0, 0, 0, 0
    for j in range(highs.size):
        b = highs[j]
        term = b < 128
        terms += term
        zero |= b == 0
        run = (run + 1) * (1 - term)  # continuation bytes in a row
        longest = max(longest, run)
    if zero or longest >= (high_bits + 6) // 7:
        return 5
    if highs.size and highs[highs.size - 1] >= 128:
        return 4
    if terms != e:
        return 4 if terms < e else 6
    return 0


@_jit
def _apply_bitmap(cur, positions, highs, sh):
    """cur[i] ^= high << sh for each marked i, highs read as they come (validated beforehand)."""
    c = 0
    nw = positions.size // 8
    words = positions[: 8 * nw].view(np.uint64)
    for j in range(nw + 1):
        w = words[j] if j < nw else np.uint64(0)
        if j == nw:
            for t in range(positions.size - 8 * nw):
                w |= np.uint64(positions[8 * nw + t]) << np.uint64(8 * t)
        while w:
            i = 64 * j + trailing_zeros(w)
            w &= w - np.uint64(1)
            b = highs[c]
            if b < 128:
                h = np.uint64(b)
                c += 1
            else:
                h, c = _read_varint(highs, c)
            cur[i] ^= h << sh


@_jit
def _scatter_xor(cur, pos, h, sh):
    for c in range(pos.size):
        cur[pos[c]] ^= h[c] << sh


@_jit
def _bitlen_hist(a, b, starts, chunk, hist):
    for s in starts:
        for i in range(s, min(s + chunk, a.size)):
            hist[64 - leading_zeros(np.uint64(a[i] ^ b[i]))] += 1


_PARSE_ERRORS = {
    1: "exception positions are truncated or malformed",
    2: "exception positions are out of order or past the tensor",
    3: "exception positions mark a different count than the index declares",
    4: "exception high parts are truncated or malformed",
    5: "an exception high part is zero or wider than the element",
    6: "exception streams hold trailing bytes",
}


def choose_low_bits(a: np.ndarray, b: np.ndarray) -> int:
    """L with the smallest estimated size (plus EXCEPTION_PENALTY per exception), from the bit
    lengths of a ^ b over up to SAMPLE_CHUNKS evenly spaced runs of SAMPLE_CHUNK elements."""
    width, n = a.dtype.itemsize, a.size
    hist = np.zeros(65, np.int64)
    if n <= SAMPLE_CHUNK * SAMPLE_CHUNKS:
        starts = np.zeros(1, np.int64)
        chunk = max(n, 1)
    else:
        starts = np.linspace(0, n - SAMPLE_CHUNK, SAMPLE_CHUNKS).astype(np.int64)
        chunk = SAMPLE_CHUNK
    _bitlen_hist(a, b, starts, chunk, hist)
    return int(_choose(hist, np.array(low_bits_choices(width), np.int64), width, EXCEPTION_PENALTY))


@_jit
def _choose(hist, choices, width, penalty):
    m = max(hist.sum(), 1)
    best, best_cost = 8 * width, float(width)
    for L in choices:
        if L == 8 * width:
            continue
        frac, high = 0.0, 0.0
        for k in range(L + 1, 65):
            frac += hist[k]
            high += hist[k] * ((k - L + 6) // 7)  # varint bytes of x >> L
        frac, high = frac / m, high / m
        pos = min(frac * (1.0 + np.floor(np.log2(1.0 / frac) / 7.0)), 0.125) if frac > 0 else 0.0
        cost = L / 8 + pos + high + penalty * frac
        if cost < best_cost:
            best, best_cost = L, cost
    return best


class Scratch:
    """Per-thread reusable buffers for `encode` (no page faults after the first tensor)."""

    def __init__(self):
        self.bufs: dict[str, np.ndarray] = {}

    def get(self, name: str, size: int, dtype=np.uint8) -> np.ndarray:
        b = self.bufs.get(name)
        if b is None or b.size < size:
            b = self.bufs[name] = np.empty(max(size, 64), dtype)
        return b[:size]


def encode(a: np.ndarray, b: np.ndarray, low_bits: int | None = None, scratch: Scratch | None = None):
    """Words a, b (same dtype) -> dict(low_bits, exceptions, positions="gaps"|"bitmap", changed,
    sections=[low, positions, highs]). Sections may view `scratch` (valid until its next use)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.ndim != 1:
        raise ValueError(f"lowbits.encode: words {a.dtype}{a.shape} vs {b.dtype}{b.shape}")
    width, n = a.dtype.itemsize, a.size
    L = choose_low_bits(a, b) if low_bits is None else low_bits
    if L not in low_bits_choices(width):
        raise ValueError(f"lowbits.encode: L={L} for width {width}; allowed {low_bits_choices(width)}")
    s = scratch or Scratch()
    enc, _ = _pack_kernels(width, L)
    npad = -(-n // 64) * 64
    low = s.get("low", low_len(n, L))
    hi8 = s.get("hi8", n)
    bm = s.get("bm", npad // 64, np.uint64)
    changed = int(enc(a, b, low, hi8, bm))
    if L == 8 * width or changed == 0:
        return {"low_bits": L, "exceptions": 0, "positions": "gaps", "changed": changed,
                "sections": [low, b"", b""]}  # fmt: skip
    e = int(_popcount(bm))
    # dense exceptions keep the bitmap: a few more bytes than gaps, none of their scalar work
    use_gaps = e * BITMAP_DENSITY < n
    gaps, highs = s.get("gaps", 10 * e + 1), s.get("highs", 10 * e + 1)  # varint bytes <= 10, +1 spare
    _, g, c = _scan(a, b, hi8, np.uint64(L), bm, use_gaps, gaps, highs)
    bitmap = bm.view(np.uint8)[: (n + 7) // 8]
    return {"low_bits": L, "exceptions": e, "positions": "gaps" if use_gaps else "bitmap", "changed": changed,
            "sections": [low, gaps[:g] if use_gaps else bitmap, highs[:c]]}  # fmt: skip


def apply_(cur: np.ndarray, low_bits: int, low, positions, positions_kind: str, highs, exceptions: int):
    """In place: words `cur` ^= the delta. Everything is validated before `cur` is touched; a
    malformed delta raises ValueError and leaves `cur` as it was. XOR-ing the same delta again
    restores `cur` (the caller's undo)."""
    width, n = cur.dtype.itemsize, cur.size
    if low_bits not in low_bits_choices(width):
        raise ValueError(f"lowbits: L={low_bits!r} for width {width}")
    low = np.frombuffer(low, np.uint8)
    if low.size != low_len(n, low_bits):
        raise ValueError(f"lowbits: low section is {low.size} bytes, expected {low_len(n, low_bits)}")
    if positions_kind not in ("gaps", "bitmap"):
        raise ValueError(f"lowbits: unknown positions kind {positions_kind!r}")
    positions, highs = np.frombuffer(positions, np.uint8), np.frombuffer(highs, np.uint8)
    e = int(exceptions)
    if e < 0 or e > n or (e and low_bits == 8 * width):
        raise ValueError(f"lowbits: {exceptions!r} exceptions for {n} elements at L={low_bits}")
    if positions_kind == "bitmap" and positions.size != (n + 7) // 8:
        raise ValueError(f"lowbits: positions bitmap is {positions.size} bytes for {n} elements")
    _, unpack = _pack_kernels(width, low_bits)
    if positions_kind == "bitmap":  # dense exceptions: validated in place, then one walk
        err = _check_bitmap_highs(positions, highs, n, e, 8 * width - low_bits)
        if err:
            raise ValueError(f"lowbits: {_PARSE_ERRORS[err]}")
        unpack(cur, low)
        _apply_bitmap(cur, positions, highs, np.uint64(low_bits))
        return cur
    pos, h = np.empty(e, np.int64), np.empty(e, np.uint64)
    err = _parse(positions, highs, n, e, 8 * width - low_bits, pos, h)
    if err:
        raise ValueError(f"lowbits: {_PARSE_ERRORS[err]}")
    unpack(cur, low)
    if e:
        _scatter_xor(cur, pos, h, np.uint64(low_bits))
    return cur
