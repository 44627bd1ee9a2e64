"""Experiment trackers (issue 24): a real run logs its per-rollout metrics to an offline wandb run and
to TensorBoard, read back with each tool's own format; Miles' custom log functions are called per
rollout / eval with the documented arguments, and returning True takes over the default logging."""

import json
import struct
from pathlib import Path

import pytest
from loop_helpers import small_run_config, write_prompts

from miles_platform.config import ConfigError, RunConfig
from miles_platform.loop import Reporter, train, validate_before_start

wandb_pb = pytest.importorskip(
    "wandb.proto.wandb_internal_pb2", reason="the `trackers` extra is not installed"
)
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def wandb_records(path: Path):
    """The records of an offline run's `.wandb` file: wandb's LevelDB-style log (a 7-byte `:W&B`
    header, 32 KiB blocks of [crc32 u32, length u16, type u8] chunks) of `Record` protobufs."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer padding
            pos += 32768 - pos % 32768
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if n == 0 and kind == 0:
            pos += 32768 - pos % 32768
            continue
        buf, pos = buf + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # FULL or LAST chunk
            rec = wandb_pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def wandb_run(wandb_dir: Path, wait_s: float = 20.0) -> dict:
    """The parsed offline run, once its file holds the run and exit records: wandb-core writes
    the file from its own process, and under load (a full `make test`) a read right after
    `finish()` once found no `run` record yet."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        out = _wandb_run_once(wandb_dir)
        if ("run" in out and out["exit_code"] is not None) or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def _wandb_run_once(wandb_dir: Path) -> dict:
    (path,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    out = {"bytes": path.read_bytes(), "history": [], "config": {}, "exit_code": None}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["run"] = r.run
            out["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})  # fmt: skip
        elif kind == "exit":
            out["exit_code"] = r.exit.exit_code
    return out


def tensorboard_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(log_dir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


class _Lines(Reporter):
    def __init__(self):
        self.lines = []

    def log(self, msg: str) -> None:
        self.lines.append(msg)


def test_run_logs_to_wandb_offline_and_tensorboard_and_calls_custom_log_functions(
    tiny_hf_checkpoint, tmp_path
):
    evals = tmp_path / "eval"
    evals.mkdir()
    cfg = small_run_config(
        tiny_hf_checkpoint, tmp_path, eval_prompt_data=["heldout", write_prompts(evals, 2)], eval_interval=1,
        use_wandb=True, wandb_mode="offline", wandb_dir=str(tmp_path / "wb"), wandb_project="miles-test",
        wandb_group="grp", wandb_run_id="tracked1", disable_wandb_random_suffix=True, use_tensorboard=True,
        custom_rollout_log_function_path="loop_helpers.record_rollout_log",
        custom_eval_rollout_log_function_path="loop_helpers.record_eval_log",
    )  # fmt: skip
    rep = _Lines()
    res = train(cfg, rep)
    root = Path(cfg.storage_root)

    # the custom rollout log function: once per rollout, Miles' arguments
    calls = [json.loads(line) for line in (root / "rollout_log_calls.jsonl").read_text().splitlines()]
    assert [c["rollout_id"] for c in calls] == [0, 1]
    for c in calls:
        assert c["args"] == "RunConfig" and c["run"] == "t" and c["samples"] == ["Sample"] * 4
        assert "rollout/raw_reward" in c["metrics"] and c["rollout_time"] == c["perf_rollout_time"] > 0
    # the custom eval log function: v0 before training (rollout 0, as Miles) and after each rollout
    ecalls = [json.loads(line) for line in (root / "eval_log_calls.jsonl").read_text().splitlines()]
    assert [c["rollout_id"] for c in ecalls] == [0, 0, 1]
    for c in ecalls:
        assert list(c["data"]) == ["heldout"] and {"pass@1", "pass@1(T=1)", "mean_reward@1(T=1)"} <= set(
            c["data"]["heldout"]
        )
        assert "eval/heldout/pass@1" in c["metrics"] and c["args"] == "RunConfig"

    # wandb, offline: the run's identity, its config without the secret, and the per-rollout history
    wb = wandb_run(tmp_path / "wb")
    assert (wb["run"].run_id, wb["run"].project, wb["run"].run_group, wb["run"].display_name) == (
        "tracked1", "miles-test", "grp", "grp",
    )  # fmt: skip
    assert wb["config"]["run_name"] == "t" and wb["config"]["use_wandb"] is True
    assert "api_key" not in wb["config"] and cfg.api_key and cfg.api_key.encode() not in wb["bytes"]
    assert wb["exit_code"] == 0
    by_step = {}
    for row in wb["history"]:
        by_step.setdefault(row["rollout/step"], []).append(row)
    assert sorted(by_step) == [0, 1]
    train0 = next(r for r in by_step[0] if "train/loss" in r)
    assert {"rollout/raw_reward", "perf/rollout_time", "perf/actor_train_time", "train/grad_norm"} <= set(
        train0
    )
    assert train0["train/loss"] == pytest.approx(res.metrics[0]["train/loss"])
    assert train0["rollout/custom_reward_x2"] == pytest.approx(2 * res.metrics[0]["rollout/raw_reward"])
    # the eval before training and the one after rollout 0 both stay in the history (step 0)
    assert len([r for r in by_step[0] if "eval/heldout/pass@1" in r]) == 2
    (row1,) = by_step[1]
    # rollout 1: its log functions returned True, so generation and eval metrics are theirs to log;
    # the trainer's rollout/* (Miles' train-side log_rollout_data: log_probs, advantages, ...) stay
    from miles_platform.training.rollout_metrics import TOKEN_FIELDS

    trainer_side = {"rollout/step", *(f"rollout/{f}" for f in TOKEN_FIELDS)}
    assert "train/loss" in row1 and "perf/update_weights_time" in row1 and "rollout/log_probs" in row1
    assert not any(k.startswith(("rollout/", "eval/")) and k not in trainer_side for k in row1), row1
    assert "perf/rollout_time" not in row1 and "perf/eval_time" not in row1, row1

    # TensorBoard: the same scalars, step = rollout id
    tb = tensorboard_scalars(str(root / "runs" / "t" / "tensorboard"))
    assert [s for s, _ in tb["train/loss"]] == [0, 1]
    assert tb["train/loss"][1][1] == pytest.approx(res.metrics[1]["train/loss"], rel=1e-6)
    assert [s for s, _ in tb["rollout/raw_reward"]] == [0]
    assert [s for s, _ in tb["eval/heldout/pass@1"]] == [0, 0]
    assert any(t.startswith("perf/") for t in tb)

    # the run's own records keep everything; the stdout lines leave out what was taken over
    assert "rollout/raw_reward" in res.metrics[1] and "eval/heldout/pass@1" in res.metrics[1]
    line0, line1 = (next(m for m in rep.lines if m.startswith(f"rollout {i}:")) for i in (0, 1))
    assert "rollout/raw_reward=" in line0 and "rollout/raw_reward=" not in line1 and "train/loss=" in line1
    assert [m.split(":")[0] for m in rep.lines if m.startswith("eval v")] == ["eval v0", "eval v1"]


def test_a_failed_run_closes_its_trackers_as_failed(tiny_hf_checkpoint, tmp_path, monkeypatch):
    """A run that dies after its trackers opened still closes them: wandb records exit code 1."""
    import miles_platform.cluster.ray_cluster as rc

    def boom(cfg):
        raise RuntimeError("placement failed")

    monkeypatch.setattr(rc, "init_ray", lambda cfg: None)
    monkeypatch.setattr(rc, "shutdown_ray", lambda ctx: None)
    monkeypatch.setattr(rc, "create_placement_groups", boom)
    cfg = small_run_config(tiny_hf_checkpoint, tmp_path, use_wandb=True, wandb_mode="offline",
                           wandb_dir=str(tmp_path / "wb"), use_tensorboard=True,
                           tensorboard_dir=str(tmp_path / "tb"))  # fmt: skip
    with pytest.raises(RuntimeError, match="placement failed"):
        train(cfg)
    wb = wandb_run(tmp_path / "wb")
    assert wb["exit_code"] == 1 and wb["run"].run_group.startswith("t_")  # the default random suffix
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (
            {"custom_rollout_log_function_path": "loop_helpers.record_eval_log"},
            "--custom-rollout-log-function-path",
        ),
        (
            {"custom_eval_rollout_log_function_path": "loop_helpers.nope"},
            "--custom-eval-rollout-log-function-path",
        ),
        ({"use_tensorboard": True, "storage_root": "s3://bucket/root"}, "--tensorboard-dir"),
    ],
)
def test_tracker_flags_are_checked_before_anything_starts(tiny_hf_checkpoint, tmp_path, overrides, flag):
    cfg = small_run_config(tiny_hf_checkpoint, tmp_path, **overrides)
    with pytest.raises(ConfigError, match=flag):
        validate_before_start(cfg)


def test_wandb_mode_is_one_of_miles_modes():
    with pytest.raises(ConfigError, match="--wandb-mode 'cloud': must be one of online, offline, disabled"):
        RunConfig.from_dict({"rollout_batch_size": 2, "wandb_mode": "cloud"}).validate()
