"""Atomic writes, one place: temp name in the same directory, fsync, rename, fsync the directory.

Everything that others read (shards, checkpoints, publications, pointers) is written through
these, so a reader sees the previous complete state or the new complete state, never a torn one.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file below `path`, then `path` itself."""
    for f in Path(path).rglob("*"):
        if f.is_file():
            fsync_file(f)
    fsync_dir(path)


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Replace the file at `path` with `data` in one rename (pointer files, small JSON)."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def replace_dir(tmp: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Rename the complete dir `tmp` to `dest`; an existing `dest` is moved aside first, removed after."""
    tmp, dest = Path(tmp), Path(dest)
    old = None
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(dest, old)
    os.rename(tmp, dest)
    fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
