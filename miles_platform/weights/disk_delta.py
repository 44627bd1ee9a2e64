"""Disk-delta weight publication (Miles `--update-weight-transfer-mode disk-delta`).

Layout of a publication dir (shared storage, one writer, any number of readers):

    LATEST                      committed version, one integer line; replaced atomically, written last
    weight_vNNNNNN/index.json   version, base_version, kind, encoding, checksum, compression, tensors[]
    weight_vNNNNNN/payload.bin  per changed tensor, its sections (zstd frames or raw); index gives byte ranges
    .publish.lock               held (O_CREAT|O_EXCL, "pid host") while a publisher writes

Filters (format /3): xor deltas go through `lowbits` (default, `kernels/lowbits.py`): every
element's XOR packed to its low L bits (L per tensor, from a sample) plus the positions and high parts
of the few elements that need more; written and applied by vectorized loops at a fraction of
memcpy's cost. Snapshots (and xor deltas under `filter="byteplane"`, the smallest wire) go through
the byte-plane filter (`kernels/byteplane.py`): byte k of every element in plane k, each plane stored
as nothing (all zero), a bitmap + its nonzero bytes (sparse) or itself (dense), zstd where it pays.

Kinds: `snapshot` (every tensor's bytes; the first version and every `keyframe_interval`-th) and
`delta` against `base_version`, encoded `xor` (bytewise XOR: compact, apply exactly once to the
base) or `overwrite` (changed element positions + new values: idempotent). Each tensor entry
records name/dtype/shape and the checksum of its FINAL bytes; appliers verify lineage, layout
and every final checksum before anything becomes visible, and fail closed with PublicationError.
A version is committed when LATEST names it; version dirs above LATEST are leftovers of a crash
between rename and pointer update and are ignored by readers and removed by the next publisher.
"""

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

import numpy as np
import torch

