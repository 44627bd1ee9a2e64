"""The SFT bases of the learning tests, trained in the background while the suite runs.

Three learning checks start from an SFT base: tests/e2e/test_learning.py (the demo's recipe pinned,
1200 compute-bound iterations, ~94 CPU-s on one core: the largest single cost of `make test`),
tests/e2e/test_vlm_loop.py's learning check (the counting task's tiny Qwen3-VL, ~27 CPU-s; `make
test-extended` only: its base is trained only when that test is collected) and
tests/e2e/test_diffusion_loop.py (the diffusion datasets and tiny DiT base materialized through
Dagster, ~30 CPU-s; its instance is on disk, so the test reads those materializations and runs the
training job in the same instance). Under pytest-xdist the
controller starts one process as soon as a worker has collected those tests
(`conftest.pytest_xdist_node_collection_finished`); it trains the bases one after the other at the
lowest CPU priority (nice 19, one torch thread), so they run on the cycles the two workers leave
idle (~13% of a full run, sampled every second: waits on subprocesses, servers, sockets) and take
nothing the workers would use. The tests are ordered after the long files (conftest.LONGEST_FIRST)
and find their base trained, or wait for it. Where there is no controller (a single-process run)
the test trains its base itself with the same function. Same seed, same single thread: the same
weights either way.

    python tests/background_bases.py DIR NAME...   # the controller's process: DIR/NAME/{base,paths.json,done}
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

SFT_ITERS = 1200
BACKGROUND_DIR = "bases"  # under the controller's basetemp, the workers' basetemp's parent


def learning_base(d: Path) -> dict[str, str]:
    """test_learning's: task datasets (seed 0) in `d/task`, the SFT base in `d/base`; the task's paths."""
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


def vlm_base(d: Path) -> dict[str, str]:
    """test_vlm_loop's: the counting task's datasets (seed 0) in `d/task`, its SFT base in `d/base`."""
    from miles_platform.data.image_tasks import write_count_datasets
    from miles_platform.training.vlm_base import VLMBaseRecipe, run_vlm_sft

    task = write_count_datasets(d / "task", seed=0)
    run_vlm_sft(str(d / "base"), VLMBaseRecipe())
    return task


DIFFUSION_SFT_STEPS = 600  # half the demo's recipe: a base that draws the dark squares (~32 CPU-s)
DIFFUSION_ASSETS = ("diffusion_prompt_dataset", "diffusion_eval_dataset", "diffusion_sft_dataset",
                    "diffusion_base_checkpoint")  # fmt: skip


def diffusion_assets(d: Path) -> dict[str, str]:
    """test_diffusion_loop's: the diffusion datasets and SFT base, materialized through Dagster into
    the storage root `d/root`, recorded in a Dagster instance on disk in `d/dagster` (the test opens
    it and runs the training job in it); the paths of both."""
    repo = str(Path(__file__).resolve().parents[1])
    if repo not in sys.path:  # `definitions` and `resources` (this file runs as a script from tests/)
        sys.path.insert(0, repo)
    import dagster as dg

    import definitions
    from resources.storage import StorageRootResource

    (d / "dagster").mkdir(parents=True, exist_ok=True)
    resources = {**definitions.defs.resources, "storage": StorageRootResource(root=str(d / "root"))}
    with dg.DagsterInstance.local_temp(tempdir=str(d / "dagster")) as instance:
        res = dg.materialize(list(definitions.defs.assets), selection=list(DIFFUSION_ASSETS), instance=instance,
                             resources=resources,
                             run_config={"ops": {"diffusion_base_checkpoint": {"config": {"steps": DIFFUSION_SFT_STEPS}}}})  # fmt: skip
        assert res.success
    return {"root": str(d / "root"), "dagster": str(d / "dagster")}


# name -> (the test file whose collection starts it, the builder: DIR -> the paths the test reads);
# in training order. The background process writes what the builder returned to NAME/paths.json
BASES = {
    "learning": ("tests/e2e/test_learning.py::", learning_base),
    "vlm": ("tests/e2e/test_vlm_loop.py::test_grpo_from_a_base", vlm_base),
    "diffusion": ("tests/e2e/test_diffusion_loop.py::", diffusion_assets),
}


def base_dir(name: str, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A test's (dir holding `base`, task paths): the background's when the controller trains it,
    else trained here into a fresh temp dir."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        d = tmp_path_factory.getbasetemp().parent / BACKGROUND_DIR  # the controller's basetemp
        task = wait_for_background(d, name)
        if task is not None:
            return d / name, task
    d = tmp_path_factory.mktemp(name)
    return d, BASES[name][1](d)


def wanted(ids: list[str]) -> list[str]:
    """The bases the collected test ids need, in training order."""
    return [n for n, (prefix, _) in BASES.items() if any(i.startswith(prefix) for i in ids)]


def start_background(d: Path, names: list[str]):
    """The controller's side: train the `names` bases into d/NAME in one nice-19 process (log: d/log)."""
    import subprocess

    d.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(d / "log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, __file__, str(d), *names], env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, preexec_fn=lambda: os.nice(19),
        )  # fmt: skip
    (d / "pid").write_text(str(proc.pid))
    (d / "names").write_text(" ".join(names))
    return proc


def wait_for_background(d: Path, name: str, timeout_s: float = 900.0) -> dict[str, str] | None:
    """The test's side: the task paths once the background has trained base `name`; None when no
    background process was started for it."""
    if not (d / "names").exists() or name not in (d / "names").read_text().split():
        return None
    pid, done = int((d / "pid").read_text()), d / name / "done"
    deadline = time.monotonic() + timeout_s
    while not done.exists():
        if (d / "failed").exists() or not _alive(pid):
            if done.exists():
                break
            raise RuntimeError(f"the background SFT bases failed (log {d / 'log'}):\n{_tail(d / 'log')}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the background {name} base is not done after {timeout_s:.0f} s ({d / 'log'})"
            )
        time.sleep(0.5)
    return json.loads((d / name / "paths.json").read_text())


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


def _die_with_parent() -> None:
    """Linux: end with the controller (a killed pytest leaves no trainer behind)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the controller died before the call
        os._exit(1)


def main(argv: list[str]) -> int:
    d, names = Path(argv[0]), argv[1:]
    _die_with_parent()
    import torch

    torch.set_num_threads(1)  # as the test workers (conftest): the same weights as a worker's run
    try:
        for name in names:
            t0, c0 = time.time(), time.process_time()
            paths = BASES[name][1](d / name)
            (d / name / "paths.json").write_text(json.dumps(paths))  # before `done`, which says it is there
            tmp = d / name / "done.tmp"
            tmp.write_text(f"wall {time.time() - t0:.1f} s, CPU {time.process_time() - c0:.1f} s\n")
            os.replace(tmp, d / name / "done")
    except BaseException:
        (d / "failed").write_text(traceback.format_exc())
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
