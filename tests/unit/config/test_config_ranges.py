"""Every numeric flag is range-checked in RunConfig.validate (before Ray, before any write), with
the flag named: the late or silent failures of issue 19 now fail in validation."""

import pytest

from miles_platform.config import ConfigError, RunConfig, parse_run_config

BAD = [
    ("--micro-batch-size", "0"),
    ("--micro-batch-size", "-1"),
    ("--update-weights-interval", "0"),
    ("--rollout-temperature", "-1"),
    ("--rollout-temperature", "nan"),
    ("--rollout-top-p", "2"),
    ("--rollout-top-k", "0"),
    ("--lr", "nan"),
    ("--lr", "inf"),
    ("--num-rollout", "-3"),
    ("--save-interval", "-1"),
    ("--n-samples-per-prompt", "0"),
    ("--clip-grad", "0"),
    ("--adam-beta2", "1"),
    ("--gamma", "1.5"),
    ("--eval-top-p", "0"),
    ("--tis-lower-bound", "3"),
    ("--pause-wait-timeout-s", "0"),
    ("--pause-wait-timeout-s", "nan"),
    ("--pause-max-queued-requests", "0"),
]


@pytest.mark.parametrize("flag,value", BAD, ids=[f"{f}={v}" for f, v in BAD])
def test_out_of_range_flags_are_refused_naming_the_flag(flag, value):
    with pytest.raises(ConfigError, match=flag):
        parse_run_config(["--rollout-batch-size", "2", flag, value]).validate()


def test_defaults_and_edge_values_pass():
    RunConfig(rollout_batch_size=2).validate()
    RunConfig(rollout_batch_size=2, num_rollout=0, lr=0.0, rollout_top_p=1.0, gamma=1.0, eval_temperature=0.0,
              rollout_top_k=1, use_tis=True, tis_lower_bound=2.0, tis_upper_bound=2.0).validate()  # fmt: skip


def test_yaml_errors_name_the_file_and_key(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("lr: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"--config {f}: not valid YAML"):
        parse_run_config(["--config", str(f)])
    f.write_text("rollout-batch-size: 2\nlr: fast\n")
    with pytest.raises(ConfigError, match=rf"--config {f}: lr: expected a number, got 'fast'"):
        parse_run_config(["--config", str(f)])
    f.write_text("rollout_batch_size: 2.5\n")
    with pytest.raises(ConfigError, match="rollout_batch_size: expected an integer"):
        parse_run_config(["--config", str(f)])
    f.write_text("rollout_batch_size: 2\nci_test: 'yes'\nlr: 1\n")
    with pytest.raises(ConfigError, match="ci_test: expected true/false"):
        parse_run_config(["--config", str(f)])
    f.write_text("rollout_batch_size: 2\nci_test: true\nlr: 1\n")
    assert parse_run_config(["--config", str(f)]).lr == 1


def test_choices_hold_outside_argparse_too():
    with pytest.raises(ConfigError, match="--advantage-estimator 'grpoo': must be one of"):
        RunConfig(rollout_batch_size=2, advantage_estimator="grpoo").validate()
    with pytest.raises(ConfigError, match="--train-forward-dtype 'fp64': must be one of fp32"):
        RunConfig(rollout_batch_size=2, rollout_dtype="fp64", train_forward_dtype="fp64").validate()


def test_the_pause_bounds_reach_the_embedded_engines_and_only_them():
    from miles_platform.rollout import engine_core
    from miles_platform.rollout.engine_fleet import _embedded_kwargs

    cfg = RunConfig(rollout_batch_size=2).validate()  # the same defaults as the engine's own
    assert (cfg.pause_wait_timeout_s, cfg.pause_max_queued_requests) == (
        engine_core.DEFAULT_PAUSE_WAIT_TIMEOUT_S, engine_core.DEFAULT_PAUSE_MAX_QUEUED_REQUESTS)  # fmt: skip
    kw = _embedded_kwargs(
        RunConfig(rollout_batch_size=2, hf_checkpoint="/m/ckpt", pause_wait_timeout_s=5.0).validate()
    )
    assert kw["pause_wait_timeout_s"] == 5.0 and kw["pause_max_queued_requests"] == 16384
    with pytest.raises(ConfigError, match="--pause-wait-timeout-s: bounds of the embedded engine's pause"):
        RunConfig(rollout_batch_size=2, rollout_engine="sglang", pause_wait_timeout_s=5.0).validate()


@pytest.mark.parametrize("name", ["../../x", "a/b", "", ".hidden", "..", "a=b", "x" * 129, "run name", "-x"])
def test_run_names_that_are_not_names_are_refused(name):
    # `../../x` wrote outside the storage root; `a/b` trained but never showed in queries
    with pytest.raises(ConfigError, match="--run-name"):
        RunConfig(rollout_batch_size=2, run_name=name).validate()
    from miles_platform.diffusion.config import DiffusionRunConfig

    with pytest.raises(ConfigError, match="--run-name"):
        DiffusionRunConfig(run_name=name).validate()


@pytest.mark.parametrize("name", ["run", "demo-1.v2", "tool_s1", "A" * 128])
def test_ordinary_run_names_pass(name):
    RunConfig(rollout_batch_size=2, run_name=name).validate()


@pytest.mark.parametrize("name", ["seed", "rollout_seed"])
@pytest.mark.parametrize("value", [2**70, -1, 1.5, True])
def test_seeds_every_rng_takes(name, value):
    # --seed 2^70 passed validation and failed in every trainer rank (numpy takes < 2^32)
    with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')}"):
        RunConfig(rollout_batch_size=2, **{name: value}).validate()
    from miles_platform.diffusion.config import DiffusionRunConfig

    with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')}"):
        DiffusionRunConfig(**{name: value}).validate()


def test_a_null_for_a_flag_with_choices_and_a_default_is_refused_by_name():
    """`advantage_estimator: null` (YAML, Dagster or Python) raised AttributeError from a later
    check: the choices check skipped None. Now it names the flag and its choices."""
    from miles_platform.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match="--advantage-estimator None: must be one of grpo"):
        RunConfig(advantage_estimator=None, rollout_batch_size=2, n_samples_per_prompt=2).validate()
