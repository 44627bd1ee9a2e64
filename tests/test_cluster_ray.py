"""Ray placement against a real two-node cluster started on loopback (no mocks).

The cluster is private to this test: its own --temp-dir and ports, `ray start --block` in its own
session so teardown kills exactly our processes (never a global `ray stop`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from miles_platform.cluster.ray_cluster import (
    bundle_node_ids,
    create_placement_groups,
    create_role_actors,
    init_ray,
    plan_placement,
    remove_placement_groups,
    resolve_ray_address,
    shutdown_ray,
)
from miles_platform.config import ConfigError, RunConfig

pytestmark = pytest.mark.own_ray  # starts, joins and stops Ray itself

RAY_BIN = str(Path(sys.executable).with_name("ray"))


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _node_args(ports: list[int]) -> list[str]:
    agent, grpc, metrics, renv, lo = ports
    return [
        "--num-cpus", "1",
        "--node-ip-address", "127.0.0.1",
        "--object-store-memory", str(80 * 1024**2),
        "--dashboard-agent-listen-port", str(agent),
        "--dashboard-agent-grpc-port", str(grpc),
        "--metrics-export-port", str(metrics),
        "--runtime-env-agent-port", str(renv),
        "--min-worker-port", str(lo), "--max-worker-port", str(lo + 20),
        "--disable-usage-stats", "--block",
    ]  # fmt: skip


def _kill_tree(proc: subprocess.Popen, temp_dir: str) -> None:
    """SIGTERM our `ray start --block` session, then SIGKILL anything still naming our temp dir."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in _pids_mentioning(temp_dir) + _pids_in_session(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _pids_mentioning(needle: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if needle.encode() in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def _pids_in_session(sid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == sid:
                    out.append(int(d.name))
            except OSError:
                pass
    return out


@pytest.fixture(scope="module")
def two_node_cluster():
    temp_dir = tempfile.mkdtemp(prefix="mr", dir="/tmp")  # short: Ray socket paths have a length limit
    # Ray token auth stays on (the token is ~/.ray/auth_token). A process that joins a cluster sends
    # the token only in token mode, which Ray turns on in a process that starts a local cluster: this
    # held only when another test had started one in this worker first. Turn it on as Ray does
    # there (RAY_AUTH_MODE=token for this process and its children, and its cached config)
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    _enable_token_auth()
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    gcs, client, *rest = _free_ports(12)
    head_ports, worker_ports = rest[:5], rest[5:]
    worker_ports[4] = head_ports[4] + 30
    procs: list[subprocess.Popen] = []
    log = open(Path(temp_dir) / "test-ray.log", "w")  # noqa: SIM115
    try:
        head = [RAY_BIN, "start", "--head", "--port", str(gcs), "--ray-client-server-port", str(client)]
        head += ["--include-dashboard", "false", "--temp-dir", temp_dir] + _node_args(head_ports)
        procs.append(subprocess.Popen(head, env=env, stdout=log, stderr=log, start_new_session=True))
        address = f"127.0.0.1:{gcs}"
        _wait_nodes(address, 1, env, procs)
        worker = [RAY_BIN, "start", "--address", address] + _node_args(worker_ports)
        procs.append(subprocess.Popen(worker, env=env, stdout=log, stderr=log, start_new_session=True))
        _wait_nodes(address, 2, env, procs)
        yield address
    finally:
        for p in reversed(procs):
            _kill_tree(p, temp_dir)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_nodes(address: str, n: int, env: dict, procs: list, timeout: float = 60.0) -> None:
    import json

    probe = (
        f"import ray, json; ray.init(address={address!r}, log_to_driver=False); "
        "print('ALIVE_NODES', json.dumps(sum(1 for x in ray.nodes() if x['Alive'])))"
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("`ray start` exited early; see its log under --temp-dir")
        r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        alive = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("ALIVE_NODES ")]
        if r.returncode == 0 and alive and json.loads(alive[-1]) >= n:  # Ray may log to stdout too
            return
        time.sleep(1.0)
    raise TimeoutError(f"Ray cluster at {address} did not reach {n} nodes")


class RankProbe:
    """Stands in for a trainer rank / engine: reports where it runs."""

    def __init__(self, role: str, rank: int):
        self.role, self.rank = role, rank

    def where(self) -> dict:
        import ray

        return {"role": self.role, "rank": self.rank, "node": ray.get_runtime_context().get_node_id()}


