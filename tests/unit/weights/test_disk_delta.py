"""Disk-delta publication: round trips and real file-level faults (no mocks of the format code).

Every fault test asserts what an operator would notice: the replica refuses the bad version with a
PublicationError naming it, its local checkpoint stays byte-identical, and the next valid version
applies cleanly.
"""

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_platform.errors import PublicationError
from miles_platform.weights import disk_delta as dd


def _step(state: dict, seed: int, frac: float = 0.3) -> dict:
    """A small update touching ~frac of the elements of every float tensor (like an optimizer step)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        if v.is_floating_point():
            mask = torch.rand(v.shape, generator=g) < frac
            v = (v.float() + mask * 1e-2 * torch.randn(v.shape, generator=g)).to(v.dtype)
        out[k] = v.clone()
    return out


def _optimizer_step(master: dict, rel: float, dtype, seed: int = 0) -> dict:
    """fp32 master weights moved by a relative ~rel, exported as `dtype` (fp32: the low mantissa bits
    of most elements change; bf16: the few elements that cross a rounding boundary)."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: (v.float() * (1 + rel * torch.randn(v.shape, generator=g))).to(dtype) for k, v in master.items()
    }


def _local(tmp_path: Path, state: dict, name: str = "local") -> Path:
    d = tmp_path / name
    d.mkdir()
    save_file(state, str(d / dd.WEIGHTS_FILE))
    return d


def _snapshot(d: Path) -> dict:
    return {f.name: f.read_bytes() for f in sorted(d.iterdir()) if f.is_file()}


def _assert_equal(d: Path, state: dict):
    got = load_file(str(d / dd.WEIGHTS_FILE))
    assert set(got) == set(state)
    for k in state:
        assert got[k].dtype == state[k].dtype and torch.equal(got[k], state[k]), k


@pytest.fixture(scope="module")
def base_state(tiny_hf_checkpoint):
    return load_file(os.path.join(tiny_hf_checkpoint, "model.safetensors"))


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip(tmp_path, base_state, encoding, dtype):
    s0 = {k: v.to(dtype) for k, v in base_state.items()}
    pub = tmp_path / "pub"
    p = dd.DeltaPublisher(pub, encoding=encoding, keyframe_interval=10)
    local = _local(tmp_path, s0)
    stats = [p.publish(s0)]
    states = [s0]
    for i in range(1, 4):
        states.append(_step(states[-1], i))
        stats.append(p.publish(states[-1]))
    assert [s.kind for s in stats] == ["snapshot", "delta", "delta", "delta"]
    assert [s.base_version for s in stats] == [None, 0, 1, 2]
    assert all(s.wire_bytes < 0.9 * s.full_bytes for s in stats[1:])
    assert 0 < stats[1].density < 1
    assert dd.apply_publication(pub, local) == 3
    _assert_equal(local, states[3])
    assert dd.read_local_version(local) == 3
    # in-memory catch-up for an engine at v1
    engine = {k: v.clone() for k, v in states[1].items()}
    assert dd.apply_to_state_dict(pub, engine, from_version=1) == 3
    assert all(torch.equal(engine[k], states[3][k]) for k in engine)


def _publish_v0_v1(tmp_path, base_state, **kw):
    pub = tmp_path / "pub"
    p = dd.DeltaPublisher(pub, keyframe_interval=2, **kw)
    s0, s1 = base_state, _step(base_state, 1)
    p.publish(s0)
    local = _local(tmp_path, s0)
    assert dd.apply_publication(pub, local) == 0  # replica materialized the base: records v0
    p.publish(s1)
    return p, pub, local


def _flip_byte(path: Path, pos: int | None = None):
    data = bytearray(path.read_bytes())
    pos = len(data) // 2 if pos is None else pos
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))


def _flip_index_checksum(path: Path):
    text = path.read_text()
    i = text.index('"checksum": "', text.index('"tensors"')) + len('"checksum": "')
    path.write_text(text[:i] + ("0" if text[i] != "0" else "1") + text[i + 1 :])


