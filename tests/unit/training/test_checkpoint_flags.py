"""Miles' checkpoint flags on the policy trainer (training/actor_checkpoint.py): --no-save-optim,
--no-load-optim, --no-load-rng, --async-save (a kill -9 mid-save leaves the previous checkpoint, fsdp
and megatron),
--save-trigger-sentinel (store/recorder.py)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from loop_helpers import random_train_batch
from safetensors.torch import load_file, save_file

from miles_platform.config import RunConfig
from miles_platform.errors import CheckpointError, ConfigError
from miles_platform.training.actor import TrainerActor
from miles_platform.training.checkpoint import iter_dir, read_latest


def _cfg(ckpt, save, **kw):
    base = dict(hf_checkpoint=ckpt, rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4,
                lr=1e-3, save=save, num_rollout=4, micro_batch_size=2, lr_decay_style="linear")  # fmt: skip
    return RunConfig(**{**base, **kw}).validate()


def _batch(seed=0):
    return random_train_batch(seed, rewards=[1.0, 0.0, 0.0, 1.0])


def test_no_save_optim_needs_no_load_optim_to_resume_and_says_so(tiny_hf_checkpoint, tmp_path, capsys):
    save = str(tmp_path / "ck")
    a = TrainerActor(_cfg(tiny_hf_checkpoint, save, no_save_optim=True))
    a.train(0, _batch(0))
    a.save(0)
    assert not [f for f in os.listdir(iter_dir(save, 0)) if f.startswith("optimizer")]
    with pytest.raises(CheckpointError, match="--no-save-optim.*--no-load-optim"):
        TrainerActor(_cfg(tiny_hf_checkpoint, save)).load()
    b = TrainerActor(_cfg(tiny_hf_checkpoint, save, no_load_optim=True))
    b.load()
    assert "--no-load-optim" in capsys.readouterr().err
    assert b.opt.state == {} and b.global_step == 1
    assert b.sched.get_last_lr() == a.sched.get_last_lr()  # the schedule continues at the saved step
    wa, wb = a.get_hf_weights(), b.get_hf_weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_no_load_optim_and_no_load_rng_skip_only_their_state(tiny_hf_checkpoint, tmp_path):
    save = str(tmp_path / "ck")
    a = TrainerActor(_cfg(tiny_hf_checkpoint, save))
    a.train(0, _batch(0))
    a.save(0)
    saved_rng = load_file(os.path.join(iter_dir(save, 0), "rng_rank000.safetensors"))["torch"]
    full = TrainerActor(_cfg(tiny_hf_checkpoint, save))
    full.load()
    assert full.opt.state and torch.equal(torch.get_rng_state(), saved_rng)
    fresh = TrainerActor(_cfg(tiny_hf_checkpoint, save, no_load_optim=True, no_load_rng=True))
    seeded = torch.get_rng_state()
    fresh.load()
    assert fresh.opt.state == {} and fresh.sched.num_steps == 1  # the scheduler state still restored
    assert torch.equal(torch.get_rng_state(), seeded)


def test_checkpoint_flags_without_effect_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--async-save.*without --save"):
        RunConfig(rollout_batch_size=1, async_save=True).validate()
    with pytest.raises(ConfigError, match="--no-load-rng: no effect without --load or --save"):
        RunConfig(rollout_batch_size=1, no_load_rng=True).validate()
    with pytest.raises(ConfigError, match="--async-save: not built with a critic"):
        RunConfig(
            rollout_batch_size=1, async_save=True, save=str(tmp_path), advantage_estimator="ppo"
        ).validate()


def test_async_save_writes_the_weights_of_the_save_point_in_the_background(tiny_hf_checkpoint, tmp_path):
    save = str(tmp_path / "ck")
    a = TrainerActor(_cfg(tiny_hf_checkpoint, save, async_save=True))
    a.train(0, _batch(0))
    at_save = {k: v.clone() for k, v in a.get_hf_weights().items()}
    assert a.save(0) == iter_dir(save, 0) and a.pending_save is not None
    a.train(1, _batch(1))  # finishes the save first, then steps: the checkpoint keeps the save point's
    assert a.pending_save is None and read_latest(save) == 0
    b = TrainerActor(_cfg(tiny_hf_checkpoint, save))
    assert b.load()["rollout_id"] == 0
    wb = b.get_hf_weights()
    assert all(torch.equal(at_save[k], wb[k]) for k in at_save)
    assert b.opt.state and b.global_step == 1


KILLED_MID_SAVE = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from miles_platform.training.checkpoint import Checkpointer
    save, started = sys.argv[1], sys.argv[2]
    ck = Checkpointer(save, marker="state.json")
    ck.save(0, lambda d: Path(d, "model.safetensors").write_bytes(b"v0"),
            lambda d: Path(d, "state.json").write_text("{}"))
    def slow(d):
        Path(d, "model.safetensors").write_bytes(b"half")
        Path(started).touch()
        time.sleep(60)
    ck.save_async(1, slow, lambda d: Path(d, "state.json").write_text("{}"))
    time.sleep(60)
""")


