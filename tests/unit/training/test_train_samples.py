"""train_samples rows: built from a micro-batch's loss tensors (values the loss computed, clip flags
on a constructed case), which samples are kept, and what a trainer rank writes."""

import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from loop_helpers import random_train_batch

from miles_platform.config import ConfigError, RunConfig, parse_run_config
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths
from miles_platform.store.tables import read_rows
from miles_platform.training import loss as loss_hub
from miles_platform.training.actor import TrainBatch, TrainerActor
from miles_platform.training.train_samples import (
    BYTES_PER_ROW,
    BYTES_PER_TOKEN,
    TrainSamplesTarget,
    kept_positions,
    micro_batch_rows,
)
from miles_platform.weights.transports import decode_state


def _cfg(**kw):
    return RunConfig(**{"rollout_batch_size": 2, "n_samples_per_prompt": 2, **kw}).validate()


def _clip_case():
    """Two samples of 4 tokens, old log-prob 0: ratios 1.5 / 0.5 against advantages +1 / -1, eps 0.2.
    Clipped: ratio 1.5 with A > 0, ratio 0.5 with A < 0; not: the other two. The last token of
    sample 1 is masked (ratio 1, never clipped)."""
    lp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5], [1.5, 0.5, 1.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0], [-1.0, -1.0, 1.0, 1.0]])
    masks = [torch.ones(4), torch.tensor([1.0, 1.0, 1.0, 0.0])]
    batch = {
        "advantages": list(adv),
        "old_log_probs": [torch.zeros(4), torch.zeros(4)],
        "rollout_log_probs": [torch.full((4,), -0.1), torch.full((4,), -0.2)],
        "ref_log_probs": [torch.full((4,), -0.3), torch.full((4,), -0.4)],
        "loss_masks": masks,
        "response_lengths": [4, 4],
    }
    log_probs = [lp[0].clone().requires_grad_(), lp[1].clone().requires_grad_()]
    return batch, log_probs


def _keys(n, **extra):
    return [{"rollout_id": 3, "index": 10 + j, "version": 4, "step": 7, "micro_batch": 1, "rank": 0, **extra}
            for j in range(n)]  # fmt: skip


