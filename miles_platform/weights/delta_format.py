"""On-disk layout of a disk-delta publication dir: names, index reading, payload codec, atomic IO.
The readers take a local dir or an object-store URI (s3://...: read through fsspec).

See `miles_platform.weights.disk_delta` for the format description, publishing and applying.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import torch

from miles_platform.errors import PublicationError
from miles_platform.store import remote

FORMAT = "miles-disk-delta/3"
# /1: one frame per tensor, no filter; /2: byte-plane filter; /3: adds the lowbits filter for xor deltas
READABLE_FORMATS = ("miles-disk-delta/1", "miles-disk-delta/2", FORMAT)
INDEX, PAYLOAD, LATEST, LOCK = "index.json", "payload.bin", "LATEST", ".publish.lock"
VERSION_FILE = "miles_weight_version.json"
WEIGHTS_FILE = "model.safetensors"
VERSION_META_KEY = "miles_weight_version"
ENCODINGS = ("xor", "overwrite")
COMPRESSIONS = ("zstd", "none")
FILTERS = ("lowbits", "byteplane", "none")

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
        self.compression, self.level = compression, level
        self._local = threading.local()  # zstd (de)compressor objects are not thread-safe: one per thread

    @property
    def _c(self):
        c = getattr(self._local, "c", None)
        if c is None:
            import zstandard

            c = self._local.c = zstandard.ZstdCompressor(level=self.level, write_checksum=True)
        return c

    @property
    def _d(self):
        d = getattr(self._local, "d", None)
        if d is None:
            import zstandard

            d = self._local.d = zstandard.ZstdDecompressor()
        return d

    def compress(self, buf: torch.Tensor) -> bytes:
        mv = memoryview(buf.numpy())
        return self._c.compress(mv) if self.compression == "zstd" else mv.tobytes()

    _PROBE = 16 << 10  # bytes per probe window; three windows (start, middle, end)

    def section(self, buf) -> tuple[bytes | memoryview, str]:
        """One payload section: (bytes, "zstd"|"none"). Under zstd, three 16 KiB probes decide first:
        a section they show incompressible (noise: the low mantissa plane, bitmaps of 50%-dense
        planes) is stored raw instead of paying zstd's pass over it for nothing."""
        a = buf.numpy() if isinstance(buf, torch.Tensor) else np.asarray(buf)
        if self.compression == "none" or a.size == 0:
            return memoryview(a), "none"
        if a.size > 8 * self._PROBE:
            w, mid = self._PROBE, a.size // 2
            probe = sum(len(self._c.compress(a[i : i + w])) for i in (0, mid, a.size - w))
            if probe >= 0.97 * 3 * w:
                return memoryview(a), "none"
        z = self._c.compress(memoryview(a))
        return (z, "zstd") if len(z) < a.size else (memoryview(a), "none")

    def decode_section(self, frame: memoryview, comp: str, out: torch.Tensor) -> None:
        """Decode one section stored as `comp` (a zstd publication holds raw sections too)."""
        if comp not in COMPRESSIONS:
            raise ValueError(f"unknown section compression {comp!r}")
        self.decompress_into(frame, out, comp)

    def decompress_into(self, frame: memoryview, out: torch.Tensor, compression: str | None = None) -> None:
        """Decode one frame (this codec's compression unless given) into `out` (uint8, exact
        length) or raise ValueError."""
        dst = memoryview(out.numpy())
        if (compression or self.compression) == "none":
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


def _read_file(pub_dir: str | os.PathLike, *parts: str) -> tuple[str, bytes | None]:
    """(path, bytes or None if absent) of a file of a local or object-store publication dir."""
    if remote.is_remote(pub_dir):
        url = remote.join(str(pub_dir), *parts)
        return url, remote.read_bytes(url)
    p = Path(pub_dir).joinpath(*parts)
    try:
        with open_regular(p) as f:
            return str(p), f.read()
    except FileNotFoundError:
        return str(p), None


