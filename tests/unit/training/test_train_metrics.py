"""The trainer's Miles metrics on a real TrainerActor: rollout/log_probs, ref_log_probs,
rollout_log_probs, advantages and entropy (per-sample masked means, from the pass before the step,
fused into the training forward or not), --observe-training-entropy (logged, out of the backward),
perf/train_wait_time, and --use-pytorch-profiler's trace of the named rollouts."""

from __future__ import annotations

import gzip
import json
import time

import pytest
import torch
from loop_helpers import random_train_batch

from miles_platform.config import RunConfig
from miles_platform.training.actor import TrainerActor


def _cfg(ckpt, **kw) -> RunConfig:
    base = dict(hf_checkpoint=ckpt, rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4,
                micro_batch_size=2, lr=1e-3)  # fmt: skip
    return RunConfig(**{**base, **kw}).validate()


def _sample_mean(per_sample: list[torch.Tensor]) -> float:
    return float(sum(float(t.float().mean()) for t in per_sample) / len(per_sample))


def _batch():
    return random_train_batch(0, rewards=[1.0, 0.0, 0.0, 1.0])


def test_rollout_metrics_are_the_trainer_pass_before_the_step(tiny_hf_checkpoint):
    """Fused (one step: the training forward scores the old policy) and separate (two steps) passes
    give the same rollout/* numbers, equal to an independent scoring of the untouched weights; the
    reference (the same weights) logs the same log-probs."""
    batch = _batch()
    independent = TrainerActor(_cfg(tiny_hf_checkpoint)).compute_log_probs(batch)
    want = _sample_mean([torch.tensor(x) for x in independent])
    fused = TrainerActor(_cfg(tiny_hf_checkpoint, use_kl_loss=True))
    assert fused._old_log_probs_from_training_forward()
    m1 = fused.train(0, _batch())
    separate = TrainerActor(_cfg(tiny_hf_checkpoint, use_kl_loss=True, global_batch_size=2))
    assert not separate._old_log_probs_from_training_forward()
    m2 = separate.train(0, _batch())
    for m in (m1, m2):
        assert m["rollout/log_probs"] == pytest.approx(want, abs=1e-5)
        assert m["rollout/ref_log_probs"] == pytest.approx(want, abs=1e-5)
        assert m["rollout/rollout_log_probs"] == 0.0  # the batch's engine log-probs
        assert "rollout/advantages" in m and "rollout/returns" in m
    assert 0 < m1["rollout/entropy"] == pytest.approx(m2["rollout/entropy"], rel=1e-5)


