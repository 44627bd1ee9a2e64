"""Miles' --ci-test checkers (training/ci_checks.py) on a real TrainerActor's step-0 metrics: each one
passes on a sound config and fails on a deliberately broken one, and its --ci-disable-* switch turns it
off; the --ci-metric-checker-* gate fails a run whose evals never reach the threshold."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from loop_helpers import UNTRAINED_ENTROPY_MAX, random_train_batch
from safetensors.torch import load_file, save_file

from miles_platform.config import ConfigError, RunConfig, parse_run_config
from miles_platform.run_types import CITestFailure
from miles_platform.training.actor import TrainerActor
from miles_platform.training.ci_checks import MetricChecker, rollout_checks


def _cfg(ckpt, **kw) -> RunConfig:
    base = dict(hf_checkpoint=ckpt, rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4,
                micro_batch_size=2, lr=1e-3, ci_test=True, ci_entropy_max=UNTRAINED_ENTROPY_MAX)  # fmt: skip
    return RunConfig(**{**base, **kw}).validate()


def _engine_batch(actor):
    """The trainer tests' batch with the rollout log-probs the trainer itself computes (an engine that agrees)."""
    batch = random_train_batch(0, rewards=[1.0, 0.0, 0.0, 1.0])
    batch.rollout_log_probs = actor.compute_log_probs(batch)
    return batch


@pytest.fixture(scope="module")
def perturbed_checkpoint(tiny_hf_checkpoint, tmp_path_factory):
    """The tiny checkpoint with noise on every weight: a reference that is not the actor."""
    out = tmp_path_factory.mktemp("ref") / "perturbed"
    shutil.copytree(tiny_hf_checkpoint, out)
    w = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    save_file(
        {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in w.items()}, out / "model.safetensors"
    )
    return str(out)


def _step0(cfg) -> dict:
    actor = TrainerActor(cfg)
    return actor.train(0, _engine_batch(actor))


def test_kl_and_reference_checkers_fail_when_the_reference_is_not_the_actor(
    tiny_hf_checkpoint, perturbed_checkpoint
):
    kl = dict(use_kl_loss=True, kl_loss_coef=0.1)
    checks = rollout_checks(_cfg(tiny_hf_checkpoint), 0, _step0(_cfg(tiny_hf_checkpoint, **kl)), print)
    assert checks["step0_kl_loss"] < 1e-9 and checks["step0_ref_logprob_abs_diff"] < 1e-8
    assert (
        checks["train_rollout_logprob_abs_diff"] < 1e-5
        and checks["rollout_logprob_abs_diff"] < 1e-6
        and 0 < checks["entropy"] < UNTRAINED_ENTROPY_MAX
    )
    broken = _step0(_cfg(tiny_hf_checkpoint, ref_load=perturbed_checkpoint, **kl))
    assert abs(broken["train/step0_kl_loss"]) > 1e-6
    with pytest.raises(CITestFailure, match=r"train/kl_loss\| at step 0 .*--ci-disable-kl-checker"):
        rollout_checks(_cfg(tiny_hf_checkpoint), 0, broken, print)
    with pytest.raises(
        CITestFailure, match="trainer vs reference mean log-prob .*--ci-disable-logprobs-checker"
    ):
        rollout_checks(_cfg(tiny_hf_checkpoint, ci_disable_kl_checker=True), 0, broken, print)
    off = _cfg(tiny_hf_checkpoint, ci_disable_kl_checker=True, ci_disable_logprobs_checker=True)
    assert rollout_checks(off, 0, broken, print)["step0_kl_loss"] > 1e-6


def test_entropy_and_engine_logprob_checkers(tiny_hf_checkpoint):
    m = _step0(_cfg(tiny_hf_checkpoint))
    # the untrained tiny model is near-uniform: Miles' bound (0, 0.7) fails it
    with pytest.raises(
        CITestFailure, match=r"rollout 0: the trainer's mean entropy .* = \d\.\d+, not in \(0, 0\.7\)"
    ):
        rollout_checks(_cfg(tiny_hf_checkpoint, ci_entropy_max=0.7), 0, m, print)
    assert rollout_checks(
        _cfg(tiny_hf_checkpoint, ci_entropy_max=0.7, ci_disable_logprobs_checker=True), 0, m, print
    )
    # an engine whose log-probs are not the trainer's (all 0): the trainer-vs-engine check
    actor = TrainerActor(_cfg(tiny_hf_checkpoint))
    wrong = actor.train(0, random_train_batch(0, rewards=[1.0, 0.0, 0.0, 1.0]))
    with pytest.raises(CITestFailure, match="rollout 0: trainer vs engine mean log-prob"):
        rollout_checks(_cfg(tiny_hf_checkpoint), 0, wrong, print)
    # and at a later rollout: its first step's KL is recorded, the engine's log-probs are checked again
    later = actor.train(1, random_train_batch(1, rewards=[1.0, 0.0, 0.0, 1.0]))
    assert "train/step0_ppo_kl" in later and "rollout/entropy" in later
    with pytest.raises(CITestFailure, match="--ci-test at rollout 1: trainer vs engine mean log-prob"):
        rollout_checks(_cfg(tiny_hf_checkpoint), 1, later, print)


