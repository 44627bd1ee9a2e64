"""The SFT base of tests/e2e/test_learning.py, trained in the background while the suite runs.

The base is the demo's recipe pinned (1200 iterations, ~90 CPU-s on one core, compute-bound) and
was the largest single cost of `make test`. Under pytest-xdist the controller starts it as soon as a
worker has collected the learning test (`conftest.pytest_xdist_node_collection_finished`): one
process at the lowest CPU priority (nice 19, one torch thread), so it runs on the cycles the two
workers leave idle (~13% of a full run, sampled every second: waits on subprocesses, servers,
sockets) and takes nothing they would use; the learning test is ordered after the long files
(conftest.LONGEST_FIRST) and finds it trained, or waits for it. The same function trains it in the
test's own process where there is no controller (a single-process run). Same seed, same single
thread: the same weights either way.

    python tests/learning_base.py DIR     # what the controller runs: DIR/task, DIR/base, DIR/done
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

SFT_ITERS = 1200
BACKGROUND_DIR = "learning-base"  # under the controller's basetemp, the workers' basetemp's parent


def train_base(d: Path) -> dict[str, str]:
    """Task datasets (seed 0) in `d/task`, the SFT base in `d/base`; returns the task's paths."""
    from miles_platform.data.tasks import write_task_datasets
    from miles_platform.training.sft import default_sft_recipe, run_sft

    task = write_task_datasets(d / "task", seed=0)
    # the demo's recipe (1200 iterations: past the loss plateau, the same systematic carry error;
    # through the RL trainer since 2026-12-02, whose 600-iteration base stayed on the plateau at
    # 10.2%), pinned here so a recipe change does not silently change the test
    run_sft(
        task["sft"],
        str(d / "base"),
        recipe=replace(default_sft_recipe(), train_iters=SFT_ITERS),
        progress=False,
    )
    return task


def start_background(d: Path):
    """The controller's side: train the base into `d` in a nice-19 process (its log: d/log)."""
    import subprocess

    d.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(d / "log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, __file__, str(d)], env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, preexec_fn=lambda: os.nice(19),
        )  # fmt: skip
    (d / "pid").write_text(str(proc.pid))
    return proc


def wait_for_background(d: Path, timeout_s: float = 900.0) -> dict[str, str] | None:
    """The test's side: the task paths once the background base is trained; None when no
    background training was started (a run without the xdist controller)."""
    if not (d / "pid").exists():
        return None
    pid = int((d / "pid").read_text())
    deadline = time.monotonic() + timeout_s
    while not (d / "done").exists():
        if (d / "failed").exists() or not _alive(pid):
            if (d / "done").exists():
                break
            raise RuntimeError(f"the background SFT base failed (log {d / 'log'}):\n{_tail(d / 'log')}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the background SFT base is not done after {timeout_s:.0f} s ({d / 'log'})")
        time.sleep(0.5)
    return {split: str(d / "task" / f"{split}.jsonl") for split in ("train", "eval", "sft")}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (the controller has not reaped it yet) is dead
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def main(argv: list[str]) -> int:
    d = Path(argv[0])
    import torch

    torch.set_num_threads(1)  # as the test workers (conftest): the same weights as a worker's run
    try:
        t0, c0 = time.time(), time.process_time()
        train_base(d)
        (d / "done.tmp").write_text(f"wall {time.time() - t0:.1f} s, CPU {time.process_time() - c0:.1f} s\n")
        os.replace(d / "done.tmp", d / "done")
    except BaseException:
        (d / "failed").write_text(traceback.format_exc())
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
