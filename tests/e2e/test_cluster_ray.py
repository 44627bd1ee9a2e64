"""A real two-node Ray cluster started on loopback (no mocks): placement of a joined run, and runs
submitted as Ray jobs (`train --submit`, the `rl_training` op's `launcher: ray_job`) that outlive
their launcher, attach on relaunch, reconcile into Dagster partitions and stop on cancel.

The cluster is private to this test: its own --temp-dir and ports, `ray start --block` in its own
session so teardown kills exactly our processes (never a global `ray stop`). The head runs the
dashboard (the Job Submission API) on 127.0.0.1, behind Ray's token auth.
"""

from __future__ import annotations

import json
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
from loop_helpers import warm_python
from store_builders import point_s3_at

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
def cluster():
    """{"gcs": GCS address, "jobs": Ray Jobs HTTP address} of a head + worker on loopback."""
    temp_dir = tempfile.mkdtemp(prefix="mr", dir="/tmp")  # short: Ray socket paths have a length limit
    # Ray token auth stays on (the token is ~/.ray/auth_token). A process that joins a cluster sends
    # the token only in token mode, which Ray turns on in a process that starts a local cluster: this
    # held only when another test had started one in this worker first. Turn it on as Ray does
    # there (RAY_AUTH_MODE=token for this process and its children, and its cached config), with the
    # token Ray generates on a fresh machine
    from ray._private.authentication.authentication_token_setup import (
        _enable_token_auth,
        ensure_token_if_auth_enabled,
    )

    _enable_token_auth()
    ensure_token_if_auth_enabled()
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # a job's `python`
    # a job's driver on this one-machine cluster forks its actors from a fork server
    # (ray_cluster.init_ray): this worker's, inherited through the nodes' environment, instead of
    # one it starts (~6 CPU-s of imports per job) -- the product's own path for a driver forked
    # from a server (forkserver.INHERITED)
    from miles_platform.cluster import forkserver, ray_cluster

    ray_cluster.start_fork_server(*forkserver.EXTRAS)
    if forkserver.current() is not None:
        env[forkserver.INHERITED] = forkserver.current().dir
    while True:  # the nodes' worker-port ranges [lo, lo + 20] and [lo + 30, lo + 50] clear of every other
        gcs, client, dashboard, *rest = _free_ports(13)  # port: Ray refuses a range holding one (it did once)
        head_ports, worker_ports = rest[:5], rest[5:]
        lo = head_ports[4]
        worker_ports[4] = lo + 30
        singles = [gcs, client, dashboard, *head_ports[:4], *worker_ports[:4]]
        if not any(lo <= p <= lo + 50 for p in singles):
            break
    procs: list[subprocess.Popen] = []
    log = open(Path(temp_dir) / "test-ray.log", "w")  # noqa: SIM115
    try:
        head = [RAY_BIN, "start", "--head", "--port", str(gcs), "--ray-client-server-port", str(client)]
        head += [
            "--include-dashboard",
            "true",
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(dashboard),
        ]
        head += ["--temp-dir", temp_dir] + _node_args(head_ports)
        procs.append(subprocess.Popen(head, env=env, stdout=log, stderr=log, start_new_session=True))
        address, jobs = f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}"
        _wait_nodes(jobs, 1, procs, Path(temp_dir))
        worker = [RAY_BIN, "start", "--address", address] + _node_args(worker_ports)
        procs.append(subprocess.Popen(worker, env=env, stdout=log, stderr=log, start_new_session=True))
        _wait_nodes(jobs, 2, procs, Path(temp_dir))
        yield {"gcs": address, "jobs": jobs}
    finally:
        for p in reversed(procs):
            _kill_tree(p, temp_dir)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def two_node_cluster(cluster):
    return cluster["gcs"]


