"""Where a run's start-up goes: wall seconds from `miles-platform train`'s invocation (the process
start; a run started in-process, e.g. by the Dagster op, from `train()`) to the first rollout's
generation, by phase. Each phase ends with a `mark`; the run reports them once, when the first
rollout starts generating: a `[startup]` log line and, in that rollout's metrics,
`perf/startup_time` (the total) and `perf/startup_<phase>_time`.

Phases of `train` (loop.py, run_services.py), in order:
  launch     process start -> the run object: interpreter, CLI imports, flag parsing (CLI only)
  preflight  validate_before_start: every flag's checks, plugin imports, the checkpoint's config
             (a local run's fork server, started just before, imports the actors' modules beside it)
  data       tokenizer, prompt dataset, defaults, content hashes of checkpoint and data
  ray        run lock, Ray's local cluster, trackers (the graders import beside it)
  placement  placement groups
  engines    engines up and warm (the trainers build beside them)
  trainers   what the trainers still need after that: ready + checkpoint load
  services   rollout manager, weight-update session, colocation
  resume     resume bookkeeping, the initial weight sync, eval before training, async worker
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import threading
import time

PHASES = ("launch", "preflight", "data", "ray", "placement", "engines", "trainers", "services", "resume")


def process_age_s() -> float | None:
    """Seconds since this process started (/proc: its start in clock ticks since boot), or None."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5): starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartupClock:
    """`mark(phase)` ends a phase; `metrics()` / `summary()` report them. `from_process_start()`
    counts the process's own start-up as the `launch` phase (what `miles-platform train` pays)."""

    def __init__(self, launch_s: float | None = None):
        self.t0 = time.monotonic()
        self.last = self.t0
        self.phases: dict[str, float] = {}
        if launch_s is not None:
            self.phases["launch"] = launch_s
        self.reported = False
        self.paused_gc = False  # pause_gc turned the collector off; started turns it back on

    @classmethod
    def from_process_start(cls) -> StartupClock:
        return cls(launch_s=process_age_s())

    def pause_gc(self) -> None:
        """No cyclic garbage collection until `started` (a run's own process: the CLI). Start-up
        imports and builds the objects the process keeps to its end, and each full collection walks
        all of them again: `train-async`'s driver made 6 (~0.75 CPU-s) before its services were up
        and one of 270 ms in its loop (2026-12-07). `started` freezes them out of every later one."""
        import gc

        self.paused_gc = gc.isenabled()
        gc.disable()

    def started(self) -> None:
        """The run's services are up: what start-up built is frozen (never collected: it lives to
        the end, and reference counting still frees what it drops; with it the cyclic garbage
        start-up left, ~10k objects, once) and collection resumes."""
        import gc

        if self.paused_gc:
            gc.freeze()
            gc.enable()
            self.paused_gc = False

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now

    def total(self) -> float:
        return sum(self.phases.values())

    def metrics(self) -> dict[str, float]:
        out = {f"perf/startup_{k}_time": v for k, v in self.phases.items()}
        out["perf/startup_time"] = self.total()
        return out

    def summary(self) -> str:
        parts = " ".join(f"{k} {v:.2f}" for k, v in self.phases.items())
        return f"[startup] {self.total():.2f} s to the first rollout's generation: {parts}"


def import_in_background(*modules: str, name: str = "warm-imports") -> threading.Thread:
    """Import `modules` on a daemon thread, quietly (a module that fails to import is imported again,
    and fails loudly, where it is used): for a process that mostly waits at that point of its start.
    pyarrow, for one, imports pandas (0.3-1 CPU-s) the first time it builds any array: a run's first
    table read or write paid it on the critical path of its start."""

    def run() -> None:
        for m in modules:
            with contextlib.suppress(Exception):
                importlib.import_module(m)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t


def bytecode_note(module: str = "torch") -> str | None:
    """A start-up log line where this process may not write .pyc files (PYTHONDONTWRITEBYTECODE) and
    `module`, the heaviest import of every process of a run, has none: each of them then compiles all
    it imports at every start (a `train-async` start 11.4-14.7 s against 4.9-5.1 s with .pyc files on
    a 2-core VM, 2026-12-07). None where there is nothing to say."""
    if not sys.dont_write_bytecode:
        return None
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    if os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return None
    return (
        f"[startup] PYTHONDONTWRITEBYTECODE is set and {module} has no .pyc: every process of this run "
        "compiles each module it imports at each start (seconds of CPU each); unset it once (`make` "
        "targets do) or byte-compile the environment (python -m compileall)"
    )
