"""One writer per run: an exclusive lock on `<run_dir>/writer.lock` for the life of a `train`.

The lock is an OS advisory lock (`fcntl.flock`) on an open file, so it dies with its process: a
lock left by a killed run is free again at once, and the next writer takes it over (the file's
contents, the holder's host / pid / start time, are only read to name the holder in the error).
A second `train` of the same run under the same storage root is refused before Ray starts.
An object-store root (`s3://...`) has no lock file: the lock is then taken on this host's local
dir for the run (store/remote.py `mirror_path`), which refuses a second writer on the same host
only; one writer per run across hosts is the operator's to keep (docs/data_and_store.md).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from miles_platform.config import ConfigError


def local_run_dir(paths, run: str) -> str:
    """Where the run's lock file lives: its run dir, or this host's dir for a remote one."""
    from miles_platform.store.remote import is_remote, mirror_path

    d = paths.run_dir(run)
    return mirror_path(d) if is_remote(d) else d


class RunLocked(ConfigError):
    """Another live process is writing this run."""


def local_save_dir(save: str) -> str:
    """Where a --save dir's lock file lives: the dir, or this host's mirror of a remote one."""
    from miles_platform.store.remote import is_remote, mirror_path

    return mirror_path(save) if is_remote(save) else save


class RunLock:
    def __init__(self, run_dir: str, run: str, what: str | None = None):
        """`what`: the thing locked, for the error (default: the run itself)."""
        self.run, self.what = run, what or f"run {run!r}"
        self.path = Path(run_dir) / "writer.lock"
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunLocked(
                f"{self.what} is being written by pid {holder.get('pid', '?')} on {holder.get('host', '?')} "
                f"(run {holder.get('run', '?')!r}, since {holder.get('started', '?')}); one writer at a time: "
                "wait for it, stop it, or pick another --run-name / --save"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({**_holder(), "run": self.run}).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _holder() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
