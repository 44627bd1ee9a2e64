"""filter_hub: the stock nonzero-std filter, user filters loaded by flag, drop metrics."""

from __future__ import annotations

import sys
import textwrap

import pytest

from miles_platform.config import ConfigError, RunConfig
from miles_platform.data.sample import Sample
from miles_platform.rollout.filter_hub import (
    DynamicFilterOutput,
    apply_dynamic_filter,
    apply_rollout_sample_filter,
    check_no_aborted,
    check_reward_nonzero_std,
    drop_metrics,
    load_buffer_filter,
)


def group(*rewards, gi=0):
    return [Sample(group_index=gi, index=i, reward=r) for i, r in enumerate(rewards)]


def cfg(**kw) -> RunConfig:
    return RunConfig(rollout_batch_size=1, **kw)


def test_nonzero_std_keeps_mixed_groups_only():
    assert check_reward_nonzero_std(cfg(), group(1.0, 0.0, 0.0, 1.0)) == DynamicFilterOutput(True, None)
    assert check_reward_nonzero_std(cfg(), group(1.0, 1.0, 1.0)) == DynamicFilterOutput(False, "zero_std_1.0")
    assert check_reward_nonzero_std(cfg(), group(0.0, 0.0)).reason == "zero_std_0.0"


def test_nonzero_std_uses_reward_key():
    g = [Sample(reward={"score": 1.0, "acc": 1.0}), Sample(reward={"score": -1.0, "acc": 1.0})]
    assert check_reward_nonzero_std(cfg(reward_key="score"), g).keep
    assert not check_reward_nonzero_std(cfg(reward_key="acc"), g).keep


def test_no_aborted():
    g = group(1.0, 0.0)
    assert check_no_aborted(cfg(), g).keep
    g[1].status = "aborted"
    assert check_no_aborted(cfg(), g) == DynamicFilterOutput(False, "group_has_aborted")


def test_apply_dynamic_filter_counts_reasons():
    args = cfg(dynamic_sampling_filter_path="miles_platform.rollout.filter_hub.check_reward_nonzero_std")
    groups = [group(1.0, 0.0, gi=0), group(1.0, 1.0, gi=1), group(0.0, 0.0, gi=2), group(0.0, 0.0, gi=3)]
    kept, drops = apply_dynamic_filter(args, groups)
    assert [g[0].group_index for g in kept] == [0]
    assert drops == {"zero_std_1.0": 1, "zero_std_0.0": 2}
    assert drop_metrics(drops) == {
        "rollout/dynamic_filter/drop_zero_std_1.0": 1,
        "rollout/dynamic_filter/drop_zero_std_0.0": 2,
    }
    assert apply_dynamic_filter(cfg(), groups) == (groups, {})  # no flag: keep all


@pytest.fixture
def user_filters(tmp_path, monkeypatch):
    (tmp_path / "my_filters.py").write_text(
        textwrap.dedent(
            """
            def long_only(args, group):
                return all(len(s.response) > 2 for s in group)  # legacy bool return

            def drop_empty(args, groups):
                for g in groups:
                    for s in g:
                        s.remove_sample = s.response == ""

            def newest(args, rollout_id, buffer, num_samples):
                taken = buffer[-num_samples:]
                del buffer[-num_samples:]
                return taken
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_filters", None)


def test_user_filters(user_filters):
    groups = [[Sample(response="abc"), Sample(response="")], [Sample(response="abcd")]]
    kept, drops = apply_dynamic_filter(cfg(dynamic_sampling_filter_path="my_filters.long_only"), groups)
    assert kept == [groups[1]] and drops == {"filtered": 1}
    assert apply_rollout_sample_filter(cfg(rollout_sample_filter_path="my_filters.drop_empty"), groups) == 1
    assert groups[0][1].remove_sample and not groups[0][0].remove_sample
    buffer = [["a"], ["b"], ["c"]]
    assert load_buffer_filter(cfg())(None, 0, buffer, 2) == [["a"], ["b"]] and buffer == [["c"]]
    buffer = [["a"], ["b"], ["c"]]
    assert load_buffer_filter(cfg(buffer_filter_path="my_filters.newest"))(None, 0, buffer, 1) == [["c"]]
    with pytest.raises(ConfigError, match="--buffer-filter-path.*4 positional"):
        load_buffer_filter(cfg(buffer_filter_path="my_filters.long_only"))
