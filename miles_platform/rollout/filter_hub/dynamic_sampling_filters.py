"""Stock `--dynamic-sampling-filter-path` functions: fn(args, group) -> DynamicFilterOutput."""

from __future__ import annotations

import statistics

from miles_platform.data.sample import Sample, Status
from miles_platform.rollout.filter_hub.base_types import DynamicFilterOutput, iter_samples


def check_reward_nonzero_std(args, samples: list[Sample | list[Sample]], **kwargs) -> DynamicFilterOutput:
    """Drop groups whose rewards are all equal (DAPO): their GRPO advantages are all zero."""
    key = getattr(args, "reward_key", None)
    rewards = [s.scalar_reward(key) for s in iter_samples(samples)]
    keep = len(rewards) > 1 and statistics.stdev(rewards) > 1e-8
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_no_aborted(args, samples: list[Sample | list[Sample]], **kwargs) -> DynamicFilterOutput:
    """Drop groups where any sample was aborted."""
    if any(s.status == Status.ABORTED.value for s in iter_samples(samples)):
        return DynamicFilterOutput(keep=False, reason="group_has_aborted")
    return DynamicFilterOutput(keep=True)
