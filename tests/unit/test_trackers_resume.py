"""Trackers that follow a resumed run (issue 51), at the level of trackers.py with a fake resume (a
crashed launch, a checkpoint pointer, a relaunch) instead of whole training runs: the relaunch
continues the wandb run its checkpoint dir names, TensorBoard shows each step once (the crashed
launch's steps past the checkpoint dropped), and --log-rollout-samples sends N samples per
--log-interval to both trackers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from miles_platform.config import ConfigError, RunConfig
from miles_platform.data.sample import Sample
from miles_platform.store.paths import StoragePaths
from miles_platform.trackers import WANDB_RUN, Trackers, validate_trackers
from miles_platform.training.checkpoint import LATEST

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def config(tmp_path: Path, **flags) -> RunConfig:
    return RunConfig(run_name="t", storage_root=str(tmp_path / "root"), save=str(tmp_path / "ckpt"), **flags)


def checkpoint_at(cfg: RunConfig, rollout_id: int) -> None:
    """What a save of rollout `rollout_id` leaves for the relaunch to read: the pointer."""
    Path(cfg.save).mkdir(parents=True, exist_ok=True)
    (Path(cfg.save) / LATEST).write_text(str(rollout_id))


def launch(cfg: RunConfig, start: int, steps: dict[int, dict[str, float]], crash: bool) -> Trackers:
    """One launch: trackers up, the loop's resume point, metrics per rollout, down (failed: a crash)."""
    t = Trackers(cfg, StoragePaths(cfg.storage_root), lambda m: None)
    t.resume(start)
    for step, metrics in steps.items():
        t.log(step, metrics)
    t.close(failed=crash)
    return t


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return {tag: points for tag, points in got.items() if points}  # a tag whose points were all purged: none


def test_tensorboard_shows_each_step_once_after_a_resume(tmp_path):
    cfg = config(tmp_path, use_tensorboard=True)
    tb = Path(cfg.storage_root) / "runs" / "t" / "tensorboard"
    # the first launch logs rollouts 0..3 (an eval at 3) and dies; its last checkpoint was rollout 1
    launch(cfg, 0, {i: {"train/loss": 10.0 + i} | ({"eval/x/pass@1": 0.5} if i == 3 else {}) for i in range(4)},
           crash=True)  # fmt: skip
    checkpoint_at(cfg, 1)
    launch(cfg, 2, {2: {"train/loss": 22.0}, 3: {"train/loss": 23.0}}, crash=False)
    got = scalars(tb)
    assert got["train/loss"] == [(0, 10.0), (1, 11.0), (2, 22.0), (3, 23.0)]
    assert "eval/x/pass@1" not in got  # logged only by the abandoned rollout 3

    # a relaunch with no checkpoint (a crash before the first save) starts over: nothing earlier shows
    (Path(cfg.save) / LATEST).unlink()
    launch(cfg, 0, {0: {"train/loss": 30.0}}, crash=False)
    assert scalars(tb) == {"train/loss": [(0, 30.0)]}


def test_the_loops_start_wins_over_the_checkpoint_pointer(tmp_path):
    """The writer opens at the checkpoint's rollout; the loop's resume point (the trainer's state)
    reopens it where they differ."""
    cfg = config(tmp_path, use_tensorboard=True, tensorboard_dir=str(tmp_path / "tb"))
    launch(cfg, 0, {i: {"train/loss": float(i)} for i in range(4)}, crash=True)
    checkpoint_at(cfg, 0)  # the pointer says 0, the trainer state resumes after rollout 2
    launch(cfg, 3, {3: {"train/loss": 33.0}}, crash=False)
    assert scalars(tmp_path / "tb")["train/loss"] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 33.0)]


wandb_flags = dict(use_wandb=True, wandb_mode="offline", wandb_project="miles-test")


@pytest.fixture
def wandb_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the `trackers` extra is not installed")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return str(tmp_path / "wb")