def test_every_rollout_is_checked_as_miles_log_rollout_data():
    """Miles' log_rollout_data checks the trainer's mean log-prob against the engine's (abs 0.03) and
    the entropy at every rollout, check_kl ppo_kl / pg_clipfrac at each rollout's first step; the
    reference and kl_loss only at rollout 0. The token-level gap is reported, not gated."""
    cfg = RunConfig(rollout_batch_size=2, ci_test=True)
    ok = {"rollout/log_probs": -1.0, "rollout/rollout_log_probs": -1.02, "rollout/ref_log_probs": -0.5,
          "rollout/entropy": 0.3, "train/step0_kl_loss": 0.2, "train/train_rollout_logprob_abs_diff": 0.2}  # fmt: skip
    checks = rollout_checks(cfg, 3, ok, print)
    assert "step0_ref_logprob_abs_diff" not in checks and "step0_kl_loss" not in checks
    assert checks["rollout_logprob_abs_diff"] == pytest.approx(0.02)
    with pytest.raises(CITestFailure, match=r"--ci-test at rollout 0: \|train/kl_loss\|"):
        rollout_checks(cfg, 0, ok, print)
    for bad, needle in [
        (
            {"rollout/rollout_log_probs": -1.05},
            r"rollout 3: trainer vs engine mean log-prob .* by 0\.05 > 0\.03",
        ),
        ({"rollout/entropy": 0.0}, r"rollout 3: the trainer's mean entropy \(rollout/entropy\) = 0, not in"),
        ({"rollout/entropy": 0.8}, r"rollout 3: the trainer's mean entropy .* = 0\.8, not in \(0, 0\.7\)"),
        ({"train/step0_ppo_kl": 5e-9}, r"rollout 3: \|train/ppo_kl\| at step 0 = 5e-09 >= 1e-09"),
        ({"train/step0_pg_clipfrac": 0.1}, r"rollout 3: train/pg_clipfrac at step 0 = 0\.1"),
    ]:
        with pytest.raises(CITestFailure, match=needle):
            rollout_checks(cfg, 3, {**ok, **bad}, print)
    lora = RunConfig(rollout_batch_size=2, ci_test=True, lora_rank=8)
    rollout_checks(lora, 3, {**ok, "train/step0_ppo_kl": 5e-9}, print)  # Miles' LoRA bound: 1e-8
    off = RunConfig(rollout_batch_size=2, ci_test=True, ci_disable_logprobs_checker=True)
    rollout_checks(off, 3, {**ok, "rollout/rollout_log_probs": -2.0, "rollout/entropy": 0.8}, print)


