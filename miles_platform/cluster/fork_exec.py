"""Ray's worker command on a local CPU cluster (`py_executable`, see forkserver.py):
`python -S .../miles_platform/cluster/fork_exec.py <server dir> default_worker.py <args>`
(`forkserver.launcher_argv`: without site-packages, it imports the stdlib and fork_wire.py only).

Asks the fork server for a warm process running `default_worker.py <args>` with this process's
environment, working dir and stdio, then stands in for it: signals go to the worker, this process
exits with its status, and the worker dies with this process. If the server is not running, this
execs the interpreter instead (the normal, slower start). Imports nothing heavy."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

if __package__:  # imported (tests), or `python -m miles_platform.cluster.fork_exec`
    from miles_platform.cluster.fork_wire import INHERITED, _recv_msg, _send_msg
else:  # `python -S .../fork_exec.py` (forkserver.launcher_argv): its own directory is sys.path[0]
    import importlib

    _wire = importlib.import_module("fork_wire")  # this directory's fork_wire.py, not a distribution
    INHERITED, _recv_msg, _send_msg = _wire.INHERITED, _wire._recv_msg, _wire._send_msg

WAIT_FOR_SERVER_S = 60.0  # the server is importing (started beside Ray): wait rather than duplicate


def _server_alive(d: str) -> bool:
    try:
        with open(os.path.join(d, "pid")) as f:
            os.kill(int(f.read().strip()), 0)
        return True
    except (OSError, ValueError):
        return False


def _connect(d: str) -> socket.socket | None:
    path = os.path.join(d, "sock")
    deadline = time.monotonic() + WAIT_FOR_SERVER_S
    while True:
        if os.path.exists(path):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                return s
            except OSError:
                s.close()
                return None
        if not _server_alive(d) or time.monotonic() > deadline:
            return None
        time.sleep(0.05)


# what `python` does with SIGINT at its start: a KeyboardInterrupt, or nothing where it was ignored when
# the process started (a background job of a shell; `nohup`): read before this file handles it
_SIGINT_IGNORED = signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def main(argv: list[str]) -> int:
    d, worker_argv = argv[0], argv[1:]
    s = _connect(d)
    if s is None:
        os.execv(sys.executable, [sys.executable, *worker_argv])
    _send_msg(
        s,
        {
            "argv": worker_argv,
            "env": {**os.environ, INHERITED: d},  # the child knows its server (forkserver.start)
            "cwd": os.getcwd(),
            "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "sigint_ignored": _SIGINT_IGNORED,
        },
        [0, 1, 2],
    )
    try:
        pid = _recv_msg(s)[0]["pid"]
    except (EOFError, OSError, ValueError, KeyError):
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda n, _f: os.kill(pid, n))
    try:
        status = _recv_msg(s)[0]["status"]
    except (EOFError, OSError, ValueError, KeyError):
        return 1
    if status < 0:  # killed by a signal: so is the stand-in
        if -status not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
