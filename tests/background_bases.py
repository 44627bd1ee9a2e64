"""The learning test's SFT base, built in the background on the CPU the rest of the suite leaves idle.

The base (the demo's recipe: 1200 compute-bound SFT iterations, ~100 CPU-seconds) is the largest
single piece of `make test`. On 2 xdist workers ~13% of both cores sit idle (tests waiting on a
subprocess, a health check, a browser), so the pytest process that starts the session (xdist's
controller, which runs no test) starts one `nice -n 19` process that builds the base into a shared
dir: it gets only what the workers leave, and the whole core when the learning test waits on it.
The fixture takes the base from there (same code, seed and single thread: the same weights), or
builds it inline when no background build was started (the file run alone, a nested pytest).

    python tests/background_bases.py learning DIR    # what the background process runs
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ENV = "MILES_TEST_BASES"  # the shared dir, set for the workers by the controller
LEARNING_FILE = "tests/e2e/test_learning.py"
SFT_ITERS = 1200
WAIT_S = 900.0
_procs: list[subprocess.Popen] = []


def build_learning(out: Path) -> dict:
    """The task datasets (seed 0) and the demo's SFT base (1200 iterations, pinned here so a
    recipe change does not silently change the learning test) under `out`: {task paths}."""
    from dataclasses import replace

    from miles_platform.data.tasks import write_task_datasets
    from miles_platform.training.sft import default_sft_recipe, run_sft

    task = write_task_datasets(out / "task", seed=0)
    # the demo's recipe (1200 iterations: past the loss plateau, the same systematic carry error;
    # through the RL trainer since 2026-12-02, whose 600-iteration base stayed on the plateau at 10.2%)
    run_sft(task["sft"], str(out / "base"), recipe=replace(default_sft_recipe(), train_iters=SFT_ITERS),
            progress=False)  # fmt: skip
    return task


def _selected(args: list[str], rootdir: Path, target: str) -> bool:
    """Does the command line select `target` (a test file under the rootdir)?"""
    paths = [a.split("::")[0] for a in args if not a.startswith("-")] or ["tests"]
    want = (rootdir / target).resolve()
    for p in paths:
        p = (rootdir / p).resolve() if not os.path.isabs(p) else Path(p).resolve()
        if p == want or p in want.parents:
            return True
    return False


def start(config) -> None:
    """In the session's first pytest process (not an xdist worker, not a nested run): start the
    background build when the learning test is selected."""
    if hasattr(config, "workerinput") or os.environ.get(ENV):
        return
    if config.getoption("collectonly", False) or not _selected(config.args, config.rootpath, LEARNING_FILE):
        return
    import tempfile

    d = tempfile.mkdtemp(prefix="miles-test-bases-")
    os.environ[ENV] = d
    log = open(os.path.join(d, "learning.log"), "w")  # noqa: SIM115
    _procs.append(subprocess.Popen([sys.executable, __file__, "learning", d], stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True))  # fmt: skip


def stop(config) -> None:
    """At the session's end: a build still running is stopped (a run that did not reach the test)
    and the shared dir removed."""
    import shutil

    for p in _procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    if _procs:
        shutil.rmtree(os.environ.pop(ENV), ignore_errors=True)
        _procs.clear()


def learning_base(tmp: Path) -> tuple[str, dict]:
    """(the SFT base's HF dir, the task's dataset paths under `tmp`): the background build's base
    when one was started, else one built here under `tmp`."""
    d = os.environ.get(ENV)
    if not d or not os.path.exists(os.path.join(d, "learning.log")):
        return str(tmp / "base"), build_learning(tmp)
    out, deadline = Path(d) / "learning", time.monotonic() + WAIT_S
    while not (out / "DONE").exists():
        failed = Path(d) / "learning.failed"
        assert not failed.exists() and time.monotonic() < deadline, (
            "the background SFT base build failed or hung:\n" + (Path(d) / "learning.log").read_text()[-3000:]
        )
        time.sleep(0.5)
    from miles_platform.data.tasks import write_task_datasets

    return str(out / "base"), write_task_datasets(tmp / "task", seed=0)


def _main(kind: str, d: str) -> None:
    os.nice(19)  # only the CPU the test workers leave idle
    import torch

    torch.set_num_threads(1)  # as the test workers (tests/conftest.py): the same weights
    out = Path(d) / kind
    try:
        build_learning(out)
    except BaseException:
        Path(d, f"{kind}.failed").touch()
        raise
    Path(out, "DONE").touch()


if __name__ == "__main__":
    _main(*sys.argv[1:3])
