"""--log-passrate: Miles' pass@k (k = 1, 2, 4, ... <= the group size; unbiased; a reward of exactly 1
passes) over a rollout's complete prompt groups, checked on hand-computed groups."""

from __future__ import annotations

import pytest

from miles_platform.config import ConfigError, parse_run_config
from miles_platform.data.sample import Sample
from miles_platform.rollout.passrate import compute_pass_rate, rollout_passrate


def test_pass_at_k_of_groups_by_hand():
    # groups of 4 with 1 and 0 correct: pass@1 = (1/4 + 0) / 2, pass@2 = (1 - C(3,2)/C(4,2)) / 2, pass@4 = 1/2
    got = compute_pass_rate([1, 0, 0, 0, 0, 0.5, 0, 0], 4)  # 0.5 is not a pass
    assert got == pytest.approx({"pass@1": 0.125, "pass@2": 0.25, "pass@4": 0.5})
    assert set(compute_pass_rate([1.0] * 6, 6)) == {"pass@1", "pass@2", "pass@4"}  # powers of 2 <= 6
    assert compute_pass_rate([1.0, 0.0], 1) == {}


def test_rollout_passrate_leaves_out_groups_a_filter_thinned():
    rewards = {0: [1.0, 0.0], 1: [1.0, 1.0], 2: [0.0]}  # group 2 lost a sample
    samples = [Sample(group_index=g, raw_reward=r) for g, rs in rewards.items() for r in rs]
    assert rollout_passrate(samples, 2) == pytest.approx({"passrate/pass@1": 0.75, "passrate/pass@2": 1.0})
    dict_rewards = [Sample(group_index=0, reward={"acc": a}) for a in (1.0, 0.0)]
    assert rollout_passrate(dict_rewards, 2, "acc") == pytest.approx(
        {"passrate/pass@1": 0.5, "passrate/pass@2": 1.0}
    )


def test_log_passrate_without_groups_is_refused():
    with pytest.raises(ConfigError, match="--log-passrate: pass@k of prompt groups"):
        parse_run_config(["--rollout-batch-size", "2", "--log-passrate"])
    assert parse_run_config(
        ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--log-passrate"]
    ).log_passrate
