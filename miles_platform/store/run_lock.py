"""One writer per run: an exclusive lock on `<run_dir>/writer.lock` for the life of a `train`.

The lock is an OS advisory lock (`fcntl.flock`) on an open file, so it dies with its process: a
lock left by a killed run is free again at once, and the next writer takes it over (the file's
contents, the holder's host / pid / start time, are only read to name the holder in the error).
A second `train` of the same run under the same storage root is refused before Ray starts.
An object-store root (`s3://...`) has no lock file: the flock is taken on this host's local dir
for the run (store/remote.py `mirror_path`), and `ObjectStoreLease` keeps one writer across hosts
and cache dirs: a `writer.lease` object created only if absent (S3's conditional `If-None-Match`
PUT), renewed by a heartbeat, taken over when it expired or its holder is a dead process of this
host; a writer whose lease another took (a partition, a clock jump) stops at its next renewal.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
import uuid
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


class ObjectStoreLease:
    """One writer per object-store run dir (or --save dir) across hosts: see the module docstring.

    `lost` is set (and `on_lost` called, from the heartbeat thread) when another writer's lease
    replaced this one; the run stops at its next check (`check()`)."""

    def __init__(self, url: str, run: str, what: str | None = None, ttl_s: float = 60.0, on_lost=None):
        from miles_platform.store.remote import join

        self.url, self.run, self.what = join(url, "writer.lease"), run, what or f"run {run!r}"
        self.ttl_s, self.on_lost = ttl_s, on_lost
        self.token = uuid.uuid4().hex
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({**_holder(), "run": self.run, "token": self.token,
                           "expires": time.time() + self.ttl_s}).encode()  # fmt: skip

    def _read(self) -> dict | None:
        from miles_platform.store.remote import read_bytes

        raw = read_bytes(self.url)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return {}  # unreadable: treated as expired below

    def _create(self) -> bool:
        """Write our lease only if there is none; False when another one exists."""
        from miles_platform.store.remote import filesystem

        fs, path = filesystem(self.url)
        try:
            fs.pipe_file(path, self._body(), mode="create")
            return True
        except FileExistsError:
            return False
        except OSError as e:  # s3fs surfaces S3's 412 PreconditionFailed as an OSError
            if "PreconditionFailed" in str(e) or "412" in str(e) or "pre-condition" in str(e).lower():
                return False
            raise

    def _stale(self, held: dict) -> bool:
        if not held or float(held.get("expires", 0)) < time.time():
            return True
        if held.get("host") == socket.gethostname() and isinstance(held.get("pid"), int):
            try:
                os.kill(held["pid"], 0)
            except ProcessLookupError:
                return True  # its process on this host is gone: a killed run
            except PermissionError:
                return False
        return False

    def acquire(self) -> ObjectStoreLease:
        from miles_platform.store.remote import remove

        for _ in range(3):
            if self._create():
                break
            held = self._read()
            if held is None:
                continue  # released between our two calls
            if not self._stale(held):
                left = max(0.0, float(held.get("expires", 0)) - time.time())
                raise RunLocked(
                    f"{self.what} is being written by pid {held.get('pid', '?')} on {held.get('host', '?')} "
                    f"(run {held.get('run', '?')!r}, since {held.get('started', '?')}; its lease in "
                    f"{self.url} is renewed while it lives, else it expires in {left:.0f} s); one writer "
                    "at a time: wait for it, stop it, or pick another --run-name / --save"
                )
            remove(self.url)  # expired, or a dead process of this host: take it over
        else:
            raise RunLocked(f"{self.what}: could not take {self.url} (other writers raced for it)")
        self._thread = threading.Thread(target=self._heartbeat, name="writer-lease", daemon=True)
        self._thread.start()
        return self

    def _heartbeat(self) -> None:
        from miles_platform.store.remote import write_bytes

        while not self._stop.wait(self.ttl_s / 4):
            try:
                held = self._read()
            except OSError:
                continue  # the store is unreachable: retry; the lease lives ttl_s
            if held is None or held.get("token") != self.token:
                who = "nobody" if held is None else f"pid {held.get('pid')} on {held.get('host')}"
                self.lost = (
                    f"{self.what}: the writer lease {self.url} is now held by {who}: this writer stops"
                )
                if self.on_lost is not None:
                    self.on_lost(self.lost)
                return
            try:
                write_bytes(self.url, self._body())
            except OSError:
                continue

    def check(self) -> None:
        if self.lost:
            raise RunLocked(self.lost)

    def release(self) -> None:
        from miles_platform.store.remote import remove

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
            held = self._read() if not self.lost else None
            if held is not None and held.get("token") == self.token:
                remove(self.url)

    def __enter__(self) -> ObjectStoreLease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
