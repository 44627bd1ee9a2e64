"""--loss-type score_centering: Miles' recipe parses; every combination it cannot train is refused
at validation (before Ray starts), naming the flag and what to do."""

from __future__ import annotations

import pytest

from miles_platform.config import ConfigError, parse_run_config

RECIPE = ["--rollout-batch-size", "2", "--loss-type", "score_centering", "--advantage-estimator", "grpo",
          "--rollout-top-logprobs-num", "128", "--score-centering-is", "none", "--rollout-temperature", "1.0",
          "--rollout-top-p", "1.0", "--rollout-top-k", "-1", "--use-rollout-logprobs",
          "--disable-grpo-std-normalization", "--calculate-per-token-loss"]  # fmt: skip


def _without(argv: list[str], flag: str, takes_value: bool = True) -> list[str]:
    i = argv.index(flag)
    return argv[:i] + argv[i + 1 + takes_value :]


def test_the_docs_recipe_parses_with_miles_defaults():
    cfg = parse_run_config(RECIPE)
    assert (cfg.loss_type, cfg.rollout_top_logprobs_num, cfg.score_centering_is) == (
        "score_centering",
        128,
        "none",
    )
    assert (cfg.score_centering_tis_clip, cfg.score_centering_mis_low, cfg.score_centering_mis_high) == (
        2.0,
        0.5,
        5.0,
    )
    filtered = parse_run_config([*RECIPE, "--rollout-top-k", "64", "--rollout-top-p", "0.9", "--score-centering-is", "mis"])  # fmt: skip
    assert filtered.sampling_support_replay() and filtered.score_centering_is == "mis"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (_without(RECIPE, "--rollout-top-logprobs-num"), "needs --rollout-top-logprobs-num K > 0"),
        ([*RECIPE, "--rollout-top-logprobs-num", "0"], "needs --rollout-top-logprobs-num K > 0"),
        (_without(RECIPE, "--use-rollout-logprobs", False), "needs --use-rollout-logprobs"),
        ([*RECIPE, "--advantage-estimator", "gspo"], "--advantage-estimator gspo: the initial advantage"),
        ([*RECIPE, "--advantage-estimator", "reinforce_plus_plus"], "--advantage-estimator reinforce_plus_plus"),
        ([*RECIPE, "--use-opd", "--opd-type", "sglang", "--rm-url", "http://h/generate"], "--use-opd with"),
        ([*RECIPE, "--use-tis"], "--use-tis with --loss-type score_centering: use --score-centering-is"),
        ([*RECIPE, "--use-session-server"], "--use-session-server with --loss-type score_centering"),
        ([*RECIPE, "--rollout-top-k", "256"], "--rollout-top-logprobs-num 128 < --rollout-top-k 256"),
        ([*RECIPE, "--rollout-temperature", "0"], "--rollout-temperature 0.0"),
        ([*RECIPE, "--score-centering-tis-clip", "0"], "--score-centering-tis-clip 0.0: must be > 0"),
        ([*RECIPE, "--score-centering-mis-low", "6"], "--score-centering-mis-low 6.0 / --score-centering-mis-high"),
        ([*RECIPE, "--score-centering-is", "ppo"], "--score-centering-is"),
        # the flags mean nothing to another loss: refused, never silently ignored
        (["--rollout-batch-size", "2", "--rollout-top-logprobs-num", "8"], "--rollout-top-logprobs-num: score centering flags"),
        (["--rollout-batch-size", "2", "--score-centering-is", "tis"], "--score-centering-is: score centering flags"),
    ],
)  # fmt: skip
def test_what_score_centering_cannot_train_is_refused_by_flag(argv, needle):
    with pytest.raises((ConfigError, SystemExit)) as e:
        parse_run_config(argv)
    if e.type is ConfigError:
        assert needle in str(e.value), str(e.value)
    else:  # argparse's choices: an unknown value never gets to validation
        assert needle == "--score-centering-is"
