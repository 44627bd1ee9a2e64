"""The learning-rate schedule of every trainer (RL's `TrainerActor`, SFT through it): megatron-core's
`OptimizerParamScheduler` formulas, as Miles runs them. Optimizer step `s` (0-based) trains at the
schedule's value for `num_steps = s`:

  warmup   `--lr-warmup-init` -> `--lr` linearly over `--lr-warmup-iters` (or `--lr-warmup-fraction`
           of the decay steps); step 0 trains at the init lr, as megatron's first step does
  decay    `--lr-decay-style` constant / linear / cosine / inverse-square-root / WSD from `--lr` to
           `--min-lr` over `--lr-decay-iters` (default: every step of the run); WSD holds `--lr` and
           anneals over the last `--lr-wsd-decay-iters` with `--lr-wsd-decay-style`

A resume restores the step count; the schedule's own values follow megatron's rule: the checkpoint's
with `--use-checkpoint-lr-scheduler`, the command line's with `--override-lr-scheduler`, and with
neither they must agree (a differing one is refused, naming both flags)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from miles_platform.errors import ConfigError

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclass(frozen=True)
class LRSchedule:
    """One schedule's values (what megatron's scheduler state holds, besides the step count)."""

    max_lr: float
    min_lr: float
    warmup_steps: float  # a float: --lr-warmup-fraction * decay steps is not rounded (megatron's)
    decay_steps: int
    decay_style: str = "constant"
    init_lr: float = 0.0
    wsd_decay_steps: int | None = None
    wsd_decay_style: str = "exponential"

    def __post_init__(self):
        if self.decay_style not in DECAY_STYLES:
            raise ConfigError(f"--lr-decay-style {self.decay_style!r}: choose {', '.join(DECAY_STYLES)}")
        if self.decay_style == "WSD" and not self.wsd_decay_steps:
            raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters (the annealing steps)")
        if self.decay_style != "constant" and self.warmup_steps >= self.decay_steps:
            raise ConfigError(
                f"warmup ({self.warmup_steps:g} steps) must end before the decay does ({self.decay_steps} "
                "steps, --lr-decay-iters or the run's steps): megatron asserts warmup < decay"
            )

    def lr(self, num_steps: int) -> float:
        """The lr after `num_steps` optimizer steps (megatron-core's `get_lr`)."""
        if self.warmup_steps > 0 and num_steps <= self.warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * num_steps / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if num_steps > self.decay_steps:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            lr = self.max_lr * max(self.warmup_steps, 1) ** 0.5 / max(num_steps, 1) ** 0.5
            return max(self.min_lr, lr)
        ratio = (num_steps - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: stable until the last wsd_decay_steps, then anneal
            start = self.decay_steps - self.wsd_decay_steps
            coeff = (
                1.0
                if num_steps <= start
                else _wsd_coeff(self.wsd_decay_style, (num_steps - start) / self.wsd_decay_steps)
            )
        return self.min_lr + coeff * (self.max_lr - self.min_lr)


def _wsd_coeff(style: str, r: float) -> float:
    if style == "linear":
        return 1.0 - r
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * r) + 1.0)
    if style == "exponential":
        return 2.0 * 0.5**r - 1.0
    return 1.0 - math.sqrt(r)  # minus_sqrt


def schedule_of(cfg, total_steps: int) -> LRSchedule:
    """The run's schedule: decay over --lr-decay-iters (default `total_steps`), warmup over
    --lr-warmup-iters or --lr-warmup-fraction of the decay steps."""
    decay = cfg.lr_decay_iters or max(total_steps, 1)
    warmup = cfg.lr_warmup_iters if cfg.lr_warmup_fraction is None else cfg.lr_warmup_fraction * decay
    return LRSchedule(
        max_lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=warmup, decay_steps=decay,
        decay_style=cfg.lr_decay_style, init_lr=cfg.lr_warmup_init,
        wsd_decay_steps=cfg.lr_wsd_decay_iters, wsd_decay_style=cfg.lr_wsd_decay_style or "exponential",
    )  # fmt: skip


class LRScheduler:
    """Sets the optimizer's lr from an `LRSchedule` at each step (`step()` after each optimizer
    step, as megatron's `OptimizerParamScheduler.step`)."""

    def __init__(self, opt, schedule: LRSchedule, use_checkpoint: bool = False, override: bool = False):
        if use_checkpoint and override:
            raise ConfigError("--override-lr-scheduler and --use-checkpoint-lr-scheduler: give one")
        self.opt, self.schedule, self.num_steps = opt, schedule, 0
        self.use_checkpoint, self.override = use_checkpoint, override
        self._apply()

    def _apply(self) -> None:
        for g in self.opt.param_groups:
            g["lr"] = self.schedule.lr(self.num_steps)

    def step(self) -> None:
        self.num_steps += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.opt.param_groups]

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, **asdict(self.schedule)}

    def load_state_dict(self, sd: dict) -> None:
        """The saved step count, and the schedule by megatron's rule (see the module doc). A state
        without schedule values (a LambdaLR's, from before) keeps the command line's."""
        self.num_steps = int(sd["num_steps"] if "num_steps" in sd else sd.get("last_epoch", 0))
        saved = {k: sd[k] for k in asdict(self.schedule) if k in sd}
        if saved and not self.override:
            if not self.use_checkpoint:
                differ = [
                    f"{k} {saved[k]!r} (checkpoint) != {v!r}"
                    for k, v in asdict(self.schedule).items()
                    if k in saved and saved[k] != v and _matters(self.schedule, k)
                ]
                if differ:
                    raise ConfigError(
                        f"resume: the LR schedule differs from the checkpoint's: {'; '.join(differ)}. Pass "
                        "--use-checkpoint-lr-scheduler to keep the checkpoint's, or --override-lr-scheduler "
                        "to take the command line's"
                    )
            self.schedule = LRSchedule(**{**asdict(self.schedule), **saved})
        self._apply()

    def set_step(self, num_steps: int) -> None:
        """A resume without scheduler state (--no-save-optim): the schedule at the restored step."""
        self.num_steps = num_steps
        self._apply()


def _matters(s: LRSchedule, key: str) -> bool:
    """Whether a differing value changes any lr of `s` (a constant schedule ignores its decay steps)."""
    if key in ("decay_steps",):
        return s.decay_style != "constant"
    if key in ("wsd_decay_steps", "wsd_decay_style"):
        return s.decay_style == "WSD"
    if key == "init_lr":
        return s.warmup_steps > 0
    return True
