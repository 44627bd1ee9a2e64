"""Kernels against their torch references: xor / overwrite deltas, log-probs, entropy, checksums."""

import os
import zlib

import blake3
import numpy as np
import pytest
import torch
import xxhash

from kernels import byteplane as bp
from kernels import logprob as lp
from kernels import lowbits as lb
from kernels import xor_delta as xd
from miles_platform.weights.checksum import checksum


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 1000, 70_001])
def test_byteplane_split_merge_match_reference_and_invert(width, n):
    g = torch.Generator().manual_seed(n * 10 + width)
    a = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=g)
    b = a.clone()
    b[torch.rand(b.shape, generator=g) < 0.3] ^= 0x5A
    planes = bp.xor_split(a, b, width)
    assert planes.shape == (width, n)
    assert torch.equal(planes, bp.xor_split_reference(a, b, width))
    assert torch.equal(bp.xor_split(a, None, width), bp.xor_split_reference(a, None, width))
    assert torch.equal(bp.xor_merge(a, planes, width), b)  # a ^ (a ^ b)
    assert torch.equal(bp.xor_merge(None, bp.xor_split(b, None, width), width), b)
    assert torch.equal(bp.xor_merge(a, planes, width), bp.xor_merge_reference(a, planes, width))
    assert bp.count_nonzero_rows(planes) == [int(torch.count_nonzero(r)) for r in planes]


@pytest.mark.parametrize("density", [0.0, 0.001, 0.5, 1.0])
@pytest.mark.parametrize("n", [1, 9, 65_537])
def test_sparse_plane_pack_matches_reference_and_unpacks(density, n):
    g = torch.Generator().manual_seed(n)
    plane = torch.randint(1, 256, (n,), dtype=torch.uint8, generator=g)
    plane[torch.rand(n, generator=g) >= density] = 0
    bitmap, values = bp.sparse_pack(plane)
    rbitmap, rvalues = bp.sparse_pack_reference(plane)
    assert bitmap.tobytes() == rbitmap.tobytes() and values.tobytes() == rvalues.tobytes()
    assert bitmap.size == (n + 7) // 8 and values.size == int(torch.count_nonzero(plane))
    assert torch.equal(bp.sparse_unpack(bitmap.tobytes(), values.tobytes(), n), plane)
    ref = bp.sparse_unpack_reference(bitmap, values, n)
    assert ref.tobytes() == plane.numpy().tobytes()


@pytest.mark.parametrize("n", [1, 9, 16, 65_537])
def test_sparse_positions_and_scatter_xor(n):
    g = torch.Generator().manual_seed(n)
    width, plane_k = 4, 2
    plane = torch.randint(1, 256, (n,), dtype=torch.uint8, generator=g)
    plane[torch.rand(n, generator=g) >= 0.01] = 0
    bitmap, values = bp.sparse_pack(plane)
    tail = bitmap.copy()
    if n % 8:
        tail[-1] |= 0x80  # a set bit past element n-1 is not a position
    pos = bp.sparse_positions(tail.tobytes(), n)
    assert pos.tolist() == torch.nonzero(plane).reshape(-1).tolist()
    base = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=g)
    out = base.clone()
    bp.sparse_xor_(out.numpy(), bitmap.tobytes(), values.tobytes(), n, width, plane_k)
    planes = torch.zeros((width, n), dtype=torch.uint8)
    planes[plane_k] = plane
    assert torch.equal(out, bp.xor_merge_reference(base, planes, width))
    if values.size:
        with pytest.raises(ValueError, match="values stored"):
            bp.sparse_xor_(out.numpy(), bitmap.tobytes(), values[:-1].tobytes(), n, width, plane_k)


def test_sparse_plane_with_inconsistent_bitmap_is_refused():
    plane = torch.tensor([0, 3, 0, 0, 7, 0, 0, 0, 9], dtype=torch.uint8)
    bitmap, values = bp.sparse_pack(plane)
    bad = bitmap.copy()
    bad[0] |= 0x01  # marks one more byte than values holds: must not read past the values
    with pytest.raises(ValueError, match="bitmap marks 4 bytes, 3 values stored"):
        bp.sparse_unpack(bad.tobytes(), values.tobytes(), plane.numel())
    with pytest.raises(ValueError, match="bitmap is 1 bytes for 9 elements"):
        bp.sparse_unpack(bitmap[:1].tobytes(), values.tobytes(), plane.numel())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.uint8])
