"""Warm Ray workers on CPU: a fork server that imported torch, transformers and the trainer / engine
modules once, and forks a process for each actor Ray starts on this node.

Every trainer and engine actor is a fresh Ray worker process, and on this project's CPU machines
each one paid ~8 s of CPU importing torch, transformers' model code, PEFT and megatron-core before
running a line of ours (a tiny-model run is ~1 s of real work). With a local CPU cluster
(`init_ray` starting one), the actors' runtime env points Ray's worker command at `fork_exec`
(`py_executable`): that small launcher hands its argv, environment, working dir and stdio to this
server over a Unix socket, the server forks, and the child runs Ray's `default_worker.py` as a
normal worker would. The launcher stays as Ray's process handle: it forwards signals to the child,
exits with the child's status, and the child dies when the launcher does.

A driver that is itself a fork of a server (`warm_python`, e.g. a test's `train` launch) uses that
server for its actors rather than starting one (`MILES_FORK_SERVER`, set by the launcher).

Not used on GPU machines (a forked process cannot initialise CUDA safely), when Ray is joined
(`--ray-address`: the server runs on the driver's machine only), or with `MILES_FORK_WORKERS=0`. If
the server is gone or not ready, the launcher execs the plain interpreter: slower, never wrong.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from miles_platform.cluster.fork_wire import INHERITED, _recv_msg, _send_msg  # noqa: F401 (INHERITED: re-exported)

# the launcher: run by path without site-packages (it needs the stdlib only: cluster/fork_wire.py)
FORK_EXEC = str(Path(__file__).resolve().with_name("fork_exec.py"))


def launcher_argv(server_dir: str) -> list[str]:
    """The command that stands in for a process the server at `server_dir` forks (fork_exec.py)."""
    return [sys.executable, "-S", FORK_EXEC, server_dir]


# imported before the first fork (each optional: a missing extra is skipped)
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "safetensors.torch",
    "transformers",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "fastapi",
    "uvicorn",
    "httpx",
    "miles_platform.rollout.engine_server",
    "miles_platform.training.actor",
    "miles_platform.training.fsdp_backend",
    # a trainer rank appends its train_samples rows (store/tables.py). Not pandas, which pyarrow pulls
    # in at its first array: ~0.3 CPU-s of this server's ~4.5 (0.9 of ~11 without .pyc files), whose
    # imports are the critical path of a run's start on 2 cores; a trainer imports it on a thread
    # while it waits for its first rollout
    "pyarrow.parquet",
    # what `import ray` pulls in besides itself (~0.1 CPU-s of each actor's start). Not ray itself: its
    # native module keeps the importing process's state (the auth mode, read at import before the
    # cluster sets it); workers forked from a server that had imported it failed to start (2026-12-06)
    "requests",
    "google.protobuf.json_format",
    "google.protobuf.text_format",
    "google.protobuf.timestamp_pb2",
    "attr",
    "jsonschema",
    "charset_normalizer",
    "msgpack",
    "uvloop",
    "pdb",
    "tracemalloc",
    # what Ray's serialization add-ons import at a worker's first deserialization (its pydantic
    # serializers: ~0.06 CPU-s of each actor's start)
    "pydantic.fields",
    "pydantic.v1.fields",
)
# what only some runs use (several CPU-seconds each): preloaded when the run asks for it
EXTRAS = {
    "peft": ("peft",),
    "megatron": ("megatron.core", "miles_platform.training.megatron_backend"),
    "diffusion": ("diffusers", "miles_platform.diffusion.engine", "miles_platform.diffusion.trainer"),
}
ENV_SWITCH = "MILES_FORK_WORKERS"


# ---------------------------------------------------------------------------------- the driver side


@dataclass
class ForkServer:
    """A running server (started by `start`): its socket and the `py_executable` for actors.
    `proc` None: a server this process did not start but was forked from (`INHERITED`), used
    while it lives and never stopped from here."""

    proc: subprocess.Popen | None
    dir: str

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        try:
            with open(os.path.join(self.dir, "pid")) as f:
                os.kill(int(f.read().strip()), 0)
        except (OSError, ValueError):
            return False
        return os.path.exists(self.socket_path)

    @property
    def socket_path(self) -> str:
        return os.path.join(self.dir, "sock")

    @property
    def py_executable(self) -> str:
        return " ".join(launcher_argv(self.dir))

    def stop(self) -> None:
        if self.proc is None:  # inherited: its owner stops it
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            for name in os.listdir(self.dir):
                os.unlink(os.path.join(self.dir, name))
            os.rmdir(self.dir)


_current: ForkServer | None = None


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def start(extras: tuple[str, ...] = ()) -> ForkServer | None:
    """This driver's server: started once per process (it imports in the background, beside the run's
    preflight and Ray's start: ray_cluster.prestart_fork_server), then kept for every local cluster this process starts; it stops at exit. `extras`:
    keys of EXTRAS to preload too (a later run needing others imports them in its own worker)."""
    global _current
    if not enabled() or not hasattr(os, "fork"):
        return None
    if current() is not None:
        return _current
    stop()
    inherited = ForkServer(None, os.environ[INHERITED]) if os.environ.get(INHERITED) else None
    if inherited is not None and inherited.alive():
        _current = inherited
        return _current
    d = tempfile.mkdtemp(prefix="miles-fork-")  # 0700: only this user's processes reach the socket
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles_platform.cluster.forkserver", d, *extras],
        env=env,
        stdin=subprocess.DEVNULL,
    )
    with open(os.path.join(d, "pid"), "w") as f:
        f.write(str(proc.pid))
    _current = ForkServer(proc, d)
    import atexit

    atexit.register(stop)
    return _current


def current() -> ForkServer | None:
    return _current if _current is not None and _current.alive() else None


def stop() -> None:
    global _current
    if _current is not None:
        _current.stop()
        _current = None


def runtime_env(base: dict | None = None) -> dict:
    """An actor's runtime_env: `base` plus, when this driver's fork server runs, its launcher
    (unless `base` names its own interpreter)."""
    out = dict(base or {})
    srv = current()
    if srv is not None:
        out.setdefault("py_executable", srv.py_executable)
    return out


# ---------------------------------------------------------------------------------- the server


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _child(conn: socket.socket, req: dict, fds: list[int], inherited: list) -> None:
    """In the forked process: become the worker the launcher was asked to exec. `inherited`: the
    server's own sockets and fds (the listener, other children's connections), closed here."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        # A process group of its own, as Ray gives each worker: the raylet's per-worker cleanup
        # kills a dead worker's group, which would otherwise be the driver's (a Ray job's driver)
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        for obj in inherited:
            with contextlib.suppress(OSError):
                obj.close() if hasattr(obj, "close") else os.close(obj)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        # SIGINT as `python` starts: KeyboardInterrupt (a CLI's Ctrl-C cleanup runs), or ignored where
        # the launcher started with it ignored; SIG_DFL here killed a Ctrl-C'd command on the spot
        ignored = req.get("sigint_ignored", False)
        signal.signal(signal.SIGINT, signal.SIG_IGN if ignored else signal.default_int_handler)
        for i, fd in enumerate(fds[:3]):
            os.dup2(fd, i)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        extra_path = [
            p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path
        ]
        sys.path[1:1] = extra_path  # what the interpreter would have put there at start
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, int(req.get("nice", 0)))  # Ray's worker niceness
        import threading

        def _watch():  # the launcher died (Ray killed its process): so does the worker
            with contextlib.suppress(OSError):
                while conn.recv(64):
                    pass
            os.kill(os.getpid(), signal.SIGKILL)

        watch = threading.Thread(target=_watch, name="fork-exec-watch", daemon=True)
        watch.fork_safe = True  # blocked in recv, holds no lock: `rank_context` may fork beside it
        watch.start()
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.seed()  # a fresh process's RNG: children must not share the server's (random reseeds itself)
            if req["env"].get("OMP_NUM_THREADS", "").isdigit():
                torch.set_num_threads(max(1, int(req["env"]["OMP_NUM_THREADS"])))
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        _run_like_python(list(req["argv"]))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        _finalize()
        os._exit(code)


