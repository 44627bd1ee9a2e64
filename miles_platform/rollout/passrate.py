"""--log-passrate, as Miles logs it: pass@k of each rollout's prompt groups (`passrate/pass@<k>`) and of
each eval dataset's sampled answers (`eval/<dataset>-pass@<k>`, built-in or custom eval), for
k = 1, 2, 4, ... up to the group size, with
the unbiased estimator (Chen et al. 2021) and a reward of exactly 1 counted as a pass.

The rollout side groups samples by `group_index` and keeps complete groups only (Miles'
`_compute_passrate_from_samples`): a group a filter thinned is left out rather than skewing the mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

PREFIX = "passrate/"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def compute_pass_rate(flat_rewards: Sequence[float], group_size: int) -> dict[str, float]:
    """{"pass@<k>": mean over groups of unbiased pass@k} for k = 1, 2, 4, ..., <= group_size;
    `flat_rewards`: whole groups of `group_size`, one after another (Miles' compute_pass_rate)."""
    if group_size <= 1 or not flat_rewards:
        return {}
    if len(flat_rewards) % group_size:
        raise ValueError(f"{len(flat_rewards)} rewards are not whole groups of {group_size}")
    groups = [flat_rewards[i : i + group_size] for i in range(0, len(flat_rewards), group_size)]
    correct = [sum(1 for r in g if r == 1) for g in groups]
    ks = [2**i for i in range(int(math.log2(group_size)) + 1)]
    return {f"pass@{k}": sum(pass_at_k(group_size, c, k) for c in correct) / len(groups) for k in ks}


def rollout_passrate(samples, group_size: int, reward_key: str | None = None) -> dict[str, float]:
    """`passrate/pass@<k>` of one rollout's complete prompt groups (the training reward of each sample)."""
    groups: dict[int, list] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    whole = [g for g in groups.values() if len(g) == group_size]
    rewards = [
        s.raw_reward if s.raw_reward is not None else s.scalar_reward(reward_key) for g in whole for s in g
    ]
    return {PREFIX + k: v for k, v in compute_pass_rate(rewards, group_size).items()}