def open_regular(path: str | os.PathLike):
    """Open a publication file for reading, refusing anything but a regular file: a FIFO (or a
    device) planted in a publication made `weights apply` block forever in open()."""
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # never blocks, whatever the file is
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise PublicationError(f"{path}: not a regular file (a FIFO, socket, device or directory)")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_latest(pub_dir: str | os.PathLike) -> int | None:
    """The committed version named by LATEST, or None for an empty publication dir."""
    p, raw = _read_file(pub_dir, LATEST)
    if raw is None:
        return None
    raw = raw.strip()
    if not raw.isdigit():  # bytes.isdigit: ASCII digits only (no UnicodeDecodeError, no '²')
        raise PublicationError(f"{p}: corrupt LATEST pointer {raw[:40]!r}")
    text = raw.decode()
    return int(text)


def read_index(pub_dir: str | os.PathLike, version: int) -> dict:
    where = f"publication {version_dir_name(version)} in {pub_dir}"
    if not remote.is_remote(pub_dir) and not (Path(pub_dir) / version_dir_name(version)).is_dir():
        raise PublicationError(f"{where}: missing version directory")
    _, raw = _read_file(pub_dir, version_dir_name(version), INDEX)
    if raw is None:
        raise PublicationError(f"{where}: missing {INDEX}")
    try:
        idx = json.loads(raw.decode())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PublicationError(f"{where}: corrupt {INDEX} ({e})") from e
    if not isinstance(idx, dict):
        raise PublicationError(f"{where}: {INDEX} is not a JSON object")
    if idx.get("format") not in READABLE_FORMATS or idx.get("version") != version:
        raise PublicationError(
            f"{where}: {INDEX} declares format {idx.get('format')!r} version {idx.get('version')!r}"
        )
    return idx


def committed_versions(pub_dir: str | os.PathLike) -> list[int]:
    latest = read_latest(pub_dir)
    if latest is None:
        return []
    out = []
    names = (
        remote.listdir(str(pub_dir))
        if remote.is_remote(pub_dir)
        else [d.name for d in Path(pub_dir).glob("weight_v*")]
    )
    for name in names:
        v = name.removeprefix("weight_v") if name.startswith("weight_v") else ""
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


# ---- the byte-plane filter: a tensor's bytes (or XOR delta) as per-plane sections ---------------


def encode_planes(planes: torch.Tensor, codec: Codec) -> tuple[list, list[dict], int]:
    """Encode (width, n) byte planes. Per plane, by its count of nonzero bytes k:
    `zero` (k = 0: nothing stored), `sparse` (k < 7n/8: bitmap + the k nonzero bytes, smaller than the
    plane itself), `dense` (the plane). Returns (section buffers in order, plane metadata for the
    index, total nonzero bytes)."""
    from kernels import byteplane as bp

    n = planes.shape[1]
    sections, metas, total = [], [], 0
    for row, k in zip(planes, bp.count_nonzero_rows(planes)):
        total += k
        if k == 0:
            metas.append({"mode": "zero", "nnz": 0, "sections": []})
            continue
        parts = list(bp.sparse_pack(row)) if 8 * k < 7 * n else [row]
        secs = []
        for part in parts:
            data, comp = codec.section(part)
            raw = part.numel() if isinstance(part, torch.Tensor) else part.size
            sections.append(data)
            secs.append([comp, len(data), raw])
        metas.append({"mode": "sparse" if len(parts) == 2 else "dense", "nnz": k, "sections": secs})
    return sections, metas, total


