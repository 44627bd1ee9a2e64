"""kill -9 of `miles-platform train-diffusion` at its --ci-fault-hooks, then the same command again.

One run of 4 rollouts, a checkpoint every 2, an eval of every version. Three launches are
SIGKILLed: after rollout 2's version was recorded (before its checkpoint), during rollout 3's
checkpoint, and after its checkpoint; the fourth finishes. Each relaunch resumes from the last
checkpoint: no version number is used twice, what the killed process recorded past the checkpoint
is `abandoned` in the catalog, each rollout has exactly one committed version, and no `.tmp-*`
staging dir is left (a killed save's, planted before the last launch, is removed under the run lock).
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
from loop_helpers import warm_python

from miles_platform.diffusion.config import DIFFUSION_HOOKS, DiffusionRunConfig
from miles_platform.errors import ConfigError
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths

NUM_ROLLOUT = 4
# (hook, rollout): what each killed launch leaves for the next
KILLS = [
    ("version_recorded", 2),  # checkpoint of rollout 1; v3 recorded: abandoned
    ("save_start", 3),  # checkpoint of rollout 1; rollouts 2, 3 recorded: abandoned
    ("save_end", 3),  # checkpoint of rollout 3: nothing abandoned
]


@pytest.fixture
def base_and_data(tmp_path):
    from miles_platform.diffusion.model import DiTPipeline, PromptEncoder, build_tiny_dit, save_pipeline
    from miles_platform.diffusion.task import write_diffusion_data

    enc = PromptEncoder()
    base = save_pipeline(DiTPipeline(build_tiny_dit(0, enc), enc), tmp_path / "base")
    data = write_diffusion_data(tmp_path / "data", n_sft=8, n_train=32, n_eval=4)
    return base, data


def _args(base: str, data: dict, root: Path) -> list[str]:
    save = StoragePaths(str(root)).checkpoints("d")
    return ["--storage-root", str(root), "--run-name", "d", "--hf-checkpoint", base, "--diffusion-task", "t2i",
            "--prompt-data", data["train"], "--eval-prompt-data", "heldout", data["eval"], "--eval-interval", "1",
            "--skip-eval-before-train", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
            "--rollout-microgroup-size", "4", "--micro-batch-size", "32", "--num-rollout", str(NUM_ROLLOUT),
            "--diffusion-num-steps", "4", "--diffusion-step-strategy-path", "sde_window",
            "--diffusion-num-sde-steps", "2", "--n-samples-per-eval-prompt", "1", "--save", save,
            "--save-interval", "2"]  # fmt: skip


def _launch(args: list[str], ray_address: str, hooks: list | None, log: Path) -> int:
    argv = [
        *warm_python(),
        "-m",
        "miles_platform.cli",
        "train-diffusion",
        *args,
        "--ray-address",
        ray_address,
    ]
    if hooks:
        argv += ["--ci-fault-hooks", json.dumps(hooks)]
    with open(log, "a") as f:
        f.write(f"\n$ ... {' '.join(argv[-2:])}\n")
        f.flush()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                             os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        return subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=300).returncode


def test_a_hook_the_diffusion_loop_never_fires_is_refused_naming_those_it_does():
    req = [{"hook_name": "weight_update_paused", "action": {"kind": "kill_process"}}]
    kw = dict(hf_checkpoint="x", diffusion_task="t2i", prompt_data="p.jsonl", rollout_batch_size=2,
              num_rollout=1, diffusion_step_strategy_path="sde_window", diffusion_num_sde_steps=2)  # fmt: skip
    with pytest.raises(
        ConfigError, match="weight_update_paused.*never reached.*" + ", ".join(DIFFUSION_HOOKS)
    ):
        DiffusionRunConfig(**kw, ci_fault_hooks=json.dumps(req)).validate()
    rank = [{"hook_name": "trainer_step_before_allreduce", "action": {"kind": "kill_process"}}]
    with pytest.raises(ConfigError, match="trainer_step_before_allreduce"):
        DiffusionRunConfig(**kw, ci_fault_hooks=json.dumps(rank)).validate()
    with pytest.raises(ConfigError, match="choose one of"):  # fault_hooks.py's own parser: unknown names
        DiffusionRunConfig(
            **kw, ci_fault_hooks='[{"hook_name": "nope", "action": {"kind": "observe"}}]'
        ).validate()
    ok = [{"hook_name": h, "action": {"kind": "observe"}} for h in DIFFUSION_HOOKS]
    DiffusionRunConfig(**kw, ci_fault_hooks=json.dumps(ok)).validate()


def test_a_second_writer_of_the_save_dir_is_refused_before_anything_is_written_there(base_and_data, tmp_path):
    """train-diffusion starts inside `train`'s run lifecycle: one writer per --save dir as well as
    per run (it took the run lock only, so a run of another name could write the same checkpoints)."""
    from miles_platform.diffusion.config import parse_diffusion_config
    from miles_platform.diffusion.loop import DiffusionRun
    from miles_platform.store.run_lock import RunLock, RunLocked

    base, data = base_and_data
    cfg = parse_diffusion_config([*_args(base, data, tmp_path / "root"), "--num-rollout", "1"])
    with RunLock(cfg.save, "other", f"--save {cfg.save}"):
        with pytest.raises(RunLocked, match=f"--save {cfg.save} is being written by pid {os.getpid()}"):
            DiffusionRun(cfg).run()
    assert os.listdir(cfg.save) == ["writer.lock"]  # no run_config.json, no checkpoint


# ~16-31 s of `make test`: built of what it checks one by one (the run lifecycle and version recorder it
# shares with the LLM loop: test_crash_matrix.py's kill -9 chain; the diffusion checkpoint and resume:
# test_diffusion_loop.py's CLI resume), so in `make test-extended`
@pytest.mark.slow
@pytest.mark.extended
def test_kill_9_of_train_diffusion_then_relaunch_abandons_past_the_checkpoint_and_reuses_no_version(
    base_and_data, tmp_path
):
    import ray

    from miles_platform.cluster import ray_cluster

    base, data = base_and_data
    root = tmp_path / "root"
    args = _args(base, data, root)
    ray_cluster.init_ray(DiffusionRunConfig(), cpus_needed=2)  # the launches join this cluster
    address = ray.get_runtime_context().gcs_address
    log = tmp_path / "launches.log"
    for i, (hook, rollout) in enumerate(KILLS):
        req = [
            {
                "request_id": f"k{i}",
                "hook_name": hook,
                "action": {"kind": "kill_process"},
                "rollout_id": rollout,
            }
        ]
        rc = _launch(args, address, req, log)
        assert rc == -9, f"launch {i} ({hook} @ {rollout}) exited {rc}:\n{log.read_text()[-3000:]}"
        assert f"kill_process at {hook}, rollout {rollout}" in log.read_text()
    # what a kill in the middle of a checkpoint write leaves: its staging dir, never a result
    stale = StoragePaths(str(root)).checkpoints("d") + "/.iter_0000003.tmp-dead"
    os.makedirs(stale)
    Path(stale, "model.safetensors").write_bytes(b"half")
    assert _launch(args, address, None, log) == 0, log.read_text()[-3000:]
    assert f"removed {stale}" in log.read_text()

    cat = Catalog(StoragePaths(str(root)))
    _, rows = cat.query("select rollout_id, version, parent_version from policy_versions "
                        "where status = 'committed' order by rollout_id")  # fmt: skip
    assert [r[0] for r in rows] == list(range(NUM_ROLLOUT)), rows  # one committed version per rollout
    assert all(rows[i][2] == (rows[i - 1][1] if i else 0) for i in range(len(rows))), rows
    _, versions = cat.query("select version, rollout_id, status from policy_versions order by version")
    numbers = [v for v, _, _ in versions]
    assert len(numbers) == len(set(numbers)), versions  # no number used twice
    # kill 1: v3 (rollout 2) past the checkpoint of rollout 1; kill 2: rollouts 2 and 3 again
    assert [(r, s) for _, r, s in versions] == [
        (0, "committed"), (1, "committed"), (2, "abandoned"), (2, "abandoned"), (3, "abandoned"),
        (2, "committed"), (3, "committed"),
    ], versions  # fmt: skip
    assert rows[-1][1] == max(numbers)
    _, events = cat.query("select count(*) from run_events where event = 'resume'")
    assert events[0][0] == len(KILLS)
    _, dup = cat.query("select rollout_id, name, count(*) from metrics where status = 'committed' "
                       "group by 1, 2 having count(*) > 1")  # fmt: skip
    assert dup == []
    _, evals = cat.query("select version, status from evals order by version")
    gone = {v for v, _, s in versions if s == "abandoned"}
    assert {v for v, s in evals if s == "abandoned"} <= gone  # v3 was killed before its eval
    assert sorted(v for v, s in evals if s == "committed") == [v for v, _, s in versions if s == "committed"]
    left = [p for p in root.rglob("*") if ".tmp-" in p.name]
    assert left == [], left