def _wait_nodes(jobs_address: str, n: int, procs: list, temp_dir: Path, timeout: float = 90.0) -> None:
    """Until the dashboard's state API lists `n` alive nodes (HTTP with this user's Ray token: no
    Ray import per probe). A `ray start` that exits fails with its log's tail (the fixture removes
    its --temp-dir)."""
    import urllib.error
    import urllib.request

    token_path = Path.home() / ".ray" / "auth_token"  # on a fresh machine, `ray start --head` writes it
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            logs = [(temp_dir / "test-ray.log").read_text()[-3000:]]
            logs += [
                f.read_text(errors="replace")[-1500:] for f in sorted(temp_dir.glob("session_*/logs/*.err"))
            ]
            raise RuntimeError("`ray start` exited early:\n" + "\n".join(logs))
        try:
            headers = {"Authorization": f"Bearer {token_path.read_text().strip()}"}
            req = urllib.request.Request(f"{jobs_address}/api/v0/nodes", headers=headers)
            with urllib.request.urlopen(req, timeout=5) as r:
                nodes = json.loads(r.read())["data"]["result"]["result"]
            if sum(x["state"] == "ALIVE" for x in nodes) >= n:
                return
        except (OSError, urllib.error.URLError, KeyError, ValueError):
            pass  # the dashboard is not up yet
        time.sleep(0.5)
    raise TimeoutError(f"Ray cluster at {jobs_address} did not reach {n} nodes")


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


# ---------------------------------------------------------------------------- runs as Ray jobs

REPO = Path(__file__).resolve().parents[2]
DAGSTER_RUN = str(Path(__file__).resolve().parents[1] / "ray_job_dagster_run.py")


def _job_run_kwargs(ckpt: str, tmp_path, run: str, num_rollout: int) -> dict:
    from loop_helpers import small_run_kwargs

    kw = small_run_kwargs(ckpt, tmp_path, run_name=run, num_rollout=num_rollout, save_interval=5)
    kw.pop("storage_root")  # the Dagster resource's / --storage-root
    return kw


def _wait_for(pred, timeout: float, what: str, procs: list) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, f"launcher exited ({dead[0].returncode}) before {what}"
        time.sleep(0.5)
    raise TimeoutError(f"no {what} within {timeout} s")