def test_metric_checker_gate():
    cfg = RunConfig(rollout_batch_size=2, ci_test=True, ci_metric_checker_key="eval/d/pass@1",
                    ci_metric_checker_threshold=0.5, eval_prompt_data=["d", "x.jsonl"], eval_interval=1)  # fmt: skip
    low = MetricChecker.maybe_create(cfg)
    low.on_eval({}, print)  # no eval ran this time (a resumed run's v0): nothing to check
    low.on_eval({"eval/d/pass@1": 0.25}, print)
    with pytest.raises(
        CITestFailure, match=r"no eval reached --ci-metric-checker-threshold 0\.5 \(values: \[0\.25\]\)"
    ):
        low.dispose()
    ok = MetricChecker.maybe_create(cfg)
    for v in (0.25, 0.5):
        ok.on_eval({"eval/d/pass@1": v}, print)
    ok.dispose()
    with pytest.raises(CITestFailure, match=r"not among the eval's metrics \['eval/other/pass@1'\]"):
        ok.on_eval({"eval/other/pass@1": 1.0}, print)
    assert MetricChecker.maybe_create(RunConfig(rollout_batch_size=2)) is None


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--ci-disable-kl-checker"], "switches of --ci-test's checks; add --ci-test"),
        (["--ci-test", "--ci-metric-checker-key", "eval/d/pass@1"], "give both"),
        (
            ["--ci-test", "--ci-metric-checker-key", "k", "--ci-metric-checker-threshold", "1"],
            "this run has no eval",
        ),
        (["--load-debug-rollout-data-subsample", "0.5"], "add it"),
    ],
)
def test_ci_flags_are_refused_where_they_do_nothing(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_run_config(["--rollout-batch-size", "2", *argv])


def test_load_debug_rollout_data_subsample_keeps_whole_groups_from_both_ends(tmp_path):
    from miles_platform.data.sample import Sample
    from miles_platform.store.debug_rollouts import load_debug_rollout, save_debug_rollout

    template = str(tmp_path / "r_{rollout_id}.parquet")
    samples = [Sample(prompt=f"p{g}", prompt_tokens=[1], response_tokens=[2], loss_mask=[1], rollout_log_probs=[-1.0],
                      group_index=g, index=2 * g + j, reward=float(g), raw_reward=float(g)) for g in range(8) for j in range(2)]  # fmt: skip
    save_debug_rollout(RunConfig(rollout_batch_size=8, save_debug_rollout_data=template), 3, samples)
    kw = dict(n_samples_per_prompt=2, load_debug_rollout_data=template, load_debug_rollout_data_subsample=0.5)
    got = load_debug_rollout(RunConfig(rollout_batch_size=4, **kw).validate(), 3)
    assert [s.prompt for s in got] == [
        "p0",
        "p0",
        "p1",
        "p1",
        "p6",
        "p6",
        "p7",
        "p7",
    ]  # int(8 * 0.5) = 4 groups
    assert (
        len(
            load_debug_rollout(
                RunConfig(rollout_batch_size=8, **{**kw, "load_debug_rollout_data_subsample": 1.0}), 3
            )
        )
        == 16
    )
    with pytest.raises(
        ConfigError, match="keeps 4 of the 8 prompt groups of rollout 3; set --rollout-batch-size 4"
    ):
        load_debug_rollout(RunConfig(rollout_batch_size=8, **kw), 3)


def test_ci_inject_rollout_data_trains_the_recording_when_generation_matches_it(tmp_path):
    """--ci-inject-rollout-data-path: the recording replaces a rollout whose fresh generation matches it
    (mean response-token match > the ratio); engines holding other weights (half the tokens differ) or a
    batch of other prompts fail the run."""
    import copy

    from miles_platform.data.sample import Sample
    from miles_platform.store.debug_rollouts import inject_rollout, save_debug_rollout

    template = str(tmp_path / "rec_{rollout_id}.parquet")
    rec = [Sample(prompt="p", prompt_tokens=[1, 2], response_tokens=[3, 4, 5, 6], loss_mask=[1] * 4,
                  rollout_log_probs=[-1.0] * 4, index=i, reward=1.0, raw_reward=1.0) for i in range(4)]  # fmt: skip
    save_debug_rollout(RunConfig(rollout_batch_size=2, save_debug_rollout_data=template), 1, rec)
    cfg = RunConfig(rollout_batch_size=2, n_samples_per_prompt=2, run_name="now", ci_inject_rollout_data_path=template,
                    ci_inject_rollout_data_start_rollout_id=1).validate()  # fmt: skip
    fresh = copy.deepcopy(rec)
    fresh[0].response_tokens = [3, 4, 5, 9]  # one flipped token: 15/16 > 0.9
    got, ratio = inject_rollout(cfg, 1, fresh)
    assert ratio == pytest.approx(15 / 16) and [s.response_tokens for s in got] == [[3, 4, 5, 6]] * 4
    assert {(s.run, s.rollout_id) for s in got} == {("now", 1)}
    for s in fresh:
        s.response_tokens = [3, 4, 8, 9]  # half of every response differs
    with pytest.raises(CITestFailure, match=r"match the recording at 0\.5000 .*min-match-ratio 0\.9"):
        inject_rollout(cfg, 1, fresh)
    fresh[2].prompt_tokens = [1, 7]
    with pytest.raises(CITestFailure, match="prompt tokens differ at sample 2"):
        inject_rollout(cfg, 1, fresh)
    with pytest.raises(ConfigError, match="give both"):
        parse_run_config(["--rollout-batch-size", "2", "--ci-inject-rollout-data-path", template])


def test_metric_checker_expect_num_needs_that_many_evals_all_passing():
    cfg = RunConfig(rollout_batch_size=2, ci_test=True, ci_metric_checker_key="eval/d/pass@1", ci_metric_checker_threshold=0.5,
                    ci_metric_checker_expect_num=2, eval_prompt_data=["d", "x.jsonl"], eval_interval=1)  # fmt: skip
    for values, ok in (([0.5, 0.75], True), ([0.25, 0.75], False), ([0.75], False), ([0.5, 0.5, 0.5], False)):
        checker = MetricChecker.maybe_create(cfg)
        for v in values:
            checker.on_eval({"eval/d/pass@1": v}, print)
        if ok:
            checker.dispose()
        else:
            with pytest.raises(CITestFailure, match="--ci-metric-checker-expect-num 2"):
                checker.dispose()


def test_grad_norm_recorded_by_one_run_is_checked_by_the_next(tiny_hf_checkpoint, tmp_path):
    template = str(tmp_path / "gn_{role}_{rollout_id}_{step_id}.pt")
    two_steps = dict(global_batch_size=2, ci_entropy_max=UNTRAINED_ENTROPY_MAX)
    rec = TrainerActor(_cfg(tiny_hf_checkpoint, ci_save_grad_norm=template, **two_steps))
    rec.train(3, random_train_batch(0, rewards=[1.0, 0.0, 0.0, 1.0]))
    assert sorted(p.name for p in tmp_path.glob("gn_*")) == ["gn_actor_3_0.pt", "gn_actor_3_1.pt"]
    assert torch.load(tmp_path / "gn_actor_3_0.pt", weights_only=True) > 0
    same = TrainerActor(_cfg(tiny_hf_checkpoint, ci_load_grad_norm=template, **two_steps))
    same.train(3, random_train_batch(0, rewards=[1.0, 0.0, 0.0, 1.0]))
    other = TrainerActor(_cfg(tiny_hf_checkpoint, ci_load_grad_norm=template, **two_steps))
    with pytest.raises(CITestFailure, match=r"actor grad norm at rollout 3 step 0 = 0, the recording .*says"):
        other.train(3, random_train_batch(0, rewards=[1.0, 1.0, 0.0, 1.0]))  # group 0 all right: no gradient
    with pytest.raises(CITestFailure, match="gn_actor_4_0.pt not found"):
        TrainerActor(_cfg(tiny_hf_checkpoint, ci_load_grad_norm=template, **two_steps)).train(
            4, random_train_batch(0)
        )


def test_model_hashes_saved_with_a_checkpoint_catch_a_changed_layer_on_load(tiny_hf_checkpoint, tmp_path):
    save = str(tmp_path / "ckpt")
    kw = dict(save=save, ci_entropy_max=UNTRAINED_ENTROPY_MAX)
    a = TrainerActor(_cfg(tiny_hf_checkpoint, ci_save_model_hash=True, **kw))
    a.train(0, _engine_batch(a))
    d = a.save(0)
    (hashes,) = [p for p in os.listdir(d) if p.startswith("model_hash")]
    assert hashes == "model_hash_tp0_pp0_dp0_cp0.json"
    layers = json.loads(open(os.path.join(d, hashes)).read())
    assert {"layer_0000", "layer_0001", "non_layer"} <= set(layers)
    TrainerActor(_cfg(tiny_hf_checkpoint, ci_check_model_hash=True, **kw)).load()  # the same weights
    (model,) = [p for p in os.listdir(d) if p.startswith("model") and p.endswith(".safetensors")]
    w = load_file(os.path.join(d, model))
    name = next(k for k in w if ".layers.1." in k)
    w[name] = w[name] + 1e-3
    save_file(w, os.path.join(d, model))
    with pytest.raises(CITestFailure, match=r"mismatched layers \['layer_0001'\], missing \[\], extra \[\]"):
        TrainerActor(_cfg(tiny_hf_checkpoint, ci_check_model_hash=True, **kw)).load()
    with pytest.raises(CITestFailure, match="no checkpoint in"):
        TrainerActor(_cfg(tiny_hf_checkpoint, ci_check_model_hash=True, save=str(tmp_path / "empty"))).load()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--ci-save-model-hash"], "add --ci-test"),
        (["--ci-test", "--ci-save-model-hash"], "add --save"),
        (["--ci-test", "--ci-check-model-hash"], "add --load"),
        (["--ci-test", "--ci-save-grad-norm", "/t/{x}"], r"unknown fields \['x'\]"),
        (["--ci-test", "--ci-save-grad-norm", "/t/a", "--ci-load-grad-norm", "/t/a"], "give one"),
        (["--ci-test", "--ci-metric-checker-expect-num", "2"], "add it"),
        (["--ci-ft-test-actions", "[]"], "trainer cells are not built"),
        (["--ci-test", "--true-on-policy-mode"], "--true-on-policy-mode: bitwise-equal .* not built"),
    ],
)
def test_new_ci_flags_are_refused_where_they_do_nothing(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_run_config(["--rollout-batch-size", "2", *argv])


def test_entropy_checker_reads_miles_rollout_entropy_first():
    cfg = RunConfig(rollout_batch_size=2, ci_test=True)
    with pytest.raises(
        CITestFailure, match=r"rollout 0: the trainer's mean entropy .* = 5, not in \(0, 0\.7\)"
    ):
        rollout_checks(cfg, 0, {"rollout/entropy": 5.0, "train/step0_entropy": 0.5}, print)
    assert (
        rollout_checks(cfg, 0, {"train/step0_entropy": 0.5}, print)["entropy"] == 0.5
    )  # megatron's fallback
    assert "entropy" not in rollout_checks(cfg, 1, {"train/step0_entropy": 5.0}, print)  # rollout 0's only
