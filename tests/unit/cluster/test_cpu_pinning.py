"""--pin-trainer-cpus (cluster/cpu_pinning.py): the plan is made or refused before Ray, and each
process pins every one of its threads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from miles_platform.cluster import cpu_pinning
from miles_platform.config import ConfigError, RunConfig


def _cfg(**kw) -> RunConfig:
    return RunConfig(rollout_batch_size=4, **kw).validate()


def test_the_plan_gives_each_rank_its_threads_cores_and_the_rest_to_everything_else(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cpu_pinning.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    assert cpu_pinning.plan(_cfg(), 1) is None  # off by default
    assert cpu_pinning.plan(_cfg(pin_trainer_cpus=True), 1) == "0|1,2,3,5"
    assert cpu_pinning.plan(_cfg(pin_trainer_cpus=True, actor_num_gpus_per_node=2), 2) == "0,1;2,3|5"
    assert cpu_pinning._parse("0,1;2,3|5") == ([{0, 1}, {2, 3}], {5})
    with pytest.raises(ConfigError, match=r"2 trainer rank\(s\) x 3 thread\(s\).*need 6 cores"):
        cpu_pinning.plan(_cfg(pin_trainer_cpus=True, actor_num_gpus_per_node=2), 3)


def test_the_plan_is_refused_where_it_cannot_hold(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(cpu_pinning.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    with pytest.raises(ConfigError, match="CPU-only machines"):
        cpu_pinning.plan(_cfg(pin_trainer_cpus=True), 1)
    monkeypatch.setattr(cpu_pinning.glob, "glob", lambda pattern: [])
    with pytest.raises(ConfigError, match="local cluster"):
        cpu_pinning.plan(_cfg(pin_trainer_cpus=True, ray_address="10.0.0.1:6379"), 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    with pytest.raises(ConfigError, match=r"may use 1 \(3\)"):
        cpu_pinning.plan(_cfg(pin_trainer_cpus=True), 1)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_a_rank_and_the_others_pin_every_thread_and_the_driver_gets_its_cores_back():
    """In a fresh process (the test's own cores stay as they are): threads that exist when a process
    pins itself, and threads started after, all run on the plan's cores; the driver's undo restores."""
    a, b = sorted(os.sched_getaffinity(0))[:2]
    code = textwrap.dedent(f"""
        import os, threading
        from miles_platform.cluster import cpu_pinning
        stop = threading.Event()
        before = threading.Thread(target=stop.wait, daemon=True); before.start()
        def tids():
            return {{int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}}
        start = sorted(os.sched_getaffinity(0))
        os.environ[cpu_pinning.ENV] = "{a}|{b}"
        assert cpu_pinning.pin_trainer_rank(0) == {{{a}}}
        after = threading.Thread(target=stop.wait, daemon=True); after.start()
        assert set(map(tuple, tids().values())) == {{({a},)}}, tids()
        undo = cpu_pinning.pin_driver("{a}|{b}")
        assert cpu_pinning.active == "{a}|{b}"
        assert set(map(tuple, tids().values())) == {{({b},)}}, tids()
        undo()
        assert cpu_pinning.active is None and set(map(tuple, tids().values())) == {{({a},)}}
        print("ok", start)
        stop.set()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("ok"), out.stderr[-2000:]


def test_without_a_plan_nothing_is_pinned(monkeypatch):
    monkeypatch.delenv(cpu_pinning.ENV, raising=False)
    before = os.sched_getaffinity(0)
    assert cpu_pinning.pin_trainer_rank(0) is None and cpu_pinning.pin_others() is None
    assert cpu_pinning.pin_driver(None) is None and os.sched_getaffinity(0) == before