from kernels import byteplane as bp
from kernels import lowbits as lb
from kernels import xor_delta as xd
from miles_platform.errors import PublicationError
from miles_platform.store import remote
from miles_platform.store.atomic import fsync_dir, write_atomic
from miles_platform.weights.checksum import CHECKSUM_ALGOS, checksum
from miles_platform.weights.delta_format import (  # noqa: F401  (re-exported: the format's public names)
    COMPRESSIONS,
    ENCODINGS,
    FILTERS,
    FORMAT,
    INDEX,
    LATEST,
    LOCK,
    PAYLOAD,
    VERSION_FILE,
    VERSION_META_KEY,
    WEIGHTS_FILE,
    Codec,
    committed_versions,
    decode_planes,
    dtype_from_name,
    dtype_name,
    encode_planes,
    list_publications,
    lowbits_sections,
    read_index,
    read_latest,
    version_dir_name,
    xor_sparse_planes,
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


def plan_catch_up(pub_dir: str | os.PathLike, from_version: int | None, to_version: int) -> list[int]:
    """Versions to apply, oldest first: from the nearest snapshot <= to_version or from `from_version`."""
    return [i["version"] for i in _chain(pub_dir, from_version, to_version)]


def _chain(pub_dir, from_version: int | None, to_version: int) -> list[dict]:
    if from_version == to_version:
        return []
    chain, v = [], to_version
    while True:
        idx = read_index(pub_dir, v)
        chain.append(idx)
        if idx["kind"] == "snapshot" or idx["base_version"] == from_version:
            return chain[::-1]
        base = idx["base_version"]
        if not isinstance(base, int) or base >= v:
            raise PublicationError(f"publication {version_dir_name(v)}: bad base_version {base!r}")
        v = base


# ---- applying --------------------------------------------------------------------------------


def _replay(
    pub_dir, chain: list[dict], bufs: dict, metas: dict, version: int | None, undo: list | None = None
) -> set[str]:
    """Apply `chain` to byte buffers. Every step is verified (lineage, layout, final checksums)
    before the next. Returns the names whose bytes changed. Without `undo`, the input tensors are
    never mutated: changed entries of `bufs` are replaced with new tensors. With a list, lowbits
    deltas are XOR-ed into `bufs` in place and an undo callable is appended for each (calling them
    in reverse order restores the inputs exactly; the caller does that on failure)."""
    changed: set[str] = set()
    verified: dict[str, str] = {}
    scratch = [torch.empty(0, dtype=torch.uint8)]  # byte planes of one tensor, reused
    for idx in chain:
        v, where = idx["version"], f"publication {version_dir_name(idx['version'])}"
        if idx["kind"] == "delta" and idx["encoding"] == "xor" and idx["base_version"] != version:
            raise PublicationError(
                f"{where}: xor delta is based on v{idx['base_version']}, but the local state is "
                f"{'of unknown version' if version is None else f'v{version}'}; refusing to apply"
            )
        names = [t["name"] for t in idx["tensors"]]
        check_layout = bool(metas)  # an empty state (publisher reload) takes the layout from a snapshot
        if check_layout and set(names) != set(metas):
            missing, extra = sorted(set(metas) - set(names)), sorted(set(names) - set(metas))
            raise PublicationError(
                f"{where}: layout mismatch: local-only {missing[:3]}, published-only {extra[:3]}"
            )
        payload = _read_payload(pub_dir, idx)
        codec = Codec(idx["compression"])
        step_changed = set()
        for t in idx["tensors"]:
            name, dtype, shape = t["name"], dtype_from_name(t["dtype"]), list(t["shape"])
            if check_layout and (metas[name][0] != dtype or list(metas[name][1]) != shape):
                raise PublicationError(
                    f"{where}: tensor {name}: layout mismatch: local {dtype_name(metas[name][0])}"
                    f"{list(metas[name][1])}, published {t['dtype']}{shape}"
                )
            if t["payload"] is not None:
                try:
                    bufs[name] = _decode_tensor(idx, t, payload, codec, bufs.get(name), scratch, undo)
                except (ValueError, RuntimeError, KeyError, TypeError, IndexError) as e:
                    raise PublicationError(f"{where}: tensor {name}: corrupt payload ({e})") from e
                step_changed.add(name)
            metas[name] = (dtype, shape)
        for t in idx["tensors"]:
            name = t["name"]
            if name not in step_changed and verified.get(name) == t["checksum"]:
                continue
            if name not in bufs or checksum(bufs[name], idx["checksum"]) != t["checksum"]:
                raise PublicationError(
                    f"{where}: tensor {name}: final {idx['checksum']} checksum mismatch "
                    f"(wrong base, corrupt or partial data); refusing to activate v{v}"
                )
            verified[name] = t["checksum"]
        changed |= step_changed
        version = v
    return changed


def _read_payload(pub_dir, idx: dict) -> memoryview:
    need = max(
        (t["payload"]["offset"] + t["payload"]["length"] for t in idx["tensors"] if t["payload"]), default=0
    )
    if need == 0:
        return memoryview(b"")
    if remote.is_remote(pub_dir):
        fs, path = remote.filesystem(remote.join(str(pub_dir), version_dir_name(idx["version"]), PAYLOAD))
        opener, size_of = (lambda: fs.open(path, "rb")), (lambda f: f.size)
    else:
        path = Path(pub_dir) / version_dir_name(idx["version"]) / PAYLOAD
        opener, size_of = (lambda: open(path, "rb")), (lambda f: os.fstat(f.fileno()).st_size)
    try:
        with opener() as f:
            size = size_of(f)
            if size != idx["stats"]["wire_bytes"] or size < need:
                raise PublicationError(
                    f"publication {version_dir_name(idx['version'])}: {PAYLOAD} is {size} bytes, "
                    f"index declares {idx['stats']['wire_bytes']} (truncated or partial copy)"
                )
            # into a private buffer, not an mmap: a file truncated under us must not become SIGBUS
            data = np.empty(size, np.uint8)
            if f.readinto(memoryview(data)) != size:
                raise PublicationError(
                    f"publication {version_dir_name(idx['version'])}: {PAYLOAD} shrank while read"
                )
    except FileNotFoundError as e:
        raise PublicationError(f"publication {version_dir_name(idx['version'])}: missing {PAYLOAD}") from e
    return memoryview(data)


def _decode_tensor(
    idx: dict,
    t: dict,
    payload: memoryview,
    codec: Codec,
    cur: torch.Tensor | None,
    scratch: list | None = None,
    undo: list | None = None,
):
    p = t["payload"]
    frame = payload[p["offset"] : p["offset"] + p["length"]]
    is_delta = idx["kind"] != "snapshot"
    if is_delta and (cur is None or cur.numel() != t["nbytes"]):
        raise ValueError("no local bytes of the declared size to apply a delta to")
    if p.get("filter", "none") == "lowbits":
        width = p.get("width")
        if idx["kind"] != "delta" or idx["encoding"] != "xor" or width not in lb.WIDTHS:
            raise ValueError(f"lowbits filter on a {idx['kind']} ({idx['encoding']}), width {width!r}")
        if p["raw_length"] != t["nbytes"] or t["nbytes"] % width:
            raise ValueError(f"lowbits payload of {p['raw_length']} bytes for a {t['nbytes']}-byte tensor")
        low, positions, highs = lowbits_sections(p, frame, codec, t["nbytes"] // width, width)
        args = (p["low_bits"], low, positions, p.get("positions"), highs, p.get("exceptions"))
        out = cur if undo is not None else cur.clone()
        lb.apply_(lb.words(out, width), *args)  # validates everything before touching `out`
        if undo is not None:
            undo.append(lambda: lb.apply_(lb.words(out, width), *args))  # XOR again: the old bytes
        return out
    if p.get("filter", "none") == "byteplane":
        width = p.get("width")
        if idx["kind"] == "delta" and idx["encoding"] != "xor" or width not in bp.WIDTHS:
            raise ValueError(f"byteplane filter with encoding {idx['encoding']!r}, width {width!r}")
        if p["raw_length"] != t["nbytes"] or t["nbytes"] % width or len(p["planes"]) != width:
            raise ValueError(f"byteplane payload of {p['raw_length']} bytes for a {t['nbytes']}-byte tensor")
        if is_delta and all(pm["mode"] in ("zero", "sparse") for pm in p["planes"]):
            return xor_sparse_planes(p["planes"], frame, codec, cur)  # few bytes changed: scatter them
        if scratch is not None and scratch[0].numel() < t["nbytes"]:
            scratch[0] = torch.empty(t["nbytes"], dtype=torch.uint8)
        out = None if scratch is None else scratch[0][: t["nbytes"]].view(width, -1)
        planes = decode_planes(p["planes"], frame, codec, t["nbytes"] // width, out=out)
        return bp.xor_merge(cur if is_delta else None, planes, width)
    if p.get("filter", "none") != "none":
        raise ValueError(f"unknown payload filter {p['filter']!r}")
    raw = torch.empty(p["raw_length"], dtype=torch.uint8)
    codec.decompress_into(frame, raw)
    if not is_delta:
        if raw.numel() != t["nbytes"]:
            raise ValueError(f"snapshot holds {raw.numel()} bytes, tensor has {t['nbytes']}")
        return raw
    if idx["encoding"] == "xor":
        if raw.numel() != t["nbytes"]:
            raise ValueError(f"xor delta holds {raw.numel()} bytes, tensor has {t['nbytes']}")
        return xd.apply_xor_(raw, cur)  # raw ^= cur: raw becomes the new bytes, cur stays untouched
    itemsize = dtype_from_name(t["dtype"]).itemsize
    k, idx_dtype = t["num_changed"], dtype_from_name(t["index_dtype"])
    if raw.numel() != k * (idx_dtype.itemsize + itemsize):
        raise ValueError(f"overwrite payload is {raw.numel()} bytes for {k} changed elements")
    gaps = raw[: k * idx_dtype.itemsize].view(idx_dtype)
    values = raw[k * idx_dtype.itemsize :].clone()  # own storage: aligned for the element view
    return xd.apply_overwrite_(cur.clone(), xd.decode_indices(gaps), values, itemsize)


def _target_version(pub_dir, version: int | None) -> int:
    latest = read_latest(pub_dir)
    if latest is None:
        raise PublicationError(f"{pub_dir}: no committed publication (no {LATEST})")
    if version is None:
        return latest
    if version > latest:
        raise PublicationError(f"{pub_dir}: v{version} is not committed (LATEST is v{latest})")
    return version


def apply_to_state_dict(
    pub_dir: str | os.PathLike,
    state: dict[str, torch.Tensor],
    from_version: int | None,
    to_version: int | None = None,
) -> int:
    """Bring an in-memory state dict (e.g. an engine's weights) from `from_version` (None: unknown,
    catch up from a snapshot) to `to_version` (None: LATEST). Lowbits deltas are XOR-ed straight
    into the state's bytes (views of contiguous CPU tensors; no copy of the model), everything else
    is decoded aside and copied in once the whole chain verified; on any failure the in-place
    patches are XOR-ed back, so `state` is bit-identical to before. Returns the version."""
    target = _target_version(pub_dir, to_version)
    chain = _chain(pub_dir, from_version, target)
    bufs = {k: xd.tensor_bytes(v) for k, v in state.items()}
    metas = {k: (v.dtype, list(v.shape)) for k, v in state.items()}
    undo: list = []
    try:
        changed = _replay(pub_dir, chain, bufs, metas, from_version, undo)
    except BaseException:
        for fn in reversed(undo):
            fn()
        raise
    with torch.no_grad():
        for name in changed:
            if bufs[name].data_ptr() != state[name].data_ptr():  # not patched in place
                dtype, shape = metas[name]
                state[name].copy_(bufs[name].view(dtype).reshape(shape))
    return target


PIPELINE_WEIGHTS = ("transformer", "diffusion_pytorch_model.safetensors")  # a diffusers pipeline's DiT


def weights_file(local_dir: str | os.PathLike) -> Path:
    """The one weights file a publication patches: an HF dir's model.safetensors, or in a
    diffusers pipeline dir (model_index.json) its DiT's transformer/diffusion_pytorch_model.safetensors
    (the policy; the frozen text encoder is not published)."""
    local = Path(local_dir)
    if (local / "model_index.json").exists():
        return local.joinpath(*PIPELINE_WEIGHTS)
    return local / WEIGHTS_FILE


def read_local_version(local_hf_dir: str | os.PathLike) -> int | None:
    """The publication version of a local HF checkpoint: safetensors metadata (authoritative, swapped
    atomically with the weights), else miles_weight_version.json, else None (unknown)."""
    from safetensors import safe_open

    f = weights_file(local_hf_dir)
    if f.exists():
        with safe_open(str(f), "pt") as sf:
            v = (sf.metadata() or {}).get(VERSION_META_KEY)
        if v is not None:
            return int(v)
    vf = Path(local_hf_dir) / VERSION_FILE
    return json.loads(vf.read_text())["version"] if vf.exists() else None


def apply_publication(
    pub_dir: str | os.PathLike, local_hf_dir: str | os.PathLike, version: int | None = None
) -> int:
    """Patch a local HF checkpoint dir (its `weights_file`; absent: materialized from the nearest
    snapshot, config/tokenizer are the caller's) to `version` (None: LATEST). All
    verification happens before the new weights file is renamed over the old one, so on failure
    the local checkpoint is byte-identical. Returns the applied version."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    local = Path(local_hf_dir)
    wf = weights_file(local)
    target = _target_version(pub_dir, version)
    current = read_local_version(local) if wf.exists() else None
    if current == target:
        return target
    chain = _chain(pub_dir, current, target)
    meta, tensors = {}, {}  # no local weights yet: a fresh replica materializes from a snapshot
    if wf.exists():
        with safe_open(str(wf), "pt") as sf:
            meta = dict(sf.metadata() or {})
        tensors = load_file(str(wf))
    wf.parent.mkdir(parents=True, exist_ok=True)
    bufs = {k: xd.tensor_bytes(v) for k, v in tensors.items()}
    metas = {k: (v.dtype, list(v.shape)) for k, v in tensors.items()}
    _replay(pub_dir, chain, bufs, metas, current, undo=[])  # our own copies: patched in place
    out = {k: bufs[k].view(metas[k][0]).reshape(metas[k][1]) for k in bufs}
    meta.update({"format": "pt", VERSION_META_KEY: str(target)})
    tmp = wf.parent / f".{wf.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        save_file(out, str(tmp), metadata=meta)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, wf)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(wf.parent)
    write_atomic(local / VERSION_FILE, json.dumps({"version": target, "publication": str(pub_dir)}).encode())
    return target


# ---- publishing ------------------------------------------------------------------------------


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
