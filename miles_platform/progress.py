"""Progress of long commands (`sft`, `convert`, `quantize`, `eval`): one line per interval on stderr.

    sft: step 120/400 (30%) loss 0.4123 lr 2.00e-03 | 42s elapsed, ETA 1m38s

A heartbeat thread writes the line every interval, so a command whose steps are long (a conversion
phase, an eval batch) still says it is alive. Lines go to stderr whether or not it is a terminal:
long commands run as often under nohup, CI or Dagster, where a plain line every few seconds is
what a log needs (a redrawn bar is not). `MILES_PROGRESS` sets the interval in seconds (default
10; `0`: a line at every update, as the tests use) or turns the lines `off`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from typing import TextIO

from miles_platform.errors import ConfigError

ENV = "MILES_PROGRESS"
DEFAULT_INTERVAL_S = 10.0


def interval_from_env() -> float | None:
    """Seconds between lines from `MILES_PROGRESS` (None: off)."""
    raw = os.environ.get(ENV, "").strip().lower()
    if not raw:
        return DEFAULT_INTERVAL_S
    if raw == "off":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(
            f"{ENV}={raw!r}: must be seconds between progress lines (>= 0, 0: every step) or 'off'"
        )
    return value


def format_duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _format_metric(key: str, value) -> str:
    if isinstance(value, float):
        return f"{key} {value:.2e}" if value and abs(value) < 1e-3 else f"{key} {value:.4f}"
    return f"{key} {value}"


# running heartbeats: a fork waits for a line being written to end, and the child starts with every
# write lock free (cluster/forkserver.py `rank_context` forks gloo ranks beside a heartbeat)
_LIVE: weakref.WeakSet[Progress] = weakref.WeakSet()
_HELD: list[threading.Lock] = []


def _before_fork() -> None:
    for p in list(_LIVE):
        p._write_lock.acquire()
        _HELD.append(p._write_lock)


def _after_fork() -> None:
    while _HELD:
        _HELD.pop().release()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork)


class Progress:
    """`update(n, stage=..., loss=...)` after each unit of work; `close()` (or the `with` block's
    end) writes the last line when any line was written. `enabled=False` writes nothing."""

    def __init__(self, name: str, total: int, unit: str = "step", enabled: bool = True,
                 stream: TextIO | None = None) -> None:  # fmt: skip
        self.name, self.total, self.unit = name, max(int(total), 0), unit
        self.interval = interval_from_env() if enabled else None
        self._stream = stream  # None: sys.stderr at write time (pytest's capture replaces it)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # held while a line is written, and across a fork
        self._done, self._stage, self._metrics = 0, "", {}
        self._start, self._lines = time.monotonic(), 0
        self._stop = threading.Event()
        self._thread = None
        if self.interval:
            self._thread = threading.Thread(target=self._heartbeat, name=f"progress-{name}", daemon=True)
            self._thread.fork_safe = True  # between lines it holds no lock (cluster/forkserver.py)
            _LIVE.add(self)
            self._thread.start()

    def update(self, n: int = 1, stage: str | None = None, **metrics) -> None:
        with self._lock:
            self._done = min(self._done + n, self.total) if self.total else self._done + n
            if stage is not None:
                self._stage = stage
            self._metrics.update(metrics)
        if self.interval == 0:
            self._write()

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            _LIVE.discard(self)
        if self.interval is not None and self._lines:
            self._write(final=True)
        self.interval = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def line(self, final: bool = False) -> str:
        with self._lock:
            done, stage, metrics = self._done, self._stage, dict(self._metrics)
        elapsed = time.monotonic() - self._start
        parts = [f"{self.name}: {self.unit} {done}/{self.total}"]
        if self.total:
            parts[0] += f" ({100 * done // self.total}%)"
        if stage:
            parts.append(stage)
        parts += [_format_metric(k, v) for k, v in metrics.items()]
        if final:
            when = "done"
        elif done and self.total:
            when = f"ETA {format_duration(elapsed / done * (self.total - done))}"
        else:
            when = "ETA ?"
        return " ".join(parts) + f" | {format_duration(elapsed)} elapsed, {when}"

    def _write(self, final: bool = False) -> None:
        stream = self._stream or sys.stderr
        with self._write_lock:
            print(self.line(final), file=stream, flush=True)
            self._lines += 1

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.interval):
            self._write()
