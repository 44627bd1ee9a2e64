"""`--rm-type random`: 0 or 1, reproducible from (--seed, rollout_id, sample index)."""

from __future__ import annotations

import random


async def random_rm(rewards, sample, response: str) -> float:
    rng = random.Random(f"{rewards.seed}:{sample.rollout_id}:{sample.index}")
    return float(rng.randint(0, 1))