@pytest.mark.parametrize("n", [1, 7, 1000, 4099])
def test_xor_and_overwrite_match_reference_and_round_trip(dtype, n):
    g = torch.Generator().manual_seed(n)
    old = torch.randint(0, 100, (n,), generator=g).to(dtype)
    new = old.clone()
    mask = torch.rand(n, generator=g) < 0.3
    new[mask] = torch.randint(100, 200, (int(mask.sum()),), generator=g).to(dtype)
    a, b = xd.tensor_bytes(old), xd.tensor_bytes(new)
    delta = xd.xor_bytes(a, b)
    assert torch.equal(delta, xd.xor_bytes_reference(a, b))
    assert torch.equal(xd.apply_xor_(a.clone(), delta), b)
    idx, vals = xd.changed_positions(a, b, old.element_size())
    ridx, rvals = xd.changed_positions_reference(a, b, old.element_size())
    assert torch.equal(idx, ridx) and torch.equal(vals, rvals)
    assert torch.equal(idx, mask.nonzero().reshape(-1)) or dtype == torch.uint8  # uint8: 100..199 may wrap
    gaps, _ = xd.encode_indices(idx)
    assert torch.equal(xd.decode_indices(gaps), idx)
    patched = xd.apply_overwrite_(a.clone(), idx, vals, old.element_size())
    assert torch.equal(patched, b)
    assert torch.equal(xd.apply_overwrite_(patched, idx, vals, old.element_size()), b)  # idempotent


def test_xor_unaligned_views_fall_back_exactly():
    buf = torch.arange(64, dtype=torch.uint8)
    a, b = buf[3:40], buf[5:42]  # storage offsets not multiple of 8
    assert torch.equal(xd.xor_bytes(a, b), torch.bitwise_xor(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_log_softmax_equals_reference(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 37, 101, generator=g)).to(dtype)
    tokens = torch.randint(0, 101, (2, 37), generator=g)
    ours = lp.selective_log_softmax(logits, tokens, chunk_size=8)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, lp.log_probs_reference(logits, tokens), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        lp.entropy_from_logits(logits, 5), lp.entropy_reference(logits), atol=1e-5, rtol=1e-5
    )


def test_checksums_each_algo():
    t = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    raw = xd.tensor_bytes(t).numpy().tobytes()
    assert checksum(t) == checksum(t, "xxh3-128") == xxhash.xxh3_128_hexdigest(raw)
    assert checksum(t, "blake3") == blake3.blake3(raw).hexdigest()
    assert checksum(t, "adler32") == f"{zlib.adler32(raw):08x}"
    flipped = bytearray(raw)
    flipped[500] ^= 1
    for algo in ("xxh3-128", "blake3", "adler32"):
        assert checksum(raw, algo) == checksum(t, algo)
        assert checksum(bytes(flipped), algo) != checksum(t, algo)
    with pytest.raises(ValueError, match="allowed"):
        checksum(t, "md5")


