"""Hold an embedded engine's scheduler at an exact state, through `EngineCore.step_hook`, so a test
acts on a request that is provably mid-generation instead of sleeping and hoping."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from miles_platform.rollout.engine_core import EngineCore


class HoldScheduler:
    """`with HoldScheduler(core, when) as held:` ... `held.wait()` blocks until, after some step,
    `when(core)` is true; the scheduler then stays parked in its step hook (no step runs; pause and
    the queue still answer) until the block exits. Every wait is bounded by `timeout_s`."""

    def __init__(self, core: EngineCore, when: Callable[[EngineCore], bool], timeout_s: float = 30.0):
        self.core, self.when, self.timeout_s = core, when, timeout_s
        self._reached, self._released = threading.Event(), threading.Event()

    def _hook(self, core: EngineCore) -> None:
        if not self._reached.is_set() and self.when(core):
            self._reached.set()
            self._released.wait(self.timeout_s)  # bounded: a failing test cannot wedge the engine

    def wait(self) -> None:
        assert self._reached.wait(self.timeout_s), f"the engine did not reach the state in {self.timeout_s} s"

    def __enter__(self) -> HoldScheduler:
        assert self.core.step_hook is None, "one step_hook at a time"
        self.core.step_hook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        self.core.step_hook = None
        self._released.set()


def every_request_has_tokens(n: int) -> Callable[[EngineCore], bool]:
    """`n` requests are running and each has produced a token (a total token count alone can be
    reached by one request while another is still queued)."""
    return lambda core: sum(r.output_tokens > 0 for r in core.running()) >= n


def until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll `cond` (state another thread changes outside the scheduler, so no step signals it)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)
