"""The learning-rate schedule of every trainer (RL's `TrainerActor`, SFT): Miles' `--lr-warmup-iters`
linear warmup, then `--lr-decay-style` constant / linear / cosine from `--lr` to `--min-lr` over
`--lr-decay-iters` (default: every step of the run). A `LambdaLR` multiplier on the base lr."""

from __future__ import annotations

import math
from collections.abc import Callable

from miles_platform.errors import ConfigError

DECAY_STYLES = ("constant", "linear", "cosine")


def lr_multiplier(
    lr: float, min_lr: float, warmup_iters: int, decay_style: str, decay_iters: int
) -> Callable[[int], float]:
    if decay_style not in DECAY_STYLES:
        raise ConfigError(f"--lr-decay-style {decay_style!r}: choose {', '.join(DECAY_STYLES)}")
    floor = min_lr / lr if lr > 0 else 0.0

    def f(step: int) -> float:
        if warmup_iters and step < warmup_iters:
            return (step + 1) / warmup_iters
        if decay_style == "constant":
            return 1.0
        frac = min(max(step - warmup_iters, 0) / max(decay_iters - warmup_iters, 1), 1.0)
        if decay_style == "linear":
            return floor + (1 - floor) * (1 - frac)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))

    return f