def test_a_kill_9_during_an_async_save_leaves_the_previous_checkpoint(tmp_path):
    save, started = str(tmp_path / "ck"), tmp_path / "started"
    p = subprocess.Popen([sys.executable, "-c", KILLED_MID_SAVE, save, str(started)])
    try:
        deadline = time.time() + 30
        while not started.exists() and time.time() < deadline and p.poll() is None:
            time.sleep(0.05)
        assert started.exists(), "the background save never started"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
    assert read_latest(save) == 0 and not os.path.exists(iter_dir(save, 1))
    assert open(os.path.join(iter_dir(save, 0), "model.safetensors"), "rb").read() == b"v0"


def _megatron_cfg(ckpt: str, save: str) -> RunConfig:
    return RunConfig(hf_checkpoint=ckpt, train_backend="megatron", rollout_batch_size=2, n_samples_per_prompt=2,
                     global_batch_size=4, micro_batch_size=2, lr=1e-3, num_rollout=4, save=save,
                     async_save=True).validate()  # fmt: skip


def _saves_then_dies_mid_save(rank: int, ckpt: str, save: str, out: str) -> None:
    """A megatron trainer: async save 0, finished by the next train call; async save 1 hangs once its
    tensor files are written (before its metadata and the pointer) until the test kills it."""
    from miles_platform.training import megatron_checkpoint

    torch.set_num_threads(1)
    try:
        a = TrainerActor(_megatron_cfg(ckpt, save))
        a.train(0, _batch(0))
        save_file(a.get_hf_weights(), os.path.join(out, "at_save_0.safetensors"))
        a.save(0)
        a.train(1, _batch(1))  # finishes save 0 (its metadata, the pointer), then steps
        write = megatron_checkpoint.AsyncTorchDist.write

        def write_then_hang(self, d):
            write(self, d)
            open(os.path.join(out, "started"), "w").close()
            time.sleep(120)

        megatron_checkpoint.AsyncTorchDist.write = write_then_hang
        a.save(1)
        time.sleep(120)
    except Exception:
        import traceback

        open(os.path.join(out, "rank0.error"), "w").write(traceback.format_exc())


def _relaunch(rank: int, ckpt: str, save: str, weights: str, out: str) -> None:
    torch.set_num_threads(1)
    try:
        b = TrainerActor(_megatron_cfg(ckpt, save))
        assert b.load()["rollout_id"] == 0 and b.opt.state and b.global_step == 1
        want, got = load_file(weights), b.get_hf_weights()
        assert all(torch.equal(want[k], got[k]) for k in want)
    except BaseException:
        import traceback

        open(os.path.join(out, "rank0.error"), "w").write(traceback.format_exc())