def test_a_resumed_run_continues_its_wandb_run(tmp_path, wandb_dir):
    cfg = config(tmp_path, wandb_dir=wandb_dir, **wandb_flags)
    first = Trackers(cfg, StoragePaths(cfg.storage_root), lambda m: None)
    first_id = first.sinks[0].run.id
    first.log(0, {"train/loss": 1.0})
    first.close(failed=True)  # the launch dies
    kept = json.loads((Path(cfg.save) / WANDB_RUN).read_text())
    assert (
        kept["run_name"] == "t" and kept["id"] == first_id and kept["group"].startswith("t_")
    )  # random suffix

    checkpoint_at(cfg, 0)
    second = Trackers(cfg, StoragePaths(cfg.storage_root), lambda m: None)
    sink = second.sinks[0]
    assert (sink.run.id, sink.run.group, sink.run.name) == (kept["id"], kept["group"], kept["group"])
    assert sink.continued and "continues the run its checkpoint dir names" in sink.describe()
    second.close()
    offline = sorted(p.name for p in Path(wandb_dir).glob("wandb/offline-run-*"))
    # offline-run-<time>-<id>, and "-1" after it when both launches fall in one second
    assert len(offline) == 2 and all(re.search(f"-{kept['id']}(-[0-9]+)?$", n) for n in offline), offline

    # no checkpoint to resume (or another run's record): a new wandb run
    (Path(cfg.save) / LATEST).unlink()
    fresh = Trackers(cfg, StoragePaths(cfg.storage_root), lambda m: None)
    assert fresh.sinks[0].run.id != kept["id"] and not fresh.sinks[0].continued
    fresh.close()
    # an explicit --wandb-run-id wins over the record
    checkpoint_at(cfg, 0)
    mine = Trackers(config(tmp_path, wandb_dir=wandb_dir, wandb_run_id="mine", **wandb_flags),
                    StoragePaths(cfg.storage_root), lambda m: None)  # fmt: skip
    assert mine.sinks[0].run.id == "mine"
    mine.close()


def samples(rollout_id: int) -> list[Sample]:
    return [Sample(run="t", rollout_id=rollout_id, index=i, prompt=f"{i}+{i}=", response=f"{2 * i} |ok\nyes",
                   reward=float(i), label=str(2 * i)) for i in range(3)]  # fmt: skip


def test_rollout_samples_go_to_the_trackers_every_log_interval(tmp_path, wandb_dir):
    cfg = config(tmp_path, use_tensorboard=True, tensorboard_dir=str(tmp_path / "tb"), wandb_dir=wandb_dir,
                 log_rollout_samples=2, log_interval=2, **wandb_flags)  # fmt: skip
    t = Trackers(cfg, StoragePaths(cfg.storage_root), lambda m: None)
    for rid in range(3):
        t.rollout_data(rid, samples(rid), {}, 0.0)
    t.close()

    acc = event_accumulator.EventAccumulator(
        str(tmp_path / "tb"), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    (tag,) = [tag for tag in acc.Tags()["tensors"] if tag.startswith("rollout/samples")]
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)}
    assert sorted(texts) == [0, 2]
    lines = texts[2].splitlines()
    assert lines[0] == "| rollout_id | index | prompt | response | reward | status |" and len(lines) == 4
    assert lines[3] == "| 2 | 1 | 1+1= | 2 \\|ok<br>yes | 1.0 | completed |"

    tables = sorted(
        Path(wandb_dir).glob("wandb/offline-run-*/files/media/table/rollout/samples_*.table.json")
    )
    assert len(tables) == 2, tables
    data = [json.loads(p.read_text()) for p in tables]
    assert all(
        d["columns"] == ["rollout_id", "index", "prompt", "response", "reward", "status"] for d in data
    )
    assert sorted(row[0] for d in data for row in d["data"]) == [0, 0, 2, 2]
    assert [0, 1, "1+1=", "2 |ok\nyes", 1.0, "completed"] in data[0]["data"] + data[1]["data"]


def test_log_rollout_samples_needs_a_tracker_and_a_count(tmp_path):
    with pytest.raises(
        ConfigError, match="--log-rollout-samples: set without --use-wandb / --use-tensorboard"
    ):
        validate_trackers(config(tmp_path, log_rollout_samples=4), StoragePaths(str(tmp_path / "root")))
    with pytest.raises(ConfigError, match="--log-rollout-samples"):
        RunConfig.from_dict({"rollout_batch_size": 2, "log_rollout_samples": -1}).validate()
