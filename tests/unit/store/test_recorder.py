"""The version bookkeeping both loops share (store/recorder.py): numbers past every store, the
resume event, when a checkpoint is due, each rollout's metrics."""

import os

from miles_platform.config import RunConfig
from miles_platform.run_types import Reporter, RunResult
from miles_platform.store.paths import StoragePaths
from miles_platform.store.recorder import VersionRecorder
from miles_platform.store.run_events import resume_events
from miles_platform.store.tables import append_rows, read_rows


class Log(Reporter):
    def __init__(self):
        self.lines, self.rollouts = [], []

    def log(self, msg: str) -> None:
        self.lines.append(msg)

    def on_rollout(self, rollout_id, metrics) -> None:
        self.rollouts.append(rollout_id)


def _recorder(tmp_path, **kw) -> tuple[VersionRecorder, Log]:
    cfg = RunConfig(rollout_batch_size=1, run_name="r", storage_root=str(tmp_path), **kw).validate()
    rep = Log()
    return VersionRecorder(cfg, StoragePaths(cfg.storage_root), rep, "base", "data", ("train/loss",)), rep


def test_a_relaunch_numbers_past_every_store_and_branches_from_its_checkpoint(tmp_path):
    rec, rep = _recorder(tmp_path, save=str(tmp_path / "ckpt"))
    assert rec.resume(None, []) == (0, 0) and rep.lines == []  # a first launch records nothing
    append_rows(rec.paths, "policy_versions", "r", [{"version": v, "rollout_id": v - 1} for v in (1, 2, 3)])
    os.makedirs(rec.paths.hf_export("r", 5))  # exported, never recorded (killed)
    # the checkpoint holds rollout 1 (v2); the disk-delta publication got to v6
    state = {"rollout_id": 1, "weight_version": 2, "config_hash": "abc"}
    assert rec.resume(state, ["--lr 0.001 -> 0.002"], published=6) == (2, 2)
    assert rec.highest == 6 and rec.next_version(2) == (2, 7) and rec.next_version(7) == (7, 8)
    assert rep.lines == [f"[resume] from {tmp_path / 'ckpt'} rollout 1, v2; v3..v6, made after it by a run "
                         "that stopped, are abandoned"]  # fmt: skip
    assert rec.config_changed_from == "abc" and len(resume_events(rec.paths, "r")) == 1


def test_a_checkpoint_is_due_every_interval_and_at_the_end_with_save_only(tmp_path):
    rec, _ = _recorder(tmp_path, save=str(tmp_path / "ckpt"), save_interval=2, num_rollout=5)
    assert [r for r in range(5) if rec.save_due(r)] == [1, 3, 4]
    rec, _ = _recorder(tmp_path, save_interval=2, num_rollout=5)
    assert not any(rec.save_due(r) for r in range(5))


def test_a_rollouts_metrics_go_to_the_table_the_reporter_the_log_and_the_result(tmp_path):
    rec, rep = _recorder(tmp_path)
    rec.extra_metrics = lambda: {"rollout/engine_restarts": 1.0}
    rec.parts.interval_s = 60.0
    result = RunResult("r", 0, -1, 0, None)
    metrics = {"train/loss": 0.5, "train/step": 3.0}
    rec.finish_rollout(result, 0, metrics, t0=0.0, version=1)
    assert list(metrics)[-2:] == ["perf/rollout_total_time", "rollout/engine_restarts"]
    # buffered: a part file a second (store/tables.BufferedParts); a flush puts them on disk now
    assert read_rows(rec.paths, "metrics", "r") == []
    rec.flush()
    rows = read_rows(rec.paths, "metrics", "r")
    assert [(r["rollout_id"], r["step"], r["name"]) for r in rows][:2] == [
        (0, 3, "train/loss"),
        (0, 3, "train/step"),
    ]
    assert rep.rollouts == [0] and rep.lines == ["rollout 0: train/loss=0.5"]
    assert (result.last_rollout_id, result.final_version, result.metrics) == (0, 1, [metrics])


def test_each_version_carries_the_runs_config_hash_computed_once(tmp_path, monkeypatch):
    """The config hash (a deep copy and JSON of every flag, ~3 ms) is the run's: hashed at its first
    version, not again at each."""
    import torch
    from safetensors.torch import save_file

    from miles_platform.store.shards import ShardInfo

    rec, _ = _recorder(tmp_path)
    calls = []
    real = RunConfig.config_hash
    monkeypatch.setattr(RunConfig, "config_hash", lambda self: calls.append(1) or real(self))
    result = RunResult("r", 0, -1, 0, None)
    for v in (1, 2, 3):
        hf = tmp_path / f"hf{v}"
        hf.mkdir()
        (hf / "config.json").write_text("{}")
        save_file({"w": torch.full((2,), float(v))}, str(hf / "model.safetensors"))
        shard = ShardInfo(path=str(tmp_path / f"s{v}.parquet"), rows=1, bytes=1, mean_reward=0.5)
        rec.record(result, v, v - 1, v - 1, shard, str(hf), None)
    rec.close()  # the rows to disk
    rows = read_rows(rec.paths, "policy_versions", "r")
    assert [r["config_hash"] for r in rows] == [real(rec.cfg)] * 3 and len(calls) == 1
    assert len({r["content_hash"] for r in rows}) == 3