def test_rows_hold_what_the_loss_computed_and_which_tokens_it_clipped():
    cfg = _cfg(eps_clip=0.2, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
    batch, log_probs = _clip_case()
    rows = micro_batch_rows(cfg, batch, log_probs, _keys(2))
    assert [r["index"] for r in rows] == [10, 11] and {r["version"] for r in rows} == {4}
    assert rows[0]["clipped"] == [True, False, False, True]
    assert rows[1]["clipped"] == [False, True, True, False]  # the masked token is never clipped
    assert rows[0]["ratio"] == pytest.approx([1.5, 1.5, 0.5, 0.5], rel=1e-6)
    assert rows[1]["ratio"] == pytest.approx([1.5, 0.5, 1.5, 1.0], rel=1e-6)  # 1 at the masked token
    assert rows[1]["loss_mask"] == [1, 1, 1, 0]
    assert rows[0]["advantage"] == [1.0, -1.0, 1.0, -1.0]
    assert rows[0]["log_probs"] == pytest.approx(log_probs[0].tolist())
    assert rows[1]["rollout_log_probs"] == pytest.approx([-0.2] * 4)
    # the loss's own numbers from the same tensors: its clip fraction is the rows' flags reduced its
    # way, its KL loss the rows' ref_kl reduced its way
    _, m = loss_hub.policy_loss_function(cfg, batch, log_probs)
    masks = batch["loss_masks"]
    per_sample = [
        sum(c * w for c, w in zip(r["clipped"], mk.tolist())) / mk.sum().item() for r, mk in zip(rows, masks)
    ]
    assert float(m["pg_clipfrac"]) == pytest.approx(sum(per_sample) / 2)
    kl = [
        sum(k * w for k, w in zip(r["ref_kl"], mk.tolist())) / mk.sum().item() for r, mk in zip(rows, masks)
    ]
    assert float(m["kl_loss"]) == pytest.approx(sum(kl) / 2, rel=1e-6)
    assert rows[1]["ref_kl"][3] == 0.0  # masked


def test_rows_only_for_given_keys_and_nulls_where_a_column_does_not_apply():
    batch, log_probs = _clip_case()
    batch["ref_log_probs"] = None
    batch["rollout_log_probs"][0] = torch.zeros(0)  # none recorded
    rows = micro_batch_rows(_cfg(), batch, log_probs, [None, *_keys(1)])
    assert len(rows) == 1 and rows[0]["index"] == 10 and rows[0]["ref_kl"] is None
    row0 = micro_batch_rows(_cfg(), batch, log_probs, _keys(1) + [None])[0]
    assert row0["rollout_log_probs"] is None and row0["ratio"] is not None
    sft = micro_batch_rows(_cfg(loss_type="sft_loss"), batch, log_probs, _keys(2))
    assert sft[0]["ratio"] is None and sft[0]["clipped"] is None and sft[0]["log_probs"] is not None
    # gspo: one sequence-level ratio per sample, shared by its tokens
    gspo = micro_batch_rows(_cfg(advantage_estimator="gspo"), batch, log_probs, _keys(2))
    assert len(set(gspo[0]["ratio"])) == 1
    assert gspo[0]["ratio"][0] == pytest.approx(math.exp(sum(math.log(x) for x in (1.5, 1.5, 0.5, 0.5)) / 4))


def test_which_samples_are_kept():
    batch = random_train_batch(0)  # 4 samples, responses of 2..5 tokens
    assert kept_positions("all", batch, 2) == range(4) and kept_positions("none", batch, 2) == range(0)
    assert kept_positions("3", batch, 2) == range(3) and kept_positions(9, batch, 2) == range(4)
    assert kept_positions("auto", batch, 2) == range(4)
    # auto: whole groups while the estimate stays under the budget, at least one group
    long = TrainBatch([[1] * 30_000] * 6, [27_000] * 6, [[1]] * 6, [0.0] * 6, [[0.0]] * 6)
    per_row = BYTES_PER_ROW + BYTES_PER_TOKEN * 27_000
    assert 2 * per_row < 4 << 20 < 3 * per_row
    assert kept_positions("auto", long, 2) == range(2) and kept_positions("auto", long, 3) == range(3)
    for bad in ("some", "-1", "1.5"):
        with pytest.raises(ConfigError, match="--save-train-samples"):
            _cfg(save_train_samples=bad)


def test_save_debug_train_data_template():
    base = ["--rollout-batch-size", "2"]
    assert parse_run_config(base + ["--save-debug-train-data", "/tmp/t_{rollout_id}.parquet"])
    two = base + ["--actor-num-gpus-per-node", "2"]
    assert parse_run_config(two + ["--save-debug-train-data", "/tmp/t_{rollout_id}_{rank}.parquet"])
    with pytest.raises(ConfigError, match=r"must contain \{rank\}"):
        parse_run_config(two + ["--save-debug-train-data", "/tmp/t_{rollout_id}.parquet"])
    with pytest.raises(ConfigError, match="--save-debug-train-data"):
        parse_run_config(base + ["--save-debug-train-data", "/tmp/t_{step}_{rollout_id}.parquet"])


def test_a_trainer_rank_writes_its_rows_and_the_debug_file(tiny_hf_checkpoint, tmp_path):
    root, dump = tmp_path / "root", str(tmp_path / "dump" / "train_{rollout_id}_{rank}.parquet")
    cfg = RunConfig(hf_checkpoint=tiny_hf_checkpoint, rollout_batch_size=2, n_samples_per_prompt=2,
                    global_batch_size=2, micro_batch_size=1, storage_root=str(root), run_name="u",
                    save_train_samples="3", save_debug_train_data=dump).validate()  # fmt: skip
    actor = TrainerActor(cfg)
    batch = random_train_batch(0, rewards=[1.0, 0.0, 0.0, 1.0])
    batch.sample_indices = [20, 21, 22, 23]
    before = actor.compute_log_probs(batch)
    actor.train(5, batch, TrainSamplesTarget(version=9))
    rows = sorted(read_rows(StoragePaths(str(root)), "train_samples", "u"), key=lambda r: r["index"])
    # the first 3 samples; 2 optimizer steps of 2 samples, one per micro-batch
    assert [(r["index"], r["step"], r["micro_batch"]) for r in rows] == [(20, 0, 0), (21, 0, 1), (22, 1, 0)]
    assert {(r["rollout_id"], r["version"], r["rank"]) for r in rows} == {(5, 9, 0)}
    # step 0 ran on the weights that scored `before`; grpo: +-1 / (std + 1e-6) for each group of 2
    assert rows[0]["log_probs"] == pytest.approx(before[0], abs=1e-5)
    assert rows[0]["advantage"] == pytest.approx([0.5 / (math.sqrt(0.5) + 1e-6)] * 2)
    assert rows[1]["advantage"][0] < 0 and rows[2]["advantage"][0] < 0
    assert [len(r["ratio"]) for r in rows] == batch.response_lengths[:3]
    assert pq.read_table(dump.format(rollout_id=5, rank=0)).num_rows == 4  # every sample, not only the kept
    cols, got = Catalog(StoragePaths(str(root))).query(
        "select index, status, len(log_probs) from train_samples order by index"
    )
    assert got == [(20, "committed", 2), (21, "committed", 3), (22, "committed", 4)]
    # without a target (a library call) nothing goes to the table
    actor.train(6, batch)
    assert len(read_rows(StoragePaths(str(root)), "train_samples", "u")) == 3


def test_train_with_weights_returns_the_trained_policy(tiny_hf_checkpoint):
    """train-async's pipeline queues rollout k+1's train behind k's, so k's weights come back with its
    train call: the policy after the step (not before it, not a view the next step would move)."""
    cfg = RunConfig(hf_checkpoint=tiny_hf_checkpoint, rollout_batch_size=2, n_samples_per_prompt=2,
                    global_batch_size=4, lr=1e-2).validate()  # fmt: skip
    actor = TrainerActor(cfg)
    before = {k: v.clone() for k, v in actor.get_hf_weights().items()}
    metrics, raw = actor.train(0, random_train_batch(0, rewards=[1.0, 0.0, 0.0, 1.0]), None, True)
    weights = decode_state(raw)  # raw bytes, as Ray moves them best (weights/transports encode_state)
    assert "train/loss" in metrics and metrics["perf/get_weights_time"] >= 0
    after = actor.get_hf_weights()
    assert weights.keys() == after.keys() == before.keys()
    assert all(torch.equal(weights[k], after[k]) for k in after)
    assert any(not torch.equal(weights[k], before[k]) for k in before)  # the step moved them
    kept = {k: v.clone() for k, v in weights.items()}
    actor.train(1, random_train_batch(1, rewards=[0.0, 1.0, 1.0, 0.0]))
    moved = actor.get_hf_weights()
    assert any(not torch.equal(moved[k], kept[k]) for k in kept)
    # what the driver holds is a copy: the next step leaves it as it was
    assert all(torch.equal(weights[k], kept[k]) for k in kept), "returned weights alias the live parameters"


def test_the_loops_rows_are_written_beside_the_next_step(tiny_hf_checkpoint, tmp_path, monkeypatch):
    """`background` (the loop's target): the rows are made and written on the rank's writer thread,
    not in `train`, a part file a second at most (store/tables.BufferedParts), not one per call;
    they are in before a save or `drain_rows` returns, and a failed write is raised there, not lost."""
    import threading

    from miles_platform.store import tables

    root = tmp_path / "root"
    cfg = RunConfig(hf_checkpoint=tiny_hf_checkpoint, rollout_batch_size=2, n_samples_per_prompt=2,
                    global_batch_size=4, storage_root=str(root), run_name="u",
                    save=str(tmp_path / "ckpt")).validate()  # fmt: skip
    actor = TrainerActor(cfg)
    writers, real = [], tables._write_part

    def write_part(paths, table, run, rows):
        writers.append((threading.current_thread().name, len(rows)))
        return real(paths, table, run, rows)

    monkeypatch.setattr(tables, "_write_part", write_part)
    monkeypatch.setattr(tables, "PART_INTERVAL_S", 60.0)
    actor.train(0, random_train_batch(0), TrainSamplesTarget(version=1, background=True))
    actor.train(1, random_train_batch(1), TrainSamplesTarget(version=2, background=True))
    assert read_rows(StoragePaths(str(root)), "train_samples", "u") == []  # held on the thread
    actor.drain_rows()
    rows = read_rows(StoragePaths(str(root)), "train_samples", "u")
    assert sorted({(r["rollout_id"], r["version"]) for r in rows}) == [(0, 1), (1, 2)] and len(rows) == 8
    assert writers == [("train-samples", 8)]  # one part for both calls, never on the caller's thread

    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tables, "_write_part", full)
    actor.train(2, random_train_batch(2), TrainSamplesTarget(version=3, background=True))  # returns
    with pytest.raises(OSError, match="No space left"):
        actor.save(2)  # the checkpoint would say rollout 2 is done: its rows must be in first
    monkeypatch.setattr(tables, "_write_part", write_part)
    actor.train(3, random_train_batch(3), TrainSamplesTarget(version=4, background=True))
    actor.save(3)  # drained first: rollout 3's rows are in
    assert {r["rollout_id"] for r in read_rows(StoragePaths(str(root)), "train_samples", "u")} == {0, 1, 3}