def _lowbits_case(width: int, n: int, density: float, seed: int = 0):
    """Words a and b = a ^ x, x nonzero with probability `density`, of random bit length."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 2 ** (8 * width) - 1, n, dtype=np.uint64, endpoint=True).astype(lb._UINT[width])
    bits = rng.integers(1, 8 * width + 1, n).astype(np.uint64)
    x = rng.integers(0, 2**63, n, dtype=np.uint64) >> (np.uint64(64) - np.minimum(bits, np.uint64(63)))
    x = x * (rng.random(n) < density)
    return a, a ^ x.astype(lb._UINT[width])


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 3, 64, 65, 1000])
def test_lowbits_matches_reference_and_applies(width, n):
    """Every L (and the sampled choice) against the numpy reference, byte for byte: packed low bits,
    positions as gaps or bitmap, high parts; applying the delta gives b, applying it again gives a."""
    for density in (0.0, 0.01, 0.5, 1.0):
        a, b = _lowbits_case(width, n, density)
        for L in (*lb.low_bits_choices(width), None):
            r = lb.encode(a, b, L)
            low, pos, highs, changed = lb.encode_reference(a, b, r["low_bits"])
            assert bytes(r["sections"][0]) == low and r["changed"] == changed == np.count_nonzero(a != b)
            assert r["exceptions"] == pos.size and bytes(r["sections"][2]) == lb.highs_reference(highs)
            if r["positions"] == "gaps":
                assert bytes(r["sections"][1]) == lb.positions_gaps_reference(pos)
            else:
                assert bytes(r["sections"][1]) == lb.positions_bitmap_reference(pos, n)
            secs = [bytes(s) for s in r["sections"]]
            cur = a.copy()
            args = (r["low_bits"], secs[0], secs[1], r["positions"], secs[2], r["exceptions"])
            lb.apply_(cur, *args)
            assert np.array_equal(cur, b) and np.array_equal(
                lb.apply_reference(a, low, pos, highs, r["low_bits"]), b
            )
            lb.apply_(cur, *args)
            assert np.array_equal(cur, a)


def test_lowbits_choice_follows_the_bit_lengths():
    """fp32-like deltas of ~10 bits pick a small L with exceptions; a sparse delta picks L = 0; noise
    in every bit stores the words whole (L = 32, no exceptions)."""
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    short = a ^ rng.integers(0, 1 << 10, a.size, dtype=np.uint64).astype(np.uint32)
    assert 8 <= lb.choose_low_bits(a, short) <= 12
    sparse = a.copy()
    sparse[::200] ^= np.uint32(3)
    assert lb.choose_low_bits(a, sparse) == 0
    noise = rng.integers(0, 2**32, a.size, dtype=np.uint64).astype(np.uint32)
    r = lb.encode(a, noise)
    assert r["low_bits"] == 32 and r["exceptions"] == 0


@pytest.mark.parametrize(
    "mutate, error",
    [
        (lambda s, e: (s[0], s[1] + b"\x01", s[2], e), "trailing bytes"),
        (lambda s, e: (s[0], s[1][:-1], s[2], e), "positions are truncated"),
        (lambda s, e: (s[0], s[1], s[2][:-1], e), "high parts are truncated"),
        (lambda s, e: (s[0], s[1], b"\x00" * e, e), "high part is zero"),
        (lambda s, e: (s[0], b"\x80" * 11, s[2], e), "positions are truncated or malformed"),
        (lambda s, e: (s[0][:-1], s[1], s[2], e), "low section is"),
        (lambda s, e: (s[0], s[1], s[2], e + 1), "positions are truncated|positions mark"),
    ],
)
def test_lowbits_malformed_streams_are_refused_untouched(mutate, error):
    a, b = _lowbits_case(4, 500, 0.02)
    r = lb.encode(a, b, 8)
    assert r["positions"] == "gaps" and r["exceptions"] > 2
    low, positions, highs, e = mutate([bytes(s) for s in r["sections"]], r["exceptions"])
    cur = a.copy()
    with pytest.raises(ValueError, match=error):
        lb.apply_(cur, 8, low, positions, "gaps", highs, e)
    assert np.array_equal(cur, a)


def test_lowbits_bitmap_past_the_end_or_miscounted_is_refused():
    a, b = _lowbits_case(2, 999, 0.3)
    r = lb.encode(a, b, 4)
    assert r["positions"] == "bitmap"
    low, bitmap, highs = (bytes(s) for s in r["sections"])
    past = bitmap[:-1] + bytes([bitmap[-1] | 0x80])  # bit 999 of a 999-element tensor
    for positions, e, error in (
        (past, r["exceptions"] + 1, "past the tensor"),
        (bitmap, r["exceptions"] - 1, "different count"),
    ):
        cur = a.copy()
        with pytest.raises(ValueError, match=error):
            lb.apply_(cur, 4, low, positions, "bitmap", highs, e)
        assert np.array_equal(cur, a)


def test_pack_kernels_are_compiled_once_per_machine_not_per_process(tmp_path):
    """The (width, L) pack kernels are a copy of kernels/lowbits_pack.py under the kernel cache dir
    with numba's on-disk cache: a second process loads the first one's machine code (a cache hit)
    instead of compiling again (~0.3-0.6 CPU-s per kernel in every publisher and engine)."""
    import subprocess
    import sys

    script = (
        "import numpy as np; from kernels import lowbits as lb\n"
        "a = np.arange(200, dtype=np.uint16); enc, unpack = lb._pack_kernels(2, 4)\n"
        "low, hi8, bm = np.zeros(200, np.uint8), np.zeros(200, np.uint8), np.zeros(4, np.uint64)\n"
        "enc(a, a ^ np.uint16(3), low, hi8, bm); cur = a.copy(); unpack(cur, low)\n"
        "print(sum(enc.stats.cache_hits.values()), sum(enc.stats.cache_misses.values()))\n"
    )
    env = {**os.environ, "MILES_KERNEL_CACHE": str(tmp_path / "kc")}
    runs = [
        subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        for _ in range(2)
    ]
    first, second = (tuple(map(int, r.stdout.split())) for r in runs)
    assert first == (0, 1) and second == (1, 0), (first, second)
    copies = sorted(p.name for p in (tmp_path / "kc").glob("*.py"))
    assert len(copies) == 1 and copies[0].endswith("_w2_l4.py"), copies
    assert "W, L = 2, 4" in (tmp_path / "kc" / copies[0]).read_text()
