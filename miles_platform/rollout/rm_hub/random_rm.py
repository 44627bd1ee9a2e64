"""`--rm-type random`: 0 or 1, reproducible from (--seed, rollout_id, sample index)."""

from __future__ import annotations

import random


async def random_rm(args, sample, response: str) -> float:
    rng = random.Random(f"{getattr(args, 'seed', 0)}:{sample.rollout_id}:{sample.index}")
    return float(rng.randint(0, 1))