# Ray workers cannot import a test module: ship its classes by value.
ray_cloudpickle = pytest.importorskip("ray.cloudpickle")
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_join_existing_cluster_and_place_roles(two_node_cluster, monkeypatch):
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = RunConfig(ray_address=two_node_cluster, actor_num_gpus_per_node=1, rollout_num_gpus=1)
    ctx = init_ray(cfg)
    try:
        assert ctx.address == two_node_cluster and not ctx.started_local
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2  # joined, not a fresh local cluster
        groups = create_placement_groups(cfg, use_gpu=False)
        assert set(groups) == {"actor", "rollout"} and groups["actor"][0] is not groups["rollout"][0]
        actors = {role: create_role_actors(RankProbe, cfg, groups, role, role) for role in groups}
        seen = {role: ray.get([a.where.remote() for a in acts], timeout=60) for role, acts in actors.items()}
        assert [s["rank"] for s in seen["actor"]] == [0] and [s["role"] for s in seen["rollout"]] == [
            "rollout"
        ]
        # each actor landed on the node that holds its bundle
        for role, (pg, idx) in groups.items():
            assert seen[role][0]["node"] == bundle_node_ids(pg)[idx[0]]
        for acts in actors.values():
            for a in acts:
                ray.kill(a)
        remove_placement_groups(groups)

        spread = create_placement_groups(
            RunConfig(actor_num_nodes=2, actor_num_gpus_per_node=1, rollout_external_engine_addrs=["x:1"]),
            strategy="STRICT_SPREAD",
            use_gpu=False,
        )
        pg, idx = spread["actor"]
        assert spread["rollout"] == (None, [])  # external engines: nothing placed here
        cfg2 = RunConfig(actor_num_nodes=2, actor_num_gpus_per_node=1)
        ranks = create_role_actors(RankProbe, cfg2, spread, "actor", "actor")
        nodes = {r["node"] for r in ray.get([a.where.remote() for a in ranks], timeout=60)}
        assert len(idx) == 2 and len(nodes) == 2, "STRICT_SPREAD bundles must land on 2 different nodes"
        remove_placement_groups(spread)
    finally:
        shutdown_ray(ctx)
    assert not ray.is_initialized()


def test_unschedulable_placement_names_the_flags(two_node_cluster):
    import ray

    cfg = RunConfig(ray_address=two_node_cluster, actor_num_gpus_per_node=3, rollout_num_gpus=1)
    ctx = init_ray(cfg)
    try:
        with pytest.raises(ConfigError, match="--actor-num-gpus-per-node"):
            create_placement_groups(cfg, use_gpu=False, timeout_s=2)
    finally:
        shutdown_ray(ctx)
    assert not ray.is_initialized()


def test_ray_address_env_fallback(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert resolve_ray_address(RunConfig()) == "10.0.0.1:6379"
    assert resolve_ray_address(RunConfig(ray_address="10.0.0.2:6379")) == "10.0.0.2:6379"
    monkeypatch.delenv("RAY_ADDRESS")
    assert resolve_ray_address(RunConfig()) is None


def test_placement_plan_gpu_and_cpu_counterparts():
    cfg = RunConfig(
        actor_num_nodes=2, actor_num_gpus_per_node=4, rollout_num_gpus=4, rollout_num_gpus_per_engine=2
    )
    gpu, cpu = plan_placement(cfg, use_gpu=True), plan_placement(cfg, use_gpu=False)
    assert gpu["actor"].num_bundles == cpu["actor"].num_bundles == 8
    assert gpu["rollout"].num_bundles == cpu["rollout"].num_bundles == 4
    assert gpu["actor"].bundle == {"GPU": 1.0, "CPU": 1.0} and cpu["actor"].bundle == {"CPU": 1.0}
    colo = plan_placement(
        RunConfig(actor_num_gpus_per_node=4, rollout_num_gpus=2, colocate=True), use_gpu=True
    )
    assert colo["rollout"].shared_with == "actor" and colo["rollout"].num_bundles == 4  # forced to world size
    with pytest.raises(ConfigError, match="--rollout-num-gpus-per-engine"):
        plan_placement(RunConfig(rollout_num_gpus=3, rollout_num_gpus_per_engine=2), use_gpu=False)
