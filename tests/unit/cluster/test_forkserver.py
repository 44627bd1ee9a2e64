"""The fork server (cluster/forkserver.py): Ray actors on a local CPU cluster start as forks of one
warm process, and behave as the plain workers they replace (env, threads, RNG, exit status,
signals, death with the launcher); without a server the launcher execs the interpreter."""

import os
import signal
import subprocess
import sys
import time

import pytest

from miles_platform.cluster import forkserver

SCRIPT = """
import atexit, os, sys, time
atexit.register(lambda: print("atexit ran", flush=True))
print("pid", os.getpid(), "ppid", os.getppid(), "warm", "torch" in sys.modules, "env", os.environ.get("PROBE"),
      "argv", *sys.argv[1:], "nice", os.getpriority(os.PRIO_PROCESS, 0), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture(scope="module")
def server():
    srv = forkserver.start(
        tuple(forkserver.EXTRAS)
    )  # this pytest process's server (the shared Ray fixture uses it too)
    if srv is None:
        pytest.skip("fork server disabled (MILES_FORK_WORKERS=0)")
    deadline = time.monotonic() + 120
    while not os.path.exists(srv.socket_path):
        assert srv.proc.poll() is None and time.monotonic() < deadline, "fork server did not come up"
        time.sleep(0.1)
    return srv


def _launch(srv_dir, script, *args, env=None, **kw):
    cmd = [*forkserver.launcher_argv(str(srv_dir)), str(script), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, **(env or {})), **kw)


def _fork_prints(srv, tmp_path, code: str) -> list[str]:
    """What `code`, run as a script forked from the server, printed (split); it must exit 0."""
    script = tmp_path / "script.py"
    script.write_text(code)
    p = _launch(srv.dir, script)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    return out.split()


def _fields(line):
    f = line.split()
    head, i, j = f[: f.index("argv")], f.index("argv"), f.index("nice")
    return dict(zip(head[0::2], head[1::2], strict=True)) | {"argv": f[i + 1 : j], "nice": f[j + 1]}


def test_a_launched_script_is_a_warm_fork_with_the_launchers_env_args_nice_and_exit_status(server, tmp_path):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    p = _launch(server.dir, script, "run", "3", env={"PROBE": "x1"}, preexec_fn=lambda: os.nice(5))
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 3, out
    f = _fields(out)
    assert int(f["ppid"]) == server.proc.pid and f["warm"] == "True"  # forked, torch already imported
    assert f["env"] == "x1" and f["argv"] == ["run", "3"]
    assert int(f["nice"]) >= 5  # the niceness Ray gave the launcher
    assert (
        out.splitlines()[-1] == "atexit ran"
    )  # an interpreter's exit (multiprocessing stops its managers there)


def test_signals_reach_the_fork_and_it_dies_with_its_launcher(server, tmp_path):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    p = _launch(server.dir, script, "sleep", "0")
    child = int(_fields(p.stdout.readline())["pid"])
    p.send_signal(signal.SIGTERM)  # forwarded; the launcher then ends as the child did
    assert p.wait(30) == -signal.SIGTERM
    _gone(child)
    p = _launch(server.dir, script, "sleep", "0")
    child = int(_fields(p.stdout.readline())["pid"])
    p.kill()  # SIGKILL of Ray's process handle: the forked worker must not outlive it
    p.wait(30)
    _gone(child)
    p = _launch(server.dir, script, "sleep", "0")
    child = int(_fields(p.stdout.readline())["pid"])
    os.kill(child, signal.SIGKILL)  # the worker killed: its launcher reports the same death
    assert p.wait(30) == -signal.SIGKILL


CTRL_C = """
import signal, sys, time
try:  # a Ctrl-C as soon as "up" is read lands inside the try
    print("up", signal.getsignal(signal.SIGINT) == signal.SIG_IGN, flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    print("cleaned up", flush=True)
    sys.exit(130)
"""


@pytest.mark.parametrize("ignored", [False, True])
def test_ctrl_c_reaches_the_fork_as_python_takes_it(server, tmp_path, ignored):
    """A Ctrl-C'd command (a CLI's cleanup: `train --submit` stops its Ray job) gets a KeyboardInterrupt
    as under `python`; started with SIGINT ignored (a shell's background job), it keeps ignoring it."""
    script = tmp_path / "c.py"
    script.write_text(CTRL_C)

    def ignore_sigint():
        signal.signal(signal.SIGINT, signal.SIG_IGN if ignored else signal.SIG_DFL)

    p = _launch(server.dir, script, preexec_fn=ignore_sigint)
    assert p.stdout.readline().split() == ["up", str(ignored)]
    p.send_signal(signal.SIGINT)
    if ignored:
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(1.0)
        p.terminate()
        assert p.wait(30) == -signal.SIGTERM
    else:
        assert p.wait(30) == 130 and p.stdout.read() == "cleaned up\n"


def _gone(pid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} still alive")


def test_the_launcher_starts_without_site_packages(server, tmp_path):
    """Ray's worker command and warm_python: `python -S fork_exec.py` (the stdlib and fork_wire.py
    only: ~10 ms of CPU per actor start instead of ~75 ms importing the package); the script it
    stands in for still runs as under `python`, site-packages and all."""
    assert forkserver.warm_python()[:3] == [sys.executable, "-S", forkserver.FORK_EXEC]
    assert server.py_executable.split()[1:3] == ["-S", forkserver.FORK_EXEC]
    script = tmp_path / "s.py"
    script.write_text("import sys, peft; print(sys.flags.no_site, 'torch' in sys.modules, flush=True)")
    out = subprocess.run([*forkserver.warm_python(), str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["0", "True"], out.stderr


def test_without_a_server_the_launcher_execs_the_interpreter(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    p = _launch(tmp_path, script, "run", "4")  # no socket, no pid file: plain exec, same pid
    out, _ = p.communicate(timeout=60)
    f = _fields(out)
    assert p.returncode == 4 and int(f["pid"]) == p.pid and f["warm"] == "False"


def test_ray_actors_fork_from_the_server_with_their_runtime_env_and_own_rng(server):
    import ray

    from miles_platform.cluster import ray_cluster
    from miles_platform.config import RunConfig

    ray_cluster.init_ray(RunConfig())

    @ray.remote(num_cpus=0)
    class Probe:
        def info(self):
            import torch

            return os.getppid(), os.environ.get("PROBE"), torch.get_num_threads(), torch.initial_seed()

        def pid(self):
            return os.getpid()

        def modules(self):
            import sys

            return sorted(sys.modules)

    env = forkserver.runtime_env({"env_vars": {"PROBE": "y", "OMP_NUM_THREADS": "1"}})
    a, b = (Probe.options(runtime_env=env).remote() for _ in range(2))
    (ppa, pa, ta, sa), (ppb, _, _, sb) = ray.get([a.info.remote(), b.info.remote()])
    assert ppa == ppb == server.proc.pid and pa == "y" and ta == 1
    assert sa != sb  # each fork reseeds: no two actors share torch's default generator
    # what the actor imported after its fork: Ray's own modules (its native module is not preloaded),
    # not the packages Ray pulls in (forkserver.PRELOAD has them: ~0.1 CPU-s of each actor's start)
    script = "import sys; print(' '.join(sorted(sys.modules)))"
    p = subprocess.run([*forkserver.warm_python(), "-c", script], capture_output=True, text=True, timeout=60)
    late = {m.split(".")[0] for m in ray.get(a.modules.remote())} - {
        m.split(".")[0] for m in p.stdout.split()
    }
    assert {m for m in late if not m.startswith("_cython_")} <= {"ray", "colorama"}, sorted(late)
    pid = ray.get(a.pid.remote())
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(a.info.remote(), timeout=60)
    pid_b = ray.get(b.pid.remote())
    ray.kill(b)
    _gone(pid_b, timeout=30)


def test_a_driver_forked_from_a_server_forks_its_actors_from_it_and_leaves_it_running(server, tmp_path):
    # a test's `train` launched with warm_python: its init_ray adopts the server it was forked from
    # instead of starting (and importing torch & co. into) one of its own
    out = _fork_prints(server, tmp_path,
                       "import os\nfrom miles_platform.cluster import forkserver\ns = forkserver.start()\n"
                       "print(os.environ['MILES_FORK_SERVER'], s.dir, s.proc is None, forkserver.warm_python()[-1])\n")  # fmt: skip
    assert out == [server.dir, server.dir, "True", server.dir]
    assert server.proc.poll() is None and os.path.exists(server.socket_path)  # not stopped at its exit


def test_with_the_fork_server_up_ray_prestarts_no_idle_workers(monkeypatch):
    """Every actor forks from the server, so the workers Ray would prestart for the first driver
    (one per core, each importing ray in the middle of start-up) would serve none (startup.py)."""
    import ray

    from miles_platform.cluster import ray_cluster

    calls = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(forkserver, "current", lambda: object())
    ray_cluster.start_local_ray(2, _system_config={"object_spilling_threshold": 0.9})
    monkeypatch.setattr(forkserver, "current", lambda: None)
    ray_cluster.start_local_ray(2)
    inline = {"max_direct_call_object_size": ray_cluster.INLINE_BYTES}  # test_inline_calls.py
    assert calls[0]["_system_config"] == {
        "prestart_worker_first_driver": False,
        "object_spilling_threshold": 0.9,
        **inline,
    }
    assert calls[1]["_system_config"] == inline and calls[1]["num_cpus"] == 2


RANKS_SCRIPT = """
import os, sys, threading, time
from multiprocessing import forkserver as stdlib
from miles_platform.cluster.forkserver import rank_context
from miles_platform.progress import Progress

def method():
    return rank_context().get_start_method()

said = {"warm fork (its launcher watch only)": method()}
idle = threading.Event()
marked = threading.Thread(target=idle.wait, daemon=True)
marked.fork_safe = True
marked.start()
said["a thread marked fork_safe"] = method()
plain = threading.Thread(target=idle.wait, daemon=True)
plain.start()
said["a plain thread"] = method()
idle.set(); marked.join(); plain.join()
os.environ["MILES_PROGRESS"] = "0.001"
with Progress("p", 3) as bar:  # a heartbeat writing to stderr all the time
    said["a progress heartbeat"] = method()
    for _ in range(20):  # forks beside it: each child writes to its stderr and exits
        p = rank_context().Process(target=print, args=("child",), kwargs={"file": sys.stderr})
        p.start(); p.join(10)
        assert p.exitcode == 0, p.exitcode
import torch
torch.set_num_threads(2)
torch.ones(512, 512) @ torch.ones(512, 512)  # starts the intra-op pool: native threads
said["torch's thread pool"] = method()
said["stdlib fork server started"] = stdlib._forkserver._forkserver_pid is not None
print(said)
"""


def test_gloo_ranks_fork_from_a_single_threaded_process_and_never_beside_a_thread_or_pool(server, tmp_path):
    """`rank_context`: a warm script (a conversion's process) forks its ranks directly, no fresh
    interpreter (the stdlib fork server: ~6 CPU-s of imports); not beside a thread that may hold a
    lock, nor beside torch's native pool; beside a progress heartbeat writing to the same stderr
    every millisecond, 20 forked children each write there and exit."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    p = _launch(server.dir, script, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    said = eval(out.strip().splitlines()[-1])  # noqa: S307 - our own script's dict literal
    assert said == {
        "warm fork (its launcher watch only)": "fork",
        "a thread marked fork_safe": "fork",
        "a plain thread": "forkserver",
        "a progress heartbeat": "fork",
        "torch's thread pool": "forkserver",
        "stdlib fork server started": False,  # only asked for, never started: no rank ran there
    }, said
    assert err.count("child") == 20


class _Stop(Exception):
    pass


@pytest.mark.parametrize(
    ("extra", "prestarts"),
    [({}, [("megatron",)]), ({"ray_address": "127.0.0.1:6379"}, [])],
    ids=["local_cluster", "joined_cluster"],
)
def test_a_run_starts_its_fork_server_before_the_preflight(monkeypatch, tiny_hf_checkpoint, extra, prestarts):
    """The actors' warm process starts with the run, so its imports run beside the preflight (bench_startup:
    start-up 12.8 -> 9.6 s, its `engines` phase 4.1 -> 1.0 s, 2026-12-06); a joined cluster decides later
    (init_ray: forks only where every node is this machine's)."""
    from miles_platform import loop
    from miles_platform.cluster import ray_cluster
    from miles_platform.config import RunConfig

    calls: list[tuple] = []
    # the run's own extras, not the test suite's every-extra server (conftest)
    monkeypatch.setattr(
        ray_cluster, "_fork_extras", getattr(ray_cluster._fork_extras, "real", ray_cluster._fork_extras)
    )
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_cluster, "start_fork_server", lambda *extras: calls.append(extras))
    monkeypatch.setattr(ray_cluster, "sys", type("S", (), {"modules": {}})())  # as in a fresh `train`

    def preflight(cfg):
        calls.append("preflight")
        raise _Stop

    monkeypatch.setattr(loop, "validate_before_start", preflight)
    cfg = RunConfig(hf_checkpoint=tiny_hf_checkpoint, train_backend="megatron", **extra)
    with pytest.raises(_Stop):
        loop.RLRun(cfg).run()
    assert calls == [*prestarts, "preflight"]


def test_a_fork_finds_the_caches_every_actor_would_fill_already_filled(server, tmp_path):
    """transformers' checkpoint key conversions (built at a process's first `from_pretrained`) and
    the pydantic modules Ray's serializers import at a worker's first deserialization: once, in
    the server, not in each engine and trainer rank."""
    out = _fork_prints(server, tmp_path,
                       "import sys\nfrom transformers import conversion_mapping as cm\n"
                       "print(cm._checkpoint_conversion_mapping_cache is not None, 'pydantic.v1.fields' in sys.modules)\n")  # fmt: skip
    assert out == ["True", "True"]


def test_the_server_imports_without_collecting_and_its_forks_collect_around_what_it_froze(server, tmp_path):
    """No full collection while the server imports (each walked all it had imported: 8 of them,
    1.5 CPU-s beside a run's start-up), one after; its forks collect, never walking what it preloaded
    (a fork inherits its parent's collection counts: they say what the server did)."""
    out = _fork_prints(server, tmp_path, "import gc\nprint(gc.isenabled(), gc.get_stats()[2]['collections'], gc.get_freeze_count())\n")  # fmt: skip
    enabled, full, frozen = out
    assert enabled == "True" and int(frozen) > 100_000
    assert int(full) <= 2, full  # the server's one, and one in the fork at most