def test_a_killed_row_writers_part_is_removed_by_the_next_launch(tmp_path):
    """A trainer killed while its RowWriter wrote (kill -9 of the run at a hook of the loop's) leaves
    its hidden temp part in the run's train_samples partition: the next launch, under the run lock,
    removes it; another run's, and another table's (an eval asset writes evals outside the lock), stay."""
    from miles_platform.run_lifecycle import remove_dead_writers_tmp

    paths = StoragePaths(str(tmp_path / "root"))
    cfg = RunConfig(rollout_batch_size=1, run_name="u", storage_root=paths.root).validate()
    mine = Path(paths.table_dir("train_samples", "u"))
    other = Path(paths.table_dir("train_samples", "v"))
    evals = Path(paths.table_dir("evals", "u"))
    for d in (mine, other, evals):
        d.mkdir(parents=True)
        (d / ".part-00000000000000000001-abcdef12.parquet.tmp-0123456789ab").write_bytes(b"half")
    (mine / "part-00000000000000000000-abcdef12.parquet").write_bytes(b"whole")
    logged = []
    remove_dead_writers_tmp(cfg, paths, logged.append)
    assert sorted(p.name for p in mine.iterdir()) == ["part-00000000000000000000-abcdef12.parquet"]
    assert len(list(other.iterdir())) == 1 and len(list(evals.iterdir())) == 1 and len(logged) == 1
