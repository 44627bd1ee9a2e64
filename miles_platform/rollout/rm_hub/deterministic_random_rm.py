"""`--rm-type deterministic_random`: 0 or 1 from the sample's content alone, Miles' formula:
the first byte of sha256(str(tokens) + response), mod 2 (same sample, same reward, any run)."""

from __future__ import annotations

import hashlib


async def deterministic_random_rm(rewards, sample, response: str) -> float:
    digest = hashlib.sha256((str(list(sample.tokens)) + response).encode()).digest()
    return float(digest[0] % 2)