def _as_from_a_terminal() -> None:
    """Popen's preexec_fn for a command the test Ctrl-C's: SIGINT and SIGQUIT at their defaults, as
    an interactive shell starts a command. A child inherits ignored signals, and in a full `make
    test` worker they were ignored at fork time (measured in the CLI: SigIgn 0x81001006, SIGINT and
    SIGQUIT, the pair C's system() ignores process-wide while it runs; the call was not traced), so
    the CLI never saw the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def _dagster_run(kw: dict, root, home, log_path) -> subprocess.Popen:
    env = {**os.environ, "DAGSTER_HOME": str(home), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    # a fork of the warm fork server (torch & co. imported): signals, kill -9 included, reach the run
    # worker as they would a `python` process (cluster/fork_exec.py)
    return subprocess.Popen([*warm_python(), DAGSTER_RUN, json.dumps(kw), str(root)], env=env, cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, preexec_fn=_as_from_a_terminal)  # fmt: skip


def _parents_of(needle: str) -> list[str]:
    """The parent process's command line of each process whose command line holds `needle`."""
    out = []
    for pid in _pids_mentioning(needle):
        try:
            ppid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
            out.append(
                (Path("/proc") / str(ppid) / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            )
        except (OSError, IndexError, ValueError):
            pass
    return out


def _versions(root, run: str) -> list[dict]:
    from miles_platform.store.paths import StoragePaths
    from miles_platform.store.tables import read_rows

    return read_rows(StoragePaths(str(root)), "policy_versions", run)


N_DG = 30  # the first launcher dies as the job's driver starts; the relaunch (~10 s) finds it running


def test_dagster_ray_job_outlives_its_run_worker_then_attaches_reconciles_and_cancels(
    cluster, tiny_hf_checkpoint, tmp_path
):
    """The Dagster run worker is killed -9 once its Ray job runs: the job trains on; relaunching
    the Dagster run attaches to it (no second job, no second writer) and reports every version
    once, with lineage and metrics. Cancelling a Dagster run (SIGINT, as Dagster's cancel interrupts the run
    worker) stops its Ray job and is not retried."""
    from collections import Counter

    import dagster as dg

    from miles_platform.launch.ray_jobs import job_client, run_jobs

    root, home = tmp_path / "root", tmp_path / "dagster"
    home.mkdir()
    client = job_client(cluster["jobs"])
    kw = dict(_job_run_kwargs(tiny_hf_checkpoint, tmp_path, "dg", N_DG), launcher="ray_job",
              ray_job_address=cluster["jobs"])  # fmt: skip

    first = _dagster_run(kw, root, home, tmp_path / "first.log")
    try:
        _wait_for(
            lambda: "Running entrypoint" in (tmp_path / "first.log").read_text(), 120, "job start", [first]
        )
    finally:
        first.kill()
        first.wait()
    jobs = run_jobs(client, "dg", str(root))
    assert [(j.submission_id, j.status) for j in jobs] == [("miles-dg-1", "RUNNING")]  # trains on
    # the driver is the process Ray's job supervisor started, the one its stop kills: under a shell
    # (`sh -c` forks a plain command) a stop as the job started killed only the shell and left the
    # driver training, orphaned, after the job read STOPPED
    assert _parents_of("miles_platform.launch.job_driver") == ["ray::JobSupervisor"]
    assert len(_versions(root, "dg")) < N_DG

    second = _dagster_run(kw, root, home, tmp_path / "second.log")
    assert second.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()[-3000:]
    log = (tmp_path / "second.log").read_text()
    assert "attached to the running Ray job miles-dg-1" in log
    assert [(j.submission_id, j.status) for j in run_jobs(client, "dg", str(root))] == [
        ("miles-dg-1", "SUCCEEDED")
    ]
    instance = dg.DagsterInstance.from_config(str(home))
    key = dg.AssetKey("policy_versions")
    records = instance.fetch_materializations(key, limit=1000).records
    counts = Counter(r.asset_materialization.partition for r in records)
    assert set(counts) == {f"dg.v{v:06d}" for v in range(1, N_DG + 1)} and set(counts.values()) == {1}
    rows = {r["partition_key"]: r for r in _versions(root, "dg")}
    by_key = {r.asset_materialization.partition: r.asset_materialization.metadata for r in records}
    md = by_key["dg.v000002"]
    assert md["parent_version"].value == "dg.v000001" and md["ray_job_id"].value == "miles-dg-1"
    assert md["config_hash"].value == rows["dg.v000002"]["config_hash"]
    assert "train/loss" in md and "eval_config" in md  # the rollout's metrics, the eval settings
    shards = instance.fetch_materializations(dg.AssetKey("rollout_shards"), limit=1000).records
    assert Counter(r.asset_materialization.partition for r in shards) == counts

    cancel_kw = dict(kw, run_name="dg-cancel", num_rollout=500)
    third = _dagster_run(cancel_kw, root, home, tmp_path / "third.log")
    _wait_for(lambda: "submitted Ray job miles-dg-cancel-1" in (tmp_path / "third.log").read_text(), 120,
              "submission", [third])  # fmt: skip
    third.send_signal(signal.SIGINT)
    third.wait(timeout=120)
    assert "stopping Ray job miles-dg-cancel-1" in (tmp_path / "third.log").read_text()
    assert [j.status for j in run_jobs(client, "dg-cancel", str(root))] == ["STOPPED"]
    made = {r["partition_key"] for r in _versions(root, "dg-cancel")}
    reported = {k for k in instance.get_materialized_partitions(key) if k.startswith("dg-cancel.")}
    assert len(made) < 500 and reported == made  # what it made before the stop, each reported once
    assert "RETRY" not in (tmp_path / "third.log").read_text()  # a cancelled run is not retried


def _stream_until(proc: subprocess.Popen, marker: str) -> list[str]:
    seen = []
    for line in proc.stdout:  # the job's own log, streamed
        seen.append(line)
        if marker in line:
            break
    return seen


# ~18-28 s of `make test`: built of what it checks one by one (launch/ray_jobs.py's submit, attach,
# stream and stop: the Dagster Ray job test above and tests/unit/launch/test_ray_jobs.py; an S3 root
# through a run: tests/e2e/test_object_store_root.py), so in `make test-extended`
@pytest.mark.extended
def test_train_submit_on_an_s3_root_attaches_streams_and_ctrl_c_stops(
    cluster, s3_server, tiny_hf_checkpoint, tmp_path, monkeypatch
):
    """`train --submit` of a run whose storage root is on S3 (moto on 127.0.0.1): submitted with
    --no-wait, the same command attaches and streams it to the end; its shards, checkpoints and
    disk-delta publication are on the store; the command with more rollouts is a second job, and
    Ctrl-C stops it. DuckDB then queries the store. (Resuming from the store, torn uploads and
    reading it back: tests/e2e/test_object_store_root.py.)"""
    import fsspec

    from miles_platform.launch.ray_jobs import job_client, run_jobs

    point_s3_at(monkeypatch, s3_server)  # this process reads the store; the job gets them in its runtime env
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    if not fs.exists("jobs"):
        fs.mkdir("jobs")
    root = "s3://jobs/root"
    kw = _job_run_kwargs(tiny_hf_checkpoint, tmp_path, "s3", 2)
    kw.update(save_interval=2, update_weight_transfer_mode="disk-delta",
              update_weight_disk_dir=f"{root}/runs/s3/publications")  # fmt: skip
    # `miles-platform ...` as a fork of the warm fork server (~3 CPU-s of imports less per command;
    # signals and exit status as the command's own: cluster/fork_exec.py)
    argv = [*warm_python(), "-m", "miles_platform.cli", "train", "--submit", cluster["jobs"],
            "--storage-root", root, "--submit-runtime-env-json", json.dumps({"env_vars": s3_server})]  # fmt: skip
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "RAY_ADDRESS"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    r = subprocess.run([*argv, "--no-wait"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["job_id"] == "miles-s3-1"
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "attached to the running Ray job miles-s3-1" in r.stderr and "rollout 1:" in r.stdout
    keys = [k.removeprefix("jobs/root/") for k in fs.find("jobs/root")]
    assert fs.cat_file("jobs/root/runs/s3/checkpoints/latest_checkpointed_iteration.txt") == b"1"
    assert any(k.startswith("rollouts/run=s3/rollout_id=000001/") for k in keys)
    assert int(fs.cat_file("jobs/root/runs/s3/publications/LATEST")) == 2
    assert not [k for k in keys if ".tmp-" in k]

    more = [*argv[: argv.index("--num-rollout") + 1], "500", *argv[argv.index("--num-rollout") + 2 :]]
    proc = subprocess.Popen(more, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_as_from_a_terminal)  # fmt: skip
    try:
        seen = _stream_until(proc, "submitted Ray job miles-s3-2")
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        try:
            rest, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            with open(f"/proc/{proc.pid}/status") as f:  # was SIGINT blocked or ignored in the CLI?
                sig = [line for line in f if line.startswith(("SigBlk", "SigIgn", "SigCgt"))]
            proc.kill()
            rest = proc.communicate()[0]
            pytest.fail(
                f"no exit {time.monotonic() - t0:.0f} s after Ctrl-C ({''.join(sig)}):\n"
                + ("".join(seen) + rest)[-4000:]
            )
    finally:
        proc.kill()
    text = "".join(seen) + rest
    assert "stopping Ray job miles-s3-2" in text
    assert proc.returncode == 130, text[-2000:]
    client = job_client(cluster["jobs"])
    assert [j.status for j in run_jobs(client, "s3", root)] == ["SUCCEEDED", "STOPPED"]

    q = subprocess.run([*warm_python(), "-m", "miles_platform.cli", "query", "--storage-root", root, "--format", "json",
                        "SELECT count(*) AS n, min(version) AS lo FROM policy_versions WHERE run = 's3'"],
                       env={**env, **s3_server}, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert q.returncode == 0, q.stderr
    row = json.loads(q.stdout)[0]
    assert row["n"] >= 2 and row["lo"] == 1
