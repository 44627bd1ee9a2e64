"""Checksums of complete tensors for disk-delta publications: xxh3-128 (default), blake3, adler32.

Computed over the tensor's raw bytes (`kernels.xor_delta.tensor_bytes`), so the same bytes give
the same hex string on the trainer and on every replica, whatever dtype.
"""

from __future__ import annotations

import zlib

import torch

from kernels.xor_delta import tensor_bytes

CHECKSUM_ALGOS = ("xxh3-128", "blake3", "adler32")


def _buffer(x) -> memoryview:
    if isinstance(x, torch.Tensor):
        return memoryview(tensor_bytes(x).numpy())
    return memoryview(x)


def checksum(x: torch.Tensor | bytes | bytearray | memoryview, algo: str = "xxh3-128") -> str:
    """Hex checksum of a tensor's (or a buffer's) complete bytes."""
    buf = _buffer(x)
    if algo == "xxh3-128":
        import xxhash

        return xxhash.xxh3_128_hexdigest(buf)
    if algo == "blake3":
        import blake3

        return blake3.blake3(buf).hexdigest()
    if algo == "adler32":
        return f"{zlib.adler32(buf) & 0xFFFFFFFF:08x}"
    raise ValueError(f"unknown checksum {algo!r}; allowed: {', '.join(CHECKSUM_ALGOS)}")
