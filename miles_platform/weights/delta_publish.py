"""Publishing disk-delta versions: `DeltaPublisher` (one writer per publication dir, under
`.publish.lock`), snapshots every keyframe, XOR/overwrite deltas between, LATEST last.
The format: `disk_delta` (overview) and `delta_format` (names, index, planes)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import byteplane as bp
from kernels import lowbits as lb
from kernels import xor_delta as xd
from miles_platform.errors import PublicationError
from miles_platform.store import remote
from miles_platform.store.atomic import fsync_dir, write_atomic
from miles_platform.weights.checksum import CHECKSUM_ALGOS, checksum
from miles_platform.weights.delta_apply import _chain, _replay
from miles_platform.weights.delta_format import (
    ENCODINGS,
    FILTERS,
    FORMAT,
    INDEX,
    LATEST,
    LOCK,
    PAYLOAD,
    Codec,
    dtype_name,
    encode_planes,
    read_latest,
    version_dir_name,
)


@dataclass
class PublishStats:
    version: int
    base_version: int | None
    kind: str  # "snapshot" | "delta"
    wire_bytes: int  # payload bytes on disk (what a replica downloads)
    full_bytes: int  # bytes of the complete state
    density: float  # changed elements (lowbits, overwrite) or bytes (byteplane / no filter); 1.0 snapshots
    seconds: float  # the whole publish: encode + write + fsync + rename + LATEST
    path: str = ""
    encode_seconds: float = 0.0  # in-memory part: XOR, planes, compression, checksums


class _PublishLock:
    """Exclusive per-dir lock: O_CREAT|O_EXCL file with "pid host". A lock left by a dead process on
    this host is broken once; a live holder makes the second publisher fail cleanly."""

    def __init__(self, pub_dir: Path, wait_s: float = 0.0):
        self.path = pub_dir / LOCK
        self.token = f"{os.getpid()} {socket.gethostname()} {uuid.uuid4().hex[:8]}"
        self.deadline = time.monotonic() + wait_s

    def __enter__(self):
        broke = False
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if not broke and self._stale():
                    broke = True
                    self.path.unlink(missing_ok=True)
                    continue
                if time.monotonic() < self.deadline:
                    time.sleep(0.2)
                    continue
                holder = self.path.read_text().strip() if self.path.exists() else "?"
                raise PublicationError(
                    f"{self.path.parent}: another publisher holds {LOCK} ({holder}); one publisher per dir"
                ) from None
            with os.fdopen(fd, "w") as f:
                f.write(self.token)
            return self

    def _stale(self) -> bool:
        try:
            pid, host, *_ = self.path.read_text().split()
            if host != socket.gethostname():
                return False
            os.kill(int(pid), 0)
            return False
        except ProcessLookupError:
            return True
        except (OSError, ValueError):
            return False

    def __exit__(self, *exc):
        try:
            if self.path.read_text() == self.token:
                self.path.unlink()
        except FileNotFoundError:
            pass


class DeltaPublisher:
    """Writes successive versions of a state dict into `pub_dir`. Keeps the last published bytes in
    memory (reloaded by replaying the dir on restart) to diff against."""

    def __init__(
        self,
        pub_dir: str | os.PathLike,
        encoding: str = "xor",
        checksum: str = "xxh3-128",
        keyframe_interval: int = 10,
        compression: str = "zstd",
        zstd_level: int = 1,
        lock_wait_s: float = 0.0,
        filter: str = "lowbits",
        workers: int = 1,
    ):
        if encoding not in ENCODINGS:
            raise ValueError(f"--disk-delta-encoding {encoding!r}: allowed {', '.join(ENCODINGS)}")
        if checksum not in CHECKSUM_ALGOS:
            raise ValueError(f"--disk-delta-checksum {checksum!r}: allowed {', '.join(CHECKSUM_ALGOS)}")
        if filter not in FILTERS:
            raise ValueError(f"disk-delta filter {filter!r}: allowed {', '.join(FILTERS)}")
        if keyframe_interval < 1:
            raise ValueError(f"--disk-delta-keyframe-interval must be >= 1, got {keyframe_interval}")
        if workers < 1:
            raise ValueError(f"--disk-delta-encode-workers must be >= 1, got {workers}")
        # an object-store dir: versions are written in this host's local dir, then uploaded (payload,
        # index.json, LATEST last) and removed here; readers read the store (store/remote.py)
        self.url = str(pub_dir) if remote.is_remote(pub_dir) else None
        self.pub_dir = Path(remote.mirror_path(self.url) if self.url else pub_dir)
        self.encoding, self.algo, self.keyframe_interval = encoding, checksum, keyframe_interval
        self.codec = Codec(compression, zstd_level)
        self.filter = filter  # lowbits: xor deltas packed (snapshots as byte planes); byteplane: both planes
        self.lock_wait_s = lock_wait_s  # >0: wait for another publisher instead of failing at once
        self._loaded = False
        self._latest: int | None = None
        self._chain_len = 0  # publications since the last snapshot
        self._bufs: dict[str, torch.Tensor] = {}
        self._metas: dict[str, tuple[torch.dtype, list[int]]] = {}
        self._sums: dict[str, str] = {}
        self.workers = workers  # tensors encoded in parallel (numba, numpy, zstd release the GIL)
        self._local = threading.local()  # per-thread byte-plane scratch, reused (no page faults)

    @property
    def latest_version(self) -> int | None:
        return self._latest if self._loaded else read_latest(self.source)

    @property
    def source(self) -> str | Path:
        """Where readers find the publication: the object-store URI or the local dir."""
        return self.url or self.pub_dir

    def _load(self, latest: int | None) -> None:
        self._bufs, self._metas, self._sums, self._chain_len = {}, {}, {}, 0
        if latest is not None:
            chain = _chain(self.source, None, latest)
            _replay(self.source, chain, self._bufs, self._metas, None)
            self._sums = {t["name"]: t["checksum"] for t in chain[-1]["tensors"]}
            self._chain_len = len(chain) - 1
            if chain[-1]["checksum"] != self.algo:
                self._sums = {k: checksum(b, self.algo) for k, b in self._bufs.items()}
        self._latest, self._loaded = latest, True

    def _remove_uncommitted(self, latest: int | None) -> None:
        for d in self.pub_dir.glob("weight_v*"):
            v = d.name.removeprefix("weight_v")
            if v.isdigit() and (latest is None or int(v) > latest):
                shutil.rmtree(d, ignore_errors=True)  # renamed but never committed: no reader uses it
        for name in remote.listdir(self.url) if self.url else []:
            v = name.removeprefix("weight_v")
            if name.startswith("weight_v") and v.isdigit() and (latest is None or int(v) > latest):
                remote.remove(remote.join(self.url, name))  # an upload that died before LATEST named it

    def publish(self, state: dict[str, torch.Tensor], version: int | None = None) -> PublishStats:
        t0 = time.perf_counter()
        self.pub_dir.mkdir(parents=True, exist_ok=True)
        with _PublishLock(self.pub_dir, self.lock_wait_s):
            disk_latest = read_latest(self.source)
            if self._loaded and disk_latest != self._latest:
                self._loaded = False
                raise PublicationError(
                    f"{self.source}: LATEST moved to v{disk_latest} (expected v{self._latest}): "
                    "another publisher wrote this dir; refusing to publish"
                )
            if not self._loaded:
                self._load(disk_latest)
            self._remove_uncommitted(disk_latest)
            base = self._latest
            version = (0 if base is None else base + 1) if version is None else int(version)
            if base is not None and version <= base:
                raise PublicationError(f"{self.source}: v{version} <= latest published v{base}")
            new = {k: xd.tensor_bytes(v) for k, v in state.items()}
            metas = {k: (v.dtype, list(v.shape)) for k, v in state.items()}
            layout_same = metas == self._metas
            kind = (
                "delta"
                if base is not None and layout_same and self._chain_len + 1 < self.keyframe_interval
                else "snapshot"
            )
            idx, sums, changed = self._write_version(version, base, kind, new, metas)
            if self.url:
                local = self.pub_dir / version_dir_name(version)
                remote.upload_dir(str(local), remote.join(self.url, local.name), last=[INDEX])
                shutil.rmtree(local, ignore_errors=True)
            self._write_latest(version)
            # commit succeeded: advance the in-memory base
            if kind == "delta":
                for name in changed:
                    self._bufs[name].copy_(new[name])
            else:
                self._bufs = {name: b.clone() for name, b in new.items()}
            self._metas, self._sums, self._latest = metas, sums, version
            self._chain_len = 0 if kind == "snapshot" else self._chain_len + 1
        s = idx["stats"]
        return PublishStats(
            version, idx["base_version"], kind, s["wire_bytes"], s["full_bytes"], s["density"],
            time.perf_counter() - t0, str(remote.join(str(self.source), version_dir_name(version))), idx["_encode_s"],
        )  # fmt: skip

    def _write_latest(self, version: int) -> None:
        if self.url:
            remote.write_bytes(remote.join(self.url, LATEST), f"{version}\n")  # one PUT: atomic
        else:
            write_atomic(self.pub_dir / LATEST, f"{version}\n".encode())

    def _write_version(self, version, base, kind, new, metas):
        final = self.pub_dir / version_dir_name(version)
        tmp = self.pub_dir / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            entries, sums, changed, n_changed, n_total = [], {}, set(), 0, 0
            offset, write_s, t_start = 0, 0.0, time.perf_counter()
            with open(tmp / PAYLOAD, "wb") as f:
                for name, (entry, frames, k, n) in self._encoded(new, metas, kind):
                    if frames is not None:
                        length = sum(len(fr) for fr in frames)
                        entry["payload"] = {"file": PAYLOAD, "offset": offset, "length": length,
                                            "raw_length": entry.pop("_raw")} | entry.pop("_filter")  # fmt: skip
                        t0 = time.perf_counter()
                        for fr in frames:
                            f.write(fr)
                        write_s += time.perf_counter() - t0
                        offset += length
                        changed.add(name)
                    sums[name] = entry["checksum"] if entry["checksum"] else self._sums[name]
                    entry["checksum"] = sums[name]
                    entries.append(entry)
                    n_changed, n_total = n_changed + k, n_total + n
                encode_s = time.perf_counter() - t_start - write_s
                f.flush()
                os.fsync(f.fileno())
            full = sum(b.numel() for b in new.values())
            idx = {
                "format": FORMAT, "version": version, "base_version": base if kind == "delta" else None,
                "kind": kind, "encoding": self.encoding if kind == "delta" else "full",
                "checksum": self.algo, "compression": self.codec.compression, "created_at": time.time(),
                "stats": {"wire_bytes": offset, "full_bytes": full,
                          "density": 1.0 if kind == "snapshot" else n_changed / max(n_total, 1)},
                "tensors": entries,
            }  # fmt: skip
            with open(tmp / INDEX, "w") as f:
                json.dump(idx, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            os.rename(tmp, final)
            idx["_encode_s"] = (
                encode_s  # in-memory only: not in the index file  # a racing publisher's dir already there: rename fails (non-empty dir)
            )
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise PublicationError(
                f"{self.pub_dir}: writing {final.name} failed ({e}); nothing published"
            ) from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(self.pub_dir)
        return idx, sums, changed

    def _encoded(self, new: dict, metas: dict, kind: str):
        """(name, _encode result) in state order. With workers > 1, tensors are encoded on a thread
        pool, at most 2 x workers in flight (bounded memory); frames that view a thread's scratch
        are copied before that thread moves on."""
        if self.workers == 1:
            for name, buf in new.items():
                yield name, self._encode(name, buf, metas[name], kind)
            return

        def job(name, buf):
            entry, frames, k, n = self._encode(name, buf, metas[name], kind)
            if frames is not None:
                frames = [bytes(fr) if isinstance(fr, memoryview) else fr for fr in frames]
            return entry, frames, k, n

        with ThreadPoolExecutor(self.workers, thread_name_prefix="disk-delta-encode") as pool:
            pending: deque = deque()
            for name, buf in new.items():
                pending.append((name, pool.submit(job, name, buf)))
                if len(pending) >= 2 * self.workers:
                    done_name, fut = pending.popleft()
                    yield done_name, fut.result()
            while pending:
                done_name, fut = pending.popleft()
                yield done_name, fut.result()

    def _encode(self, name: str, buf: torch.Tensor, meta, kind: str):
        """-> (index entry, payload sections or None if unchanged, changed units, total units)."""
        dtype, shape = meta
        entry = {
            "name": name,
            "dtype": dtype_name(dtype),
            "shape": shape,
            "nbytes": buf.numel(),
            "payload": None,
        }
        width = dtype.itemsize
        if self.filter == "lowbits" and kind == "delta" and self.encoding == "xor" and width in lb.WIDTHS:
            return self._encode_lowbits(entry, name, buf, width)
        planar = (
            self.filter in ("byteplane", "lowbits")
            and width in bp.WIDTHS
            and (kind == "snapshot" or self.encoding == "xor")
        )
        if planar:
            prev = None if kind == "snapshot" else self._bufs[name]
            scratch = getattr(self._local, "scratch", None)
            if scratch is None or scratch.numel() < buf.numel():
                scratch = self._local.scratch = torch.empty(buf.numel(), dtype=torch.uint8)
            # sections may be views of this thread's scratch: `_encoded` hands them out (copied when
            # several threads encode) before this thread encodes its next tensor
            out = scratch[: buf.numel()].view(width, -1)
            planes = bp.xor_split(
                buf if prev is None else prev, None if prev is None else buf, width, out=out
            )
            sections, plane_metas, k = encode_planes(planes, self.codec)
            n = buf.numel()
            if kind == "delta" and k == 0:
                entry["checksum"] = None  # unchanged: reuse the previous final checksum
                return entry, None, 0, n
            entry.update(checksum=checksum(buf, self.algo), _raw=n,
                         _filter={"filter": "byteplane", "width": width, "planes": plane_metas})  # fmt: skip
            return entry, sections, (n if kind == "snapshot" else k), n
        if kind == "snapshot":
            entry.update(checksum=checksum(buf, self.algo), _raw=buf.numel(), _filter={})
            return entry, [self.codec.compress(buf)], buf.numel(), buf.numel()
        prev, itemsize = self._bufs[name], dtype.itemsize
        if self.encoding == "xor":
            delta = xd.xor_bytes(prev, buf)
            k, n = xd.count_nonzero_bytes(delta), buf.numel()
            raw = delta
        else:
            pos, values = xd.changed_positions(prev, buf, itemsize)
            gaps, idx_dtype = xd.encode_indices(pos)
            k, n = pos.numel(), buf.numel() // max(itemsize, 1)
            raw = torch.cat([gaps.view(torch.uint8), values])
            entry.update(num_changed=k, index_dtype=idx_dtype)
        if k == 0:
            entry.pop("num_changed", None)
            entry.pop("index_dtype", None)
            entry["checksum"] = None  # unchanged: reuse the previous final checksum
            return entry, None, 0, n
        entry.update(checksum=checksum(buf, self.algo), _raw=raw.numel(), _filter={})
        return entry, [self.codec.compress(raw)], k, n

    def _encode_lowbits(self, entry: dict, name: str, buf: torch.Tensor, width: int):
        scratch = getattr(self._local, "lowbits", None)
        if scratch is None:
            scratch = self._local.lowbits = lb.Scratch()
        # sections may view this thread's scratch (see `_encoded`)
        r = lb.encode(lb.words(self._bufs[name], width), lb.words(buf, width), scratch=scratch)
        n = buf.numel() // width
        if r["changed"] == 0:
            entry["checksum"] = None  # unchanged: reuse the previous final checksum
            return entry, None, 0, n
        sections = [memoryview(sec) for sec in r["sections"]]
        meta = {"filter": "lowbits", "width": width, "low_bits": r["low_bits"], "exceptions": r["exceptions"],
                "positions": r["positions"], "sections": [["none", len(m), len(m)] for m in sections]}  # fmt: skip
        entry.update(checksum=checksum(buf, self.algo), _raw=buf.numel(), _filter=meta)
        return entry, sections, r["changed"], n