FAULTS = {
    "flipped_payload_byte": lambda d: _flip_byte(d / dd.PAYLOAD),
    "flipped_index_checksum": lambda d: _flip_index_checksum(d / dd.INDEX),
    "truncated_payload": lambda d: os.truncate(d / dd.PAYLOAD, (d / dd.PAYLOAD).stat().st_size // 2),
    "missing_index": lambda d: (d / dd.INDEX).unlink(),
    "missing_payload": lambda d: (d / dd.PAYLOAD).unlink(),
}


@pytest.mark.parametrize("compression", ["zstd", "none"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_corrupt_publication_fails_closed(tmp_path, base_state, fault, compression):
    p, pub, local = _publish_v0_v1(tmp_path, base_state, compression=compression)
    FAULTS[fault](pub / dd.version_dir_name(1))
    before = _snapshot(local)
    with pytest.raises(PublicationError, match="weight_v000001"):
        dd.apply_publication(pub, local)
    assert _snapshot(local) == before and dd.read_local_version(local) == 0
    engine = {k: v.clone() for k, v in base_state.items()}
    with pytest.raises(PublicationError):
        dd.apply_to_state_dict(pub, engine, from_version=0)
    assert all(torch.equal(engine[k], base_state[k]) for k in engine)
    # the next valid versions (keyframe v2, delta v3) apply cleanly past the broken one
    s2 = _step(base_state, 2)
    s3 = _step(s2, 3)
    assert p.publish(s2).kind == "snapshot"
    assert p.publish(s3).kind == "delta"
    assert dd.apply_publication(pub, local) == 3
    _assert_equal(local, s3)


@pytest.mark.parametrize(
    "pos, error",
    [
        (0, r"corrupt payload \(sparse plane: bitmap marks \d+ bytes, \d+ values stored\)"),  # a bitmap
        (-1, r"final xxh3-128 checksum mismatch"),  # a changed byte's value
    ],
)
def test_flipped_byte_names_the_tensor(tmp_path, base_state, pos, error):
    _, pub, local = _publish_v0_v1(tmp_path, base_state, compression="none", filter="byteplane")
    payload = pub / dd.version_dir_name(1) / dd.PAYLOAD
    _flip_byte(payload, pos % payload.stat().st_size)
    with pytest.raises(PublicationError, match=r"weight_v000001: tensor \S+: " + error):
        dd.apply_publication(pub, local)


def test_xor_applied_twice_or_to_wrong_base_is_refused(tmp_path, base_state):
    _, pub, local = _publish_v0_v1(tmp_path, base_state)
    s1 = _step(base_state, 1)
    # an engine that already holds v1 but claims v0: xor would undo the update -> refused
    engine = {k: v.clone() for k, v in s1.items()}
    with pytest.raises(PublicationError, match="checksum mismatch"):
        dd.apply_to_state_dict(pub, engine, from_version=0, to_version=1)
    assert all(torch.equal(engine[k], s1[k]) for k in engine)
    # a local checkpoint whose recorded version lies about its bytes (another base)
    liar = tmp_path / "liar"
    liar.mkdir()
    save_file(_step(base_state, 99), str(liar / dd.WEIGHTS_FILE), metadata={dd.VERSION_META_KEY: "0"})
    before = _snapshot(liar)
    with pytest.raises(PublicationError, match="weight_v000001"):
        dd.apply_publication(pub, liar)
    assert _snapshot(liar) == before
    # the honest replica applies v1 once; applying again is a no-op, not a second xor
    assert dd.apply_publication(pub, local) == 1
    assert dd.apply_publication(pub, local) == 1
    _assert_equal(local, s1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_byteplane_filter_is_smaller_and_older_layouts_still_apply(tmp_path, base_state, dtype):
    """The byte-plane filter against one zstd frame per tensor (`filter="none"`, the layout of format
    /1) and the default lowbits filter: same final bytes; byte planes take the fewest wire bytes on
    an optimizer-like step; a /1 dir (and a /2 one) still applies."""
    s0 = {k: v.to(dtype) for k, v in base_state.items()}
    s1 = _optimizer_step(s0, 1e-4 if dtype == torch.float32 else 3e-3, dtype)  # low bits of most elements
    wire = {}
    for filt in ("byteplane", "none", "lowbits"):
        pub = tmp_path / filt
        p = dd.DeltaPublisher(pub, filter=filt)
        p.publish(s0)
        wire[filt] = p.publish(s1).wire_bytes
        old = {"none": "miles-disk-delta/1", "byteplane": "miles-disk-delta/2"}.get(filt)
        for v in (0, 1) if old else ():  # rewrite the indices as older publishers wrote them
            f = pub / dd.version_dir_name(v) / dd.INDEX
            f.write_text(f.read_text().replace(dd.FORMAT, old))
        engine = {k: v.clone() for k, v in s0.items()}
        assert dd.apply_to_state_dict(pub, engine, from_version=0) == 1
        assert all(torch.equal(engine[k], s1[k]) for k in s1)
        fresh = {k: torch.zeros_like(v) for k, v in s0.items()}  # catch up from the v0 snapshot
        assert dd.apply_to_state_dict(pub, fresh, from_version=None) == 1
        assert all(torch.equal(fresh[k], s1[k]) for k in s1)
    assert wire["byteplane"] < wire["none"] and wire["byteplane"] < wire["lowbits"]


def test_sparse_update_applies_by_scatter_and_fails_closed(tmp_path, base_state):
    """A bf16 update touching ~0.5% of elements: every byte plane is zero or sparse, so replicas
    XOR only the marked bytes (no plane is materialized). Same bytes as the publisher's; a bitmap
    that marks one byte more than the values hold is refused, naming tensor and version."""
    s0 = {k: v.to(torch.bfloat16) for k, v in base_state.items()}
    g = torch.Generator().manual_seed(1)
    s1 = {}
    for k, v in s0.items():
        bump = (torch.rand(v.shape, generator=g) < 0.005) * 0.05 * v.float().abs().clamp(min=1e-3)
        s1[k] = (v.float() + bump).to(torch.bfloat16)
    pub = tmp_path / "pub"
    p = dd.DeltaPublisher(pub, filter="byteplane")
    p.publish(s0)
    assert p.publish(s1).kind == "delta"
    idx = dd.read_index(pub, 1)
    modes = {pm["mode"] for t in idx["tensors"] if t["payload"] for pm in t["payload"]["planes"]}
    assert modes <= {"zero", "sparse"} and "sparse" in modes
    engine = {k: v.clone() for k, v in s0.items()}
    assert dd.apply_to_state_dict(pub, engine, from_version=0) == 1
    assert all(torch.equal(engine[k], s1[k]) for k in s1)
    # an index whose sparse record disagrees with its sections (one value fewer than stored)
    t = next(t for t in idx["tensors"] if t["payload"])
    pm = next(pm for pm in t["payload"]["planes"] if pm["mode"] == "sparse")
    pm["nnz"] -= 1
    pm["sections"][1][2] -= 1
    (pub / dd.version_dir_name(1) / dd.INDEX).write_text(json.dumps(idx))
    engine = {k: v.clone() for k, v in s0.items()}
    with pytest.raises(PublicationError, match=r"weight_v000001: tensor \S+: corrupt payload"):
        dd.apply_to_state_dict(pub, engine, from_version=0)
    assert all(torch.equal(engine[k], s0[k]) for k in s0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lowbits_default_applies_in_place_and_undoes_on_failure(tmp_path, base_state, dtype):
    """The default filter packs xor deltas as low bits + exceptions (fp32: L > 0 with exceptions;
    bf16: L = 0, the changed elements only) and replicas XOR them into their weights in place.
    A corrupt exception stream in the LAST changed tensor fails closed after the earlier tensors
    were already patched in place: they are XOR-ed back, so the engine's weights are bit-identical
    to before, and the error names version and tensor."""
    s0 = {k: v.to(dtype) for k, v in base_state.items()}
    s1 = _optimizer_step(base_state, 1e-5, dtype)
    pub = tmp_path / "pub"
    p = dd.DeltaPublisher(pub)
    p.publish(s0)
    st = p.publish(s1)
    assert st.kind == "delta" and st.wire_bytes < (0.5 if dtype == torch.float32 else 0.2) * st.full_bytes
    idx = dd.read_index(pub, 1)
    recs = [t for t in idx["tensors"] if t["payload"]]
    assert recs and all(t["payload"]["filter"] == "lowbits" for t in recs)
    low_bits = {t["payload"]["low_bits"] for t in recs}
    assert (min(low_bits) > 0) if dtype == torch.float32 else (low_bits == {0})
    engine = {k: v.clone() for k, v in s0.items()}
    ptrs = {k: v.data_ptr() for k, v in engine.items()}
    assert dd.apply_to_state_dict(pub, engine, from_version=0) == 1
    assert all(torch.equal(engine[k], s1[k]) for k in s1)
    assert {k: v.data_ptr() for k, v in engine.items()} == ptrs  # patched in place, no new tensors
    # one exception fewer declared for the last changed tensor than its streams hold
    last = next(t for t in reversed(idx["tensors"]) if t["payload"] and t["payload"]["exceptions"])
    last["payload"]["exceptions"] -= 1
    (pub / dd.version_dir_name(1) / dd.INDEX).write_text(json.dumps(idx))
    engine = {k: v.clone() for k, v in s0.items()}
    with pytest.raises(
        PublicationError, match=rf"weight_v000001: tensor {last['name']}: corrupt payload \(lowbits"
    ):
        dd.apply_to_state_dict(pub, engine, from_version=0)
    assert all(torch.equal(engine[k], s0[k]) for k in s0)
    # a flipped byte in a packed low section: checksum mismatch, the same undo
    last["payload"]["exceptions"] += 1
    (pub / dd.version_dir_name(1) / dd.INDEX).write_text(json.dumps(idx))
    _flip_byte(pub / dd.version_dir_name(1) / dd.PAYLOAD, last["payload"]["offset"])
    with pytest.raises(PublicationError, match=rf"tensor {last['name']}: final xxh3-128 checksum mismatch"):
        dd.apply_to_state_dict(pub, engine, from_version=0)
    assert all(torch.equal(engine[k], s0[k]) for k in s0)


def test_odd_dtypes_and_empty_tensors_round_trip(tmp_path):
    """Byte planes of width 1, 2, 4 and 8 (bool, fp8, int64, fp16, fp64) and an empty tensor: the
    delta applies exactly and a fresh replica materializes the same bytes from the snapshot."""

    def raw(t):
        return t.contiguous().view(-1).view(torch.uint8)

    s0 = {"empty": torch.zeros(0), "flag": torch.tensor([True, False, True]), "step": torch.arange(10),
          "h": torch.randn(5, 3).half(), "q": torch.randn(4, 4).to(torch.float8_e4m3fn), "d": torch.randn(7).double()}  # fmt: skip
    s1 = {k: v.clone() for k, v in s0.items()}
    s1["flag"][1], s1["step"][3], s1["d"][2] = True, 99, 0.5
    s1["h"][0, 0] += 1
    p = dd.DeltaPublisher(tmp_path / "pub")
    p.publish(s0)
    assert p.publish(s1).kind == "delta"
    for start, state in (
        (0, {k: v.clone() for k, v in s0.items()}),
        (None, {k: torch.zeros_like(v) for k, v in s0.items()}),
    ):
        assert dd.apply_to_state_dict(tmp_path / "pub", state, from_version=start) == 1
        assert all(torch.equal(raw(state[k]), raw(s1[k])) for k in s1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parallel_encode_writes_the_same_publication(tmp_path, base_state, dtype):
    """workers=3 encodes tensors on a thread pool: payload bytes and index entries are identical to
    the one-thread publisher's, snapshot and delta, and the delta applies."""
    s0 = {k: v.to(dtype) for k, v in base_state.items()}
    s1 = _step(s0, 1)
    dirs = {}
    for workers in (1, 3):
        d = tmp_path / f"w{workers}"
        p = dd.DeltaPublisher(d, workers=workers)
        p.publish(s0)
        p.publish(s1)
        dirs[workers] = d
    for v in (0, 1):
        a, b = (dirs[w] / dd.version_dir_name(v) for w in (1, 3))
        assert (a / dd.PAYLOAD).read_bytes() == (b / dd.PAYLOAD).read_bytes()
        assert dd.read_index(dirs[1], v)["tensors"] == dd.read_index(dirs[3], v)["tensors"]
    engine = {k: v.clone() for k, v in s0.items()}
    assert dd.apply_to_state_dict(dirs[3], engine, from_version=0) == 1
    assert all(torch.equal(engine[k], s1[k]) for k in s1)
    with pytest.raises(ValueError, match="encode-workers"):
        dd.DeltaPublisher(tmp_path / "x", workers=0)


def test_unknown_filter_is_refused(tmp_path, base_state):
    with pytest.raises(ValueError, match="disk-delta filter 'lz4'"):
        dd.DeltaPublisher(tmp_path, filter="lz4")
    _, pub, local = _publish_v0_v1(tmp_path, base_state)
    f = pub / dd.version_dir_name(1) / dd.INDEX
    f.write_text(f.read_text().replace('"filter": "lowbits"', '"filter": "bitshuffle"', 1))
    before = _snapshot(local)
    with pytest.raises(
        PublicationError, match=r"weight_v000001: tensor \S+: corrupt payload \(unknown payload filter"
    ):
        dd.apply_publication(pub, local)
    assert _snapshot(local) == before


def test_overwrite_is_idempotent(tmp_path, base_state):
    _, pub, _ = _publish_v0_v1(tmp_path, base_state, encoding="overwrite")
    s1 = _step(base_state, 1)
    engine = {k: v.clone() for k, v in s1.items()}  # already at v1, applies v1 again
    assert dd.apply_to_state_dict(pub, engine, from_version=0, to_version=1) == 1
    assert all(torch.equal(engine[k], s1[k]) for k in engine)


def test_layout_mismatch_is_refused(tmp_path, base_state):
    _, pub, _ = _publish_v0_v1(tmp_path, base_state)
    other = _local(tmp_path, {k: v.to(torch.bfloat16) for k, v in base_state.items()}, "bf16")
    before = _snapshot(other)
    with pytest.raises(PublicationError, match="layout mismatch"):
        dd.apply_publication(pub, other)
    assert _snapshot(other) == before


def test_racing_publishers_one_wins_cleanly(tmp_path, base_state):
    pub = tmp_path / "pub"
    first = dd.DeltaPublisher(pub)
    first.publish(base_state)
    local = _local(tmp_path, base_state)
    cand = {"a": _step(base_state, 1), "b": _step(base_state, 2)}
    pubs = {k: dd.DeltaPublisher(pub) for k in cand}
    barrier, results = threading.Barrier(2), {}

    def run(k):
        barrier.wait()
        try:
            results[k] = pubs[k].publish(cand[k], version=1)
        except PublicationError as e:
            results[k] = e

    threads = [threading.Thread(target=run, args=(k,)) for k in cand]
    [t.start() for t in threads]
    [t.join() for t in threads]
    winners = [k for k, r in results.items() if isinstance(r, dd.PublishStats)]
    assert len(winners) == 1, results
    loser = next(k for k in cand if k not in winners)
    assert isinstance(results[loser], PublicationError)
    assert dd.read_latest(pub) == 1 and not list(pub.glob(".tmp-*")) and not (pub / dd.LOCK).exists()
    assert dd.apply_publication(pub, local) == 1
    _assert_equal(local, cand[winners[0]])
    # a publisher whose in-memory base is stale (still v0) is refused; the winner continues
    with pytest.raises(PublicationError, match="another publisher"):
        first.publish(cand[loser])
    assert dd.read_latest(pub) == 1
    s2 = _step(cand[winners[0]], 3)
    assert pubs[winners[0]].publish(s2).base_version == 1
    assert dd.apply_publication(pub, local) == 2
    _assert_equal(local, s2)


def test_lock_held_by_live_process_blocks_dead_one_is_broken(tmp_path, base_state):
    pub = tmp_path / "pub"
    pub.mkdir()
    (pub / dd.LOCK).write_text(f"{os.getpid()} {os.uname().nodename} other")
    with pytest.raises(PublicationError, match="another publisher holds"):
        dd.DeltaPublisher(pub).publish(base_state)
    assert dd.read_latest(pub) is None
    dead = subprocess.Popen(["true"])
    dead.wait()
    (pub / dd.LOCK).write_text(f"{dead.pid} {os.uname().nodename} crashed")
    assert dd.DeltaPublisher(pub).publish(base_state).version == 0


def test_crash_before_rename_publishes_nothing(tmp_path, base_state, monkeypatch):
    p, pub, local = _publish_v0_v1(tmp_path, base_state)
    s2 = _step(_step(base_state, 1), 2)
    real_rename, calls = os.rename, []

    def crash_once(src, dst):
        if not calls:
            calls.append(dst)
            raise OSError(28, "No space left on device (injected)")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_once)
    p.keyframe_interval = 10
    with pytest.raises(PublicationError, match="nothing published"):
        p.publish(s2)
    assert calls and dd.read_latest(pub) == 1
    assert not (pub / dd.version_dir_name(2)).exists() and not list(pub.glob(".tmp-*"))
    assert dd.apply_publication(pub, local) == 1
    st = p.publish(s2)
    assert (st.version, st.base_version, st.kind) == (2, 1, "delta")
    assert dd.apply_publication(pub, local) == 2
    _assert_equal(local, s2)


def test_crash_between_rename_and_latest(tmp_path, base_state, monkeypatch):
    _, pub, local = _publish_v0_v1(tmp_path, base_state)
    s1 = _step(base_state, 1)
    s2 = _step(s1, 2)
    real_replace = os.replace

    def crash_latest(src, dst):
        if Path(dst).name == dd.LATEST:
            raise OSError(5, "I/O error (injected)")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_latest)
    with pytest.raises(OSError):
        dd.DeltaPublisher(pub).publish(s2)
    monkeypatch.setattr(os, "replace", real_replace)
    assert (pub / dd.version_dir_name(2)).exists() and dd.read_latest(pub) == 1
    with pytest.raises(PublicationError, match="not committed"):
        dd.apply_publication(pub, local, version=2)
    assert dd.apply_publication(pub, local) == 1  # LATEST is the commit boundary
    s2b = _step(s1, 5)
    st = dd.DeltaPublisher(pub).publish(s2b)  # restarted publisher drops the orphan, republishes v2
    assert (st.version, st.base_version) == (2, 1)
    assert dd.apply_publication(pub, local) == 2
    _assert_equal(local, s2b)


def test_keyframe_catch_up_for_fresh_replica(tmp_path, base_state):
    pub = tmp_path / "pub"
    p = dd.DeltaPublisher(pub, keyframe_interval=3)
    states = [base_state]
    kinds = [p.publish(base_state).kind]
    for i in range(1, 5):
        states.append(_step(states[-1], i))
        kinds.append(p.publish(states[-1]).kind)
    assert kinds == ["snapshot", "delta", "delta", "snapshot", "delta"]
    assert dd.plan_catch_up(pub, None, 4) == [3, 4]
    assert dd.plan_catch_up(pub, 1, 2) == [2]
    assert dd.plan_catch_up(pub, 3, 4) == [4]
    fresh = _local(tmp_path, base_state, "fresh")  # base materialized, version unknown
    assert dd.read_local_version(fresh) is None
    assert dd.apply_publication(pub, fresh) == 4
    _assert_equal(fresh, states[4])
    # a replica dir without weights (config only) materializes from the keyframe
    empty = tmp_path / "empty"
    empty.mkdir()
    assert dd.apply_publication(pub, empty) == 4
    _assert_equal(empty, states[4])
    # exact-version request: back to v2 through the v0 keyframe
    assert dd.apply_publication(pub, fresh, version=2) == 2
    _assert_equal(fresh, states[2])


def test_restarted_publisher_continues_the_chain(tmp_path, base_state):
    pub = tmp_path / "pub"
    s1 = _step(base_state, 1)
    dd.DeltaPublisher(pub).publish(base_state)
    dd.DeltaPublisher(pub).publish(s1)
    st = dd.DeltaPublisher(pub).publish(_step(s1, 2))
    assert (st.version, st.base_version, st.kind) == (2, 1, "delta")
    with pytest.raises(PublicationError, match="<= latest"):
        dd.DeltaPublisher(pub).publish(s1, version=2)
    shutil.rmtree(pub / dd.version_dir_name(0))
    with pytest.raises(PublicationError, match="weight_v000000 .*missing"):
        dd.DeltaPublisher(pub).publish(s1)
