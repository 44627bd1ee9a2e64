"""Weights handed to a colocated engine through host shared memory (`--colocate`, tensor transport).

A trainer rank writes its HF-named export into one POSIX shared-memory segment and hands the engine
on its device a small JSON descriptor; the engine's `/update_weights_from_tensor` (SGLang's name)
maps the segment, copies the tensors out and loads them as one update. No disk, no pickle, no hop
through the driver:

    {"format": "shared_memory", "segment": "miles_w_...", "nbytes": N,
     "tensors": [{"name": "model.embed_tokens.weight", "dtype": "float32", "shape": [V, H], "offset": 0}, ...]}

The writer owns the segment (unlinked by `Staged.close`, or by Python's resource tracker if the
writer dies); a reader maps it read-only without taking ownership. SGLang itself receives CUDA IPC handles
pickled by its MultiprocessingSerializer; the embedded engine takes only this descriptor.
"""

from __future__ import annotations

import mmap
import os
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from kernels.xor_delta import tensor_bytes
from miles_platform.errors import MilesError

FORMAT = "shared_memory"
_ALIGN = 64
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                                     torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool,
                                                     torch.float8_e4m3fn, torch.float8_e5m2)}  # fmt: skip


@dataclass
class Staged:
    descriptor: dict
    segment: shared_memory.SharedMemory

    def close(self) -> None:
        self.segment.close()
        self.segment.unlink()


def stage(named: dict[str, torch.Tensor]) -> Staged:
    """Copy `named` (any device) into a new shared-memory segment; -> its owner and descriptor."""
    entries, offset = [], 0
    for name, t in named.items():
        entries.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "offset": offset})  # fmt: skip
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    seg = shared_memory.SharedMemory(
        create=True, size=max(offset, 1), name=f"miles_w_{uuid.uuid4().hex[:16]}"
    )
    buf = torch.frombuffer(seg.buf, dtype=torch.uint8, count=max(offset, 1))
    for e, t in zip(entries, named.values(), strict=True):
        data = tensor_bytes(t)
        buf[e["offset"] : e["offset"] + data.numel()].copy_(data)
    del buf  # no view may outlive the segment's mapping
    desc = {"format": FORMAT, "segment": seg.name, "nbytes": offset, "tensors": entries}
    return Staged(desc, seg)


@contextmanager
def open_staged(descriptor: dict):
    """Yields {name: tensor} copied out of a staged segment (the reader never keeps the mapping)."""
    if not isinstance(descriptor, dict) or descriptor.get("format") != FORMAT:
        raise MilesError(f"update_weights_from_tensor: expected a {FORMAT!r} descriptor")
    seg = _attach(descriptor.get("segment"))
    try:
        out = {}
        for e in descriptor["tensors"]:
            dtype = _DTYPES.get(e["dtype"])
            shape = [int(x) for x in e["shape"]]
            if dtype is None:
                raise MilesError(f"update_weights_from_tensor: {e['name']}: unknown dtype {e['dtype']!r}")
            n = 1
            for x in shape:
                n *= x
            nbytes, off = n * torch.tensor([], dtype=dtype).element_size(), int(e["offset"])
            if off < 0 or off + nbytes > len(seg):
                raise MilesError(f"update_weights_from_tensor: {e['name']} lies outside the segment")
            if nbytes:
                raw = torch.frombuffer(seg, dtype=torch.uint8, count=nbytes, offset=off)
                out[e["name"]] = raw.clone().view(dtype).reshape(shape)
                del raw
            else:
                out[e["name"]] = torch.empty(shape, dtype=dtype)
        yield out
    finally:
        seg.close()


def _attach(name) -> mmap.mmap:
    """Map a segment read-only without registering it with Python's resource tracker (SharedMemory
    would, and a tracker shared with the writer, in this process or a sibling, would then lose it)."""
    import _posixshmem

    if not isinstance(name, str) or not name.startswith("miles_w_"):
        raise MilesError(f"update_weights_from_tensor: {name!r} is not a segment this platform staged")
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, 0)
    except FileNotFoundError as e:
        raise MilesError(f"update_weights_from_tensor: no shared-memory segment {name!r}") from e
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_COPY)  # private: never writes back
    finally:
        os.close(fd)
