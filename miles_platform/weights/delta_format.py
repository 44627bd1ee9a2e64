"""On-disk layout of a disk-delta publication dir: names, index reading, payload codec, atomic IO.

See `miles_platform.weights.disk_delta` for the format description, publishing and applying.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from miles_platform.errors import PublicationError

FORMAT = "miles-disk-delta/1"
INDEX, PAYLOAD, LATEST, LOCK = "index.json", "payload.bin", "LATEST", ".publish.lock"
VERSION_FILE = "miles_weight_version.json"
WEIGHTS_FILE = "model.safetensors"
VERSION_META_KEY = "miles_weight_version"
ENCODINGS = ("xor", "overwrite")
COMPRESSIONS = ("zstd", "none")

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
        torch.float8_e5m2, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip


def version_dir_name(version: int) -> str:
    return f"weight_v{version:06d}"


# ---- small IO helpers (miles_platform/store/atomic.py) ----------------------------------------


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise PublicationError(f"unsupported dtype {name!r} in publication index")
    return _DTYPES[name]


def dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


class Codec:
    def __init__(self, compression: str, level: int = 1):
        if compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {compression!r}; allowed: {', '.join(COMPRESSIONS)}")
        self.compression = compression
        if compression == "zstd":
            import zstandard

            self._c = zstandard.ZstdCompressor(level=level, write_checksum=True)
            self._d = zstandard.ZstdDecompressor()

    def compress(self, buf: torch.Tensor) -> bytes:
        mv = memoryview(buf.numpy())
        return self._c.compress(mv) if self.compression == "zstd" else mv.tobytes()

    def decompress_into(self, frame: memoryview, out: torch.Tensor) -> None:
        """Decode one frame into `out` (uint8, exact length) or raise ValueError."""
        dst = memoryview(out.numpy())
        if self.compression == "none":
            if len(frame) != len(dst):
                raise ValueError(f"frame is {len(frame)} bytes, expected {len(dst)}")
            dst[:] = frame
            return
        import zstandard

        try:
            with self._d.stream_reader(frame, read_across_frames=False) as r:
                n = 0
                while n < len(dst):
                    k = r.readinto(dst[n:])
                    if not k:
                        break
                    n += k
                extra = r.read(1)
        except zstandard.ZstdError as e:
            raise ValueError(f"zstd: {e}") from e
        if n != len(dst) or extra:
            raise ValueError(f"frame decodes to a different length than the expected {len(dst)} bytes")


# ---- reading a publication dir ----------------------------------------------------------------


def read_latest(pub_dir: str | os.PathLike) -> int | None:
    """The committed version named by LATEST, or None for an empty publication dir."""
    p = Path(pub_dir) / LATEST
    if not p.exists():
        return None
    text = p.read_text().strip()
    if not text.isdigit():
        raise PublicationError(f"{p}: corrupt LATEST pointer {text[:40]!r}")
    return int(text)


def read_index(pub_dir: str | os.PathLike, version: int) -> dict:
    d = Path(pub_dir) / version_dir_name(version)
    where = f"publication {version_dir_name(version)} in {pub_dir}"
    if not d.is_dir():
        raise PublicationError(f"{where}: missing version directory")
    try:
        idx = json.loads((d / INDEX).read_text())
    except FileNotFoundError as e:
        raise PublicationError(f"{where}: missing {INDEX}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PublicationError(f"{where}: corrupt {INDEX} ({e})") from e
    if idx.get("format") != FORMAT or idx.get("version") != version:
        raise PublicationError(
            f"{where}: {INDEX} declares format {idx.get('format')!r} version {idx.get('version')!r}"
        )
    return idx


def committed_versions(pub_dir: str | os.PathLike) -> list[int]:
    latest = read_latest(pub_dir)
    if latest is None:
        return []
    out = []
    for d in Path(pub_dir).glob("weight_v*"):
        v = d.name.removeprefix("weight_v")
        if v.isdigit() and int(v) <= latest:
            out.append(int(v))
    return sorted(out)


def list_publications(pub_dir: str | os.PathLike) -> list[dict]:
    """One row per committed version (index summary), oldest first; unreadable indices marked."""
    rows = []
    for v in committed_versions(pub_dir):
        try:
            idx = read_index(pub_dir, v)
            rows.append(
                {k: idx.get(k) for k in ("version", "base_version", "kind", "encoding", "checksum")}
                | {k: idx["stats"].get(k) for k in ("wire_bytes", "full_bytes", "density")}
            )
        except PublicationError as e:
            rows.append({"version": v, "error": str(e)})
    return rows  # fmt: skip