def _finalize() -> None:
    """What the interpreter does at exit before tearing down: join non-daemon threads, run the
    atexit handlers (multiprocessing's stop its managers and children, for one), flush stdio."""
    import atexit
    import threading

    with contextlib.suppress(BaseException):
        threading._shutdown()
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()


def _run_like_python(argv: list[str]) -> None:
    """`python <argv>` in this process: `script.py args`, `-m module args` or `-c code args`."""
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def warm_python() -> list[str]:
    """The command that runs `python <args>` as a fork of this process's server when it runs (the
    same interpreter, environment and working dir, torch & co. already imported), else `python`."""
    srv = current()
    if srv is None:
        return [sys.executable]
    return launcher_argv(srv.dir)


# gloo ranks (a checkpoint conversion's, the tests') fork from the stdlib's fork server instead: its
# children are multiprocessing Processes (pickled target and args), started fresh like spawned ones
RANK_PRELOAD = ["torch", "miles_platform.training.rank_preload"]


def rank_context():
    """multiprocessing's context for gloo ranks.

    A process that can fork safely (`_fork_safe`: no thread but marked idle ones, no native pool,
    no CUDA) forks its ranks directly ("fork"), after importing what a rank needs
    (training/rank_preload.py) once here: a checkpoint conversion in a script or `miles-platform
    convert` (rank 0 runs in this process and imports most of it anyway). It used to start the
    stdlib fork server there too, a fresh interpreter paying ~6 CPU-s of imports for each such
    process. Anywhere else (a pytest worker, a Dagster process: Ray's and gloo's threads):
    the "forkserver" context. Its server (one per process, started at the first rank) preloads the
    same modules unless the program set another preload before it started; a later start of ranks
    in the same process forks from the same server. `torch` first: the server skips a preload it
    cannot import without a word."""
    import multiprocessing
    from multiprocessing import forkserver as stdlib_forkserver

    if _fork_safe():
        for name in RANK_PRELOAD:
            importlib.import_module(name)
        if _fork_safe():  # the imports started no thread
            return multiprocessing.get_context("fork")
    ctx = multiprocessing.get_context("forkserver")
    if not stdlib_forkserver._forkserver._forkserver_pid:  # not up yet
        ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


