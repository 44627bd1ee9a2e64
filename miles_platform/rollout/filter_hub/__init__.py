"""Filter hub: the three user filter flags, their loaders and the stock filters.

--dynamic-sampling-filter-path  fn(args, group) -> DynamicFilterOutput | bool   per group, after scoring
--rollout-sample-filter-path    fn(args, groups) -> None, sets sample.remove_sample  (loss only)
--buffer-filter-path            fn(args, rollout_id, buffer, num_samples) -> list of groups popped
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from miles_platform.data.sample import Sample
from miles_platform.metric_names import DROP_METRIC_PREFIX
from miles_platform.plugins import load_function
from miles_platform.rollout.filter_hub.base_types import DynamicFilterOutput, FilterOutput, iter_samples
from miles_platform.rollout.filter_hub.dynamic_sampling_filters import (
    check_no_aborted,
    check_reward_nonzero_std,
)

__all__ = [
    "DROP_METRIC_PREFIX",
    "DynamicFilterOutput",
    "FilterOutput",
    "apply_dynamic_filter",
    "apply_rollout_sample_filter",
    "call_dynamic_filter",
    "check_no_aborted",
    "check_reward_nonzero_std",
    "drop_metrics",
    "iter_samples",
    "load_buffer_filter",
    "load_dynamic_filter",
    "load_rollout_sample_filter",
    "pop_first",
]

Group = list[Sample]


def load_dynamic_filter(args) -> Callable[..., Any] | None:
    path = getattr(args, "dynamic_sampling_filter_path", None)
    return load_function(path, "--dynamic-sampling-filter-path", required_params=2) if path else None


def load_rollout_sample_filter(args) -> Callable[..., Any] | None:
    path = getattr(args, "rollout_sample_filter_path", None)
    return load_function(path, "--rollout-sample-filter-path", required_params=2) if path else None


def load_buffer_filter(args) -> Callable[..., Any]:
    path = getattr(args, "buffer_filter_path", None)
    return load_function(path, "--buffer-filter-path", required_params=4) if path else pop_first


def call_dynamic_filter(fn, args, group: Group) -> DynamicFilterOutput:
    if fn is None:
        return DynamicFilterOutput(keep=True)
    out = fn(args, group)
    if not isinstance(out, DynamicFilterOutput):  # legacy filters return a bool
        out = DynamicFilterOutput(keep=bool(out), reason=None if out else "filtered")
    return out


def apply_dynamic_filter(args, groups: list[Group]) -> tuple[list[Group], dict[str, int]]:
    """Keep the groups the `--dynamic-sampling-filter-path` function accepts; count drops by reason."""
    fn = load_dynamic_filter(args)
    kept: list[Group] = []
    drops: Counter[str] = Counter()
    for group in groups:
        out = call_dynamic_filter(fn, args, group)
        if out.keep:
            kept.append(group)
        else:
            drops[out.reason or "unspecified"] += 1
    return kept, dict(drops)


def drop_metrics(drop_counts: dict[str, int]) -> dict[str, int]:
    """{reason: n} -> {"rollout/dynamic_filter/drop_<reason>": n} (Miles' metric names)."""
    return {f"{DROP_METRIC_PREFIX}{reason}": n for reason, n in drop_counts.items()}


def apply_rollout_sample_filter(args, groups: list[Group]) -> int:
    """Run `--rollout-sample-filter-path` (in place); returns how many samples are now removed."""
    fn = load_rollout_sample_filter(args)
    if fn is not None:
        fn(args, groups)
    return sum(s.remove_sample for g in groups for s in g)


def pop_first(args, rollout_id: int | None, buffer: list[Group], num_samples: int) -> list[Group]:
    """Default buffer filter: pop the oldest `num_samples` groups."""
    num = min(len(buffer), num_samples)
    taken = buffer[:num]
    del buffer[:num]
    return taken
