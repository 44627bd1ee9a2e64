"""Metric names the loop writes and the store, the Dagster layer and the CLI read: a leaf (no
imports), so readers below the rollout code (store/run_health.py, store/lineage.py) share them.

`DROP_METRIC_PREFIX`: the dynamic filter's drop counts (`rollout/dynamic_filter/drop_<reason>`,
rollout/filter_hub): groups drawn but not trained.

Eval metric names say how they were sampled.

`pass@1` is the greedy answer (temperature 0, one sample), as are its breakdowns
(`pass@1/carry=True`) and `tool_call_share`. What n samples at temperature T give is
`pass@<n>(T=<T>)` (unbiased pass@k with k = n) and `mean_reward@<n>(T=<T>)`: a sampled pass@1 at
T = 1 below the greedy one is sampling, not a contradiction, and the names say which is which.
A diffusion eval's `mean_reward` (deterministic ODE samples, no temperature) keeps its name.
"""

from __future__ import annotations

DROP_METRIC_PREFIX = "rollout/dynamic_filter/drop_"


def sampled_name(metric: str, n: int, temperature: float | None) -> str:
    """A sampled metric named by its sampling: `pass@4(T=1)`, `mean_reward@4(T=0.8)`."""
    return f"{metric}@{n}(T={temperature or 0.0:g})"


def metric_name(metric: str, n_samples: int, temperature: float | None) -> str:
    """The name an `evals` row's metric has today. Rows written before the names carried their
    sampling (until 2026-12-05) say `pass@k` / `mean_reward` and keep it in their n_samples and
    temperature columns; a diffusion eval's `mean_reward` has no temperature and keeps its name."""
    if metric == "pass@k" or (metric == "mean_reward" and temperature is not None):
        return sampled_name(metric.removesuffix("@k"), n_samples, temperature)
    return metric


def is_greedy_metric(metric: str) -> bool:
    """pass@1, its breakdowns (pass@1/carry=True ...) and tool_call_share come from the greedy answers."""
    return metric == "pass@1" or metric.startswith("pass@1/") or metric == "tool_call_share"