def test_a_kill_9_during_a_megatron_async_save_resumes_from_the_last_complete_checkpoint(
    tiny_hf_checkpoint, tmp_path
):
    """torch_dist's async save: the plan at the save point, the files in the background, the metadata
    and the pointer at the next train call. A kill -9 between leaves save 0 the one to resume from."""
    from loop_helpers import run_ranks, spawn_ranks

    save, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    ctx = spawn_ranks(_saves_then_dies_mid_save, (tiny_hf_checkpoint, str(save), str(out)), 1, join=False)
    (proc,) = ctx.processes
    try:
        deadline = time.time() + 120
        while not (out / "started").exists() and time.time() < deadline and proc.is_alive():
            time.sleep(0.05)
        errors = [p.read_text() for p in out.glob("*.error")]
        assert (out / "started").exists(), errors or "the background save never started"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.join(10)
    assert read_latest(str(save)) == 0 and not os.path.exists(iter_dir(str(save), 1))
    assert [d for d in os.listdir(save) if d.startswith(".iter_0000001")]  # the unfinished one, unpublished
    relaunch = tmp_path / "relaunch"
    run_ranks(
        _relaunch,
        (tiny_hf_checkpoint, str(save), str(out / "at_save_0.safetensors"), str(relaunch)),
        1,
        relaunch,
    )


def _shims_then_wait(rank: int, out: str) -> None:
    """A megatron rank's CPU set-up (the torch_dist writer's results Manager, a forked helper), then
    its helper pids, then nothing until it is killed."""
    import json
    import multiprocessing

    from miles_platform.training.megatron_shims import apply_cpu_shims

    apply_cpu_shims()
    with open(os.path.join(out, "helpers.tmp"), "w") as f:
        json.dump([p.pid for p in multiprocessing.active_children()], f)
    os.replace(os.path.join(out, "helpers.tmp"), os.path.join(out, "helpers.json"))
    time.sleep(120)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except OSError:
        return True


def test_a_killed_megatron_rank_leaves_no_helper_process_behind(tmp_path):
    """kill -9 of a megatron rank (a fault hook, the OOM killer): the writer's results Manager it
    forked exits with it. It used to stay, orphaned, serving forever (~370 MB each, one per
    killed rank; one was left after every `make test`)."""
    import json

    from loop_helpers import spawn_ranks

    ctx = spawn_ranks(_shims_then_wait, (str(tmp_path),), 1, join=False)
    (proc,) = ctx.processes
    try:
        deadline = time.time() + 60
        while not (tmp_path / "helpers.json").exists() and time.time() < deadline and proc.is_alive():
            time.sleep(0.05)
        helpers = json.loads((tmp_path / "helpers.json").read_text())
        assert helpers, "the rank started no helper process: nothing to check"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.join(10)
    deadline = time.time() + 10
    while not all(_gone(p) for p in helpers) and time.time() < deadline:
        time.sleep(0.1)
    left = [p for p in helpers if not _gone(p)]
    for p in left:  # never leave one behind, even when the check fails
        os.kill(p, signal.SIGKILL)
    assert not left, f"helper processes {left} outlived their killed rank"


def test_save_trigger_sentinel_makes_any_rollout_a_save_point(tmp_path):
    from miles_platform.run_types import Reporter
    from miles_platform.store.paths import StoragePaths
    from miles_platform.store.recorder import VersionRecorder

    sentinel, lines = tmp_path / "save_now", []
    cfg = RunConfig(rollout_batch_size=1, run_name="r", storage_root=str(tmp_path), save=str(tmp_path / "ckpt"),
                    save_interval=10, num_rollout=20, save_trigger_sentinel=str(sentinel)).validate()  # fmt: skip
    log = Reporter()
    log.log = lines.append
    rec = VersionRecorder(cfg, StoragePaths(cfg.storage_root), log, "base", "data", ("train/loss",))
    assert not rec.save_due(2)
    sentinel.touch()
    assert rec.save_due(2) and rec.save_requested()
    rec.save_request_done(2)
    assert not sentinel.exists() and not rec.save_due(3) and "saved rollout 2" in lines[-1]
    with pytest.raises(ConfigError, match="--save-trigger-sentinel: no effect without --save"):
        RunConfig(rollout_batch_size=1, save_trigger_sentinel=str(sentinel)).validate()