def _fork_safe() -> bool:
    """Forking this process cannot leave a child holding a lock another thread held: no CUDA
    context, and every thread but the main one is a Python thread marked `fork_safe` (it holds no
    lock a child could need while it waits: the fork-exec watch below, progress.py's heartbeat,
    which pauses across a fork). Native threads are counted too (Linux): a pool torch, gloo or Ray
    started rules the fork out."""
    import threading

    try:
        native = len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: never fork
        return False
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if native != 1 + len(others) or not all(getattr(t, "fork_safe", False) for t in others):
        return False
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


def warm_caches() -> None:
    """Fill the per-process caches every child would fill on its own: transformers builds its table
    of checkpoint key conversions for every model family (~0.1 CPU-s) at a process's first
    `from_pretrained`, i.e. in each engine and trainer rank that loads a model."""
    with contextlib.suppress(Exception):
        from transformers import conversion_mapping

        conversion_mapping.get_checkpoint_conversion_mapping("qwen3")


def serve(d: str, extras: list[str]) -> None:
    _die_with_parent()
    import gc

    t0 = time.monotonic()
    # no cyclic collection while importing: each full one walks every object imported so far, and
    # the imports made 8-9 of them, 1.5 CPU-s in all, on a core the driver's start-up needs; one at the
    # end instead (0.9 s, 2026-12-07). Without that one a child's full collections came every few
    # seconds (CPython spaces them by how many objects the last one kept; frozen ones stay counted)
    gc.disable()
    for name in PRELOAD + tuple(m for e in extras for m in EXTRAS[e]):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    warm_caches()
    gc.collect()
    gc.freeze()  # the children's collections never walk (nor copy) the preloaded objects
    gc.enable()
    path = os.path.join(d, "sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.chmod(path + ".tmp", 0o600)
    listener.listen(128)
    os.rename(path + ".tmp", path)  # the socket appears only once the imports are done
    print(f"[forkserver] ready in {time.monotonic() - t0:.1f} s ({d})", file=sys.stderr, flush=True)

    rd, wr = os.pipe()
    os.set_blocking(rd, False)
    os.set_blocking(wr, False)
    signal.set_wakeup_fd(wr)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(rd, selectors.EVENT_READ, "sigchld")
    children: dict[int, socket.socket] = {}
    while not stopping:
        for key, _ in sel.select(timeout=1.0):
            if key.data == "accept":
                conn, _ = listener.accept()
                try:
                    req, fds = _recv_msg(conn, maxfds=3)
                except (EOFError, OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    _child(conn, req, fds, [sel, listener, rd, wr, *children.values()])
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                sel.register(conn, selectors.EVENT_READ, pid)
                with contextlib.suppress(OSError):
                    _send_msg(conn, {"pid": pid})
            elif key.data == "sigchld":
                with contextlib.suppress(OSError):
                    os.read(rd, 4096)
            else:  # the launcher of a child closed its end: the child goes too
                pid = key.data
                with contextlib.suppress(OSError):
                    if not key.fileobj.recv(64):
                        sel.unregister(key.fileobj)
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
        while children:  # reap, and tell each launcher its child's status
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError, KeyError, ValueError):
                    sel.unregister(conn)
                with contextlib.suppress(OSError):
                    _send_msg(conn, {"status": os.waitstatus_to_exitcode(status)})
                conn.close()
    listener.close()
    with contextlib.suppress(OSError):
        os.unlink(path)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
    sys.stderr.flush()
    # no interpreter teardown of the preloaded modules (~0.15 s the driver's exit waited for): the
    # server holds no buffered file and no state anyone reads after it
    os._exit(0)