def test_observe_training_entropy_logs_it_without_changing_the_step(tiny_hf_checkpoint):
    plain = TrainerActor(_cfg(tiny_hf_checkpoint))
    observed = TrainerActor(_cfg(tiny_hf_checkpoint, observe_training_entropy=True))
    a, b = plain.train(0, _batch()), observed.train(0, _batch())
    assert a["train/entropy_loss"] == 0.0  # not computed
    assert b["train/entropy_loss"] == pytest.approx(a["rollout/entropy"], rel=0.05)  # token vs sample mean
    for (name, p), (_, q) in zip(
        plain.backend.named_parameters(), observed.backend.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name  # detached: the same step


def test_train_wait_time_is_the_time_between_train_calls(tiny_hf_checkpoint):
    actor = TrainerActor(_cfg(tiny_hf_checkpoint))
    actor.train(0, _batch())
    time.sleep(0.3)
    m = actor.train(1, _batch())
    assert 0.3 <= m["perf/train_wait_time"] < 5
    assert m["perf/step_time"] == pytest.approx(m["perf/train_wait_time"] + m["perf/train_time"])
    assert m["perf/wait_time_ratio"] == pytest.approx(m["perf/train_wait_time"] / m["perf/step_time"])


def test_pytorch_profiler_writes_the_trace_of_the_named_rollouts(tiny_hf_checkpoint, tmp_path):
    """--profile-step-start 1 --profile-step-end 2: rollout 0 warms the profiler up, rollout 1 is recorded;
    the trace appears when rollout 1's train call ends, not before."""
    cfg = _cfg(tiny_hf_checkpoint, use_pytorch_profiler=True, profile_step_start=1, profile_step_end=2,
               tensorboard_dir=str(tmp_path / "tb"))  # fmt: skip
    actor = TrainerActor(cfg)
    actor.train(0, _batch())
    assert not list((tmp_path / "tb").glob("*.pt.trace.json.gz"))
    actor.train(1, _batch())
    (trace,) = (tmp_path / "tb").glob("train_overall_rank_0.*.pt.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)
    actor.train(2, _batch())  # the window is closed: no second trace
    assert len(list((tmp_path / "tb").glob("*.pt.trace.json.gz"))) == 1


def test_loop_profilers_trace_micro_batches(tiny_hf_checkpoint, tmp_path):
    """--profile-target train_actor train_log_probs (Miles' per-loop profilers): steps are micro-batches,
    a trace per optimizer step (forward and backward) and per log-prob pass (forward only)."""
    tb = tmp_path / "tb"
    cfg = _cfg(tiny_hf_checkpoint, global_batch_size=2, micro_batch_size=1, use_pytorch_profiler=True,
               profile_step_start=1, profile_step_end=2, profile_target=["train_actor", "train_log_probs"],
               tensorboard_dir=str(tb))  # fmt: skip
    TrainerActor(cfg).train(0, _batch())  # two optimizer steps of two micro-batches, one log-prob pass

    def names(prefix):
        files = sorted(tb.glob(f"{prefix}_rank_0.*.pt.trace.json.gz"))
        return files, [
            {e.get("name", "") for e in json.loads(gzip.decompress(f.read_bytes()))["traceEvents"]}
            for f in files
        ]

    actor_files, actor = names("train_actor")
    lp_files, lp = names("train_log_probs")
    assert len(actor_files) == 2 and len(lp_files) == 1
    assert all(any("Backward" in n for n in ev) for ev in actor)
    assert not any("Backward" in n for n in lp[0]) and any(n.startswith("aten::") for n in lp[0])
    assert not list(tb.glob("train_overall*"))


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--profile-step-start", "3"], "settings of --use-pytorch-profiler; add it"),
        (["--use-pytorch-profiler", "--profile-target", "train_actor", "--train-backend", "megatron"], "fsdp only"),
        (["--use-pytorch-profiler", "--profile-target", "train_log_probs", "--num-rollout", "20"], "2 per loop here"),
        (["--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "2"], "must be > --profile-step-start"),
        (["--use-pytorch-profiler", "--num-rollout", "5"], "--profile-step-end 12: the train_overall trace is written when rollout 11"),
        (["--use-pytorch-profiler", "--storage-root", "s3://b/root"], "writes its traces to a local dir"),
        (["--observe-training-entropy", "--entropy-coef", "0.01"], "logged already"),
        (["--use-rollout-entropy"], "fsdp backend scores rollout/entropy with every log-prob pass"),
        (["--record-memory-history"], "memory-history snapshots .* are not built"),
        (["--memory-snapshot-num-steps", "3"], "memory-history snapshots .* are not built"),
    ],
)  # fmt: skip
def test_metric_and_profiler_flags_are_refused_where_they_do_nothing(argv, needle):
    from miles_platform.config import ConfigError, parse_run_config

    with pytest.raises(ConfigError, match=needle):
        parse_run_config(["--rollout-batch-size", "2", *argv])


def test_an_observed_entropy_is_computed_outside_autograd():
    """At --entropy-coef 0 the entropy is a metric: no graph (no [..., V] tensor kept for backward)."""
    from miles_platform.training.loss import token_log_probs

    z = torch.randn(2, 3, 7, requires_grad=True)
    t, support = torch.randint(0, 7, (2, 3)), torch.tensor([[[0, 1, -1]] * 3] * 2)
    for sup in (None, support):
        lp, observed = token_log_probs(z, t, 1.0, sup, with_entropy=True, entropy_grad=False)
        _, trained = token_log_probs(z, t, 1.0, sup, with_entropy=True)
        assert lp.requires_grad and not observed.requires_grad and trained.requires_grad
        assert torch.equal(observed, trained.detach())
