"""Applying a disk-delta publication: catch a replica (an HF dir, or an in-memory state dict) up
to a committed version, verifying lineage, layout and every checksum before anything is visible.
The format: `disk_delta` (overview) and `delta_format` (names, index, planes)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import numpy as np
import torch

from kernels import byteplane as bp
from kernels import lowbits as lb
from kernels import xor_delta as xd
from miles_platform.errors import PublicationError
from miles_platform.store import remote
from miles_platform.store.atomic import fsync_dir, write_atomic
from miles_platform.weights.checksum import checksum
from miles_platform.weights.delta_format import (
    LATEST,
    PAYLOAD,
    VERSION_FILE,
    VERSION_META_KEY,
    WEIGHTS_FILE,
    Codec,
    decode_planes,
    dtype_from_name,
    dtype_name,
    lowbits_sections,
    open_regular,
    read_index,
    read_latest,
    version_dir_name,
    xor_sparse_planes,
)


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
        opener, size_of = (lambda: open_regular(path)), (lambda f: os.fstat(f.fileno()).st_size)
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
