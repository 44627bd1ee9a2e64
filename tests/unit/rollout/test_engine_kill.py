"""rollout/engine_fleet.kill_local_process: the health monitor SIGKILLs a hung (SIGSTOPped) engine
before replacing it, and only the process it started, recognised by its start time."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from miles_platform.rollout.engine_fleet import kill_local_process
from miles_platform.weights.transports import EngineProcess, process_started


@pytest.fixture
def stopped_child():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(p.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while psutil.Process(p.pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
        time.sleep(0.01)  # the signal lands asynchronously
    yield p
    p.kill()
    p.wait()


def test_a_clock_step_after_the_engine_started_does_not_spare_it(stopped_child, monkeypatch):
    # /proc/stat's btime moves when the clock is adjusted; a wall-clock start time then no longer
    # matches the one recorded at the engine's start (a make test run left a hung engine alive)
    me = EngineProcess(stopped_child.pid, "node", process_started(stopped_child.pid))
    real = psutil._pslinux.boot_time
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: real() + 1.0)
    assert kill_local_process(me)
    assert stopped_child.wait(timeout=5) == -signal.SIGKILL


def test_a_pid_now_another_processs_is_not_killed(stopped_child):
    other = EngineProcess(stopped_child.pid, "node", process_started(stopped_child.pid) - 300.0)
    assert not kill_local_process(other)
    assert psutil.Process(stopped_child.pid).status() == psutil.STATUS_STOPPED


def test_a_process_gone_is_not_an_error():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    started = process_started(p.pid)
    p.wait()
    assert not kill_local_process(EngineProcess(p.pid, "node", started))
