"""One writer per object-store run across hosts and cache dirs (issue #49, item 11): two processes
with different MILES_CACHE_DIRs both wrote one s3:// run, because the only lock was a file under
each one's cache dir. `ObjectStoreLease` against a real S3 server (moto) on loopback."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time

import pytest
from store_builders import point_s3_at

pytest.importorskip("moto.server", reason="moto[server] not installed")

from miles_platform.store import remote  # noqa: E402
from miles_platform.store.run_lock import ObjectStoreLease, RunLocked  # noqa: E402


@pytest.fixture
def run_url(s3_server, monkeypatch):
    point_s3_at(monkeypatch, s3_server)
    fs, _ = remote.filesystem("s3://leases")
    if not fs.exists("leases"):
        fs.mkdir("leases")
    return f"s3://leases/runs/r{time.monotonic_ns()}"


def _hold(url: str, cache_dir: str, ready, stop) -> None:  # another process, its own cache dir
    os.environ["MILES_CACHE_DIR"] = cache_dir
    with ObjectStoreLease(url, "r", ttl_s=2.0):
        ready.set()
        stop.wait(60)


def test_a_second_writer_with_another_cache_dir_is_refused_until_the_first_releases(run_url, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold, args=(run_url, str(tmp_path / "cache-a"), ready, stop))
    p.start()
    try:
        assert ready.wait(60)
        os.environ["MILES_CACHE_DIR"] = str(tmp_path / "cache-b")
        time.sleep(2.5)  # past one ttl: the holder's heartbeat keeps its lease alive
        with pytest.raises(RunLocked, match=rf"being written by pid {p.pid} on {socket.gethostname()}"):
            ObjectStoreLease(run_url, "r").acquire()
    finally:
        stop.set()
        p.join(30)
        os.environ.pop("MILES_CACHE_DIR", None)
    assert remote.read_bytes(f"{run_url}/writer.lease") is None  # released on exit
    with ObjectStoreLease(run_url, "r") as lease:
        assert json.loads(remote.read_bytes(f"{run_url}/writer.lease"))["token"] == lease.token


def test_a_killed_or_expired_holders_lease_is_taken_over_and_a_replaced_one_is_noticed(run_url):
    dead = {"host": socket.gethostname(), "pid": 2**22 + 7, "run": "r", "token": "x",
            "expires": time.time() + 3600}  # fmt: skip
    remote.write_bytes(f"{run_url}/writer.lease", json.dumps(dead))
    with ObjectStoreLease(run_url, "r"):  # a dead process of this host: no wait for its expiry
        pass
    remote.write_bytes(f"{run_url}/writer.lease", json.dumps({**dead, "host": "elsewhere", "expires": 0}))
    lost = []
    lease = ObjectStoreLease(run_url, "r", ttl_s=0.4, on_lost=lost.append).acquire()
    try:
        remote.write_bytes(f"{run_url}/writer.lease", json.dumps({**dead, "host": "elsewhere"}))
        deadline = time.monotonic() + 10
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost and "now held by pid" in lost[0] and "elsewhere" in lost[0]
        with pytest.raises(RunLocked, match="this writer stops"):
            lease.check()
    finally:
        lease.release()
    assert (
        json.loads(remote.read_bytes(f"{run_url}/writer.lease"))["host"] == "elsewhere"
    )  # not ours to delete