class SectionReader:
    """The consecutive sections of one tensor's payload region, each `[compression, stored bytes,
    raw bytes]`: every declared size is checked (against the expected raw size, when one is given,
    and the region) and `finish` requires the sections to cover the region exactly; any
    inconsistency raises ValueError (the caller fails closed)."""

    def __init__(self, region: memoryview, codec: Codec):
        self.region, self.codec, self.pos = region, codec, 0

    def take(self, sec, expect_raw: int | None, out: torch.Tensor | None = None):
        """The next section decoded into `out` (returned), or as a uint8 array: a view of the region
        when stored raw, else a fresh buffer."""
        comp, length, raw = sec
        bad_raw = (expect_raw is not None and raw != expect_raw) or raw < 0
        if bad_raw or length < 0 or self.pos + length > len(self.region):
            raise ValueError(f"section declares {raw} bytes ({length} stored), expected {expect_raw}")
        frame = self.region[self.pos : self.pos + length]
        self.pos += length
        if out is None and comp == "none" and length == raw:
            return np.frombuffer(frame, np.uint8)
        buf = torch.empty(raw, dtype=torch.uint8) if out is None else out
        self.codec.decode_section(frame, comp, buf)
        return buf if out is not None else buf.numpy()

    def finish(self) -> None:
        if self.pos != len(self.region):
            raise ValueError(f"tensor region is {len(self.region)} bytes, its sections take {self.pos}")


def _plane_parts(plane_metas: list[dict], region: memoryview, codec: Codec, n: int, dense_out):
    """Walk a byteplane tensor record: yield (plane, mode, data) with data None (zero), the decoded
    plane (dense: into `dense_out(k)`), or (bitmap, values) numpy arrays (sparse); every section is
    checked by a `SectionReader`."""
    sections = SectionReader(region, codec)
    for k, pm in enumerate(plane_metas):
        mode, secs, nnz = pm["mode"], pm["sections"], pm["nnz"]
        if mode == "zero" and not secs:
            yield k, mode, None
        elif mode == "dense" and len(secs) == 1:
            yield k, mode, sections.take(secs[0], n, out=dense_out(k))
        elif mode == "sparse" and len(secs) == 2:
            yield k, mode, (sections.take(secs[0], (n + 7) // 8), sections.take(secs[1], nnz))
        else:
            raise ValueError(f"plane {k}: bad plane record {pm!r}")
    sections.finish()


def decode_planes(
    plane_metas: list[dict], region: memoryview, codec: Codec, n: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of `encode_planes` from the tensor's payload region -> (width, n) planes."""
    from kernels import byteplane as bp

    planes = torch.empty((len(plane_metas), n), dtype=torch.uint8) if out is None else out
    if tuple(planes.shape) != (len(plane_metas), n):
        raise ValueError(f"planes buffer {tuple(planes.shape)} for {len(plane_metas)} planes of {n} bytes")
    for k, mode, data in _plane_parts(plane_metas, region, codec, n, lambda k: planes[k]):
        if mode == "zero":
            planes[k].zero_()
        elif mode == "sparse":
            bp.sparse_unpack(data[0], data[1], n, out=planes[k])
    return planes


def xor_sparse_planes(
    plane_metas: list[dict], region: memoryview, codec: Codec, cur: torch.Tensor
) -> torch.Tensor:
    """cur ^ delta for a delta record whose planes are all zero or sparse (the usual bf16 update):
    copy `cur` once and XOR only the marked bytes in place, without materializing any plane."""
    from kernels import byteplane as bp

    width = len(plane_metas)
    n = cur.numel() // width
    out = cur.clone()
    o = out.numpy()
    for k, _mode, data in _plane_parts(plane_metas, region, codec, n, None):
        if data is not None:
            bp.sparse_xor_(o, data[0], data[1], n, width, k)
    return out


# ---- the lowbits filter: an xor delta as packed low bits + exceptions (kernels/lowbits.py) ------


def lowbits_sections(p: dict, region: memoryview, codec: Codec, n: int, width: int) -> tuple:
    """(low, positions, highs) buffers of a lowbits record, every declared size checked against the
    tensor and the sections required to cover the region exactly; ValueError otherwise."""
    from kernels import lowbits as lb

    L, secs = p.get("low_bits"), p.get("sections")
    if L not in lb.low_bits_choices(width) or not isinstance(secs, list) or len(secs) != 3:
        raise ValueError(f"bad lowbits record: low_bits {L!r}, {len(secs or [])} sections")
    bitmap = (n + 7) // 8 if p.get("positions") == "bitmap" else None
    sections = SectionReader(region, codec)
    out = tuple(sections.take(sec, want) for sec, want in zip(secs, (lb.low_len(n, L), bitmap, None)))
    sections.finish()
    return out
