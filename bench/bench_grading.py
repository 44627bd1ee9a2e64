"""Grading: the `math` reward on 128 plain-number answers, fast path vs math_verify.

Answers and labels: 128 rows of the demo's SFT split (what the SFT base answers: right sums and
dropped-carry wrong ones, all plain numbers). Ours: `math_rm.math_equal` as the run grades
(`fast_equal`: two plain numbers compared as decimals), its answer cache cleared before every
repeat; baseline: `math_rm.verify_equal` (math_verify parses both sides) on the same pairs, loaded
beforehand (`warm_up`). The hub row adds `rm_hub.compute_rewards` (Samples, async dispatch) on both
sides. Ratios are "x faster" (baseline seconds / ours); noise: the relative spread of 7 repeats.
"""

from __future__ import annotations

import statistics
import time
from unittest import mock

from bench.common import main, row

N, REPEATS = 128, 7


def _pairs() -> list[tuple[str, str]]:
    from miles_platform.data import tasks

    train, _ = tasks.split_problems(tasks.all_problems("add2"), tasks.DEFAULT_EVAL_SIZE, seed=0)
    rows = tasks.sft_rows(train[:N], "add2", tasks.DEFAULT_CARRY_ERROR_RATE, seed=0)
    return [(r["response"], r["label"]) for r in rows]


def _times(fn) -> list[float]:
    out = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _noise(*samples: list[float]) -> float:
    """Relative spread of a ratio of medians: the sum of each side's (max - min) / median."""
    return sum((max(s) - min(s)) / statistics.median(s) for s in samples)


def run() -> list[dict]:
    from miles_platform.config import RunConfig
    from miles_platform.data.sample import Sample
    from miles_platform.rollout import rm_hub
    from miles_platform.rollout.rm_hub import math_rm

    pairs = _pairs()
    math_rm.warm_up()
    wrong = sum(p != g for p, g in pairs)

    def fast():
        math_rm.math_equal.cache_clear()
        return [math_rm.math_equal(p, g) for p, g in pairs]

    def parsed():
        return [math_rm.verify_equal(p, g) for p, g in pairs]

    assert fast() == parsed(), "the fast path disagrees with math_verify"
    t_fast, t_mv = _times(fast), _times(parsed)

    cfg = RunConfig(rollout_batch_size=16, n_samples_per_prompt=8, rm_type="math").reward_settings()
    samples = [Sample(index=i, response=p, label=g) for i, (p, g) in enumerate(pairs)]

    def hub():
        math_rm.math_equal.cache_clear()
        rm_hub.compute_rewards(cfg, samples)

    t_hub = _times(hub)
    with mock.patch.object(math_rm, "fast_equal", lambda p, g: None):  # every answer through math_verify
        t_hub_mv = _times(hub)
    math_rm.math_equal.cache_clear()

    med = statistics.median
    unit = f"ms per {N} answers ({wrong} wrong; ratio: x faster; medians of {REPEATS})"
    rows = [
        row("grading: math reward, plain-number fast path vs math_verify", med(t_fast) * 1e3,
            med(t_mv) * 1e3, unit, noise=_noise(t_fast, t_mv)),
        row("grading: rm_hub.compute_rewards (math), fast path vs math_verify", med(t_hub) * 1e3,
            med(t_hub_mv) * 1e3, unit, noise=_noise(t_hub, t_hub_mv)),
    ]  # fmt: skip
    for r in rows:  # ratio = x faster: baseline seconds / ours
        r["ratio"] = r["baseline"] / r["ours"]
        r["better"] = "higher"
    return rows


if __name__ == "__main__":
    main(run)
