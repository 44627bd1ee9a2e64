"""The LR schedule (training/schedule.py) against megatron-core's OptimizerParamScheduler, step by
step, and Miles' resume rules for it (--use-checkpoint-lr-scheduler / --override-lr-scheduler)."""

import functools
import importlib.util
from pathlib import Path

import pytest
import torch

from miles_platform.config import parse_run_config
from miles_platform.errors import ConfigError
from miles_platform.training.schedule import LRSchedule, LRScheduler, schedule_of

BASE = ["--rollout-batch-size", "2"]


@functools.cache
def _megatron_scheduler_class():
    """megatron-core's optimizer_param_scheduler.py as installed, run without importing the
    megatron.core package (~14 s of imports here): its one import is a logging helper."""
    roots = importlib.util.find_spec("megatron").submodule_search_locations
    path = next(Path(r, "core", "optimizer_param_scheduler.py") for r in roots)
    src = path.read_text()
    needed = "from megatron.core.utils import log_single_rank"
    assert needed in src
    ns = {"__name__": "megatron_core_optimizer_param_scheduler"}
    exec(compile(src.replace(needed, "log_single_rank = lambda *a, **k: None"), str(path), "exec"), ns)
    return ns["OptimizerParamScheduler"]


def _megatron_lrs(steps: int, **kw) -> list[float]:
    """megatron-core's scheduler on a real optimizer: the lr of each of `steps` steps."""
    OptimizerParamScheduler = _megatron_scheduler_class()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    s = OptimizerParamScheduler(
        opt, start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False, **kw,
    )  # fmt: skip
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        s.step(1)
    return out


CASES = [
    dict(init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=5, lr_decay_steps=40, lr_decay_style="cosine"),
    dict(init_lr=0.2, max_lr=1.0, min_lr=0.1, lr_warmup_steps=4, lr_decay_steps=40, lr_decay_style="linear"),
    dict(init_lr=0.0, max_lr=2.0, min_lr=0.0, lr_warmup_steps=3, lr_decay_steps=40, lr_decay_style="constant"),
    dict(init_lr=0.0, max_lr=1.0, min_lr=0.05, lr_warmup_steps=4, lr_decay_steps=40, lr_decay_style="inverse-square-root"),
    *[
        dict(init_lr=0.1, max_lr=1.0, min_lr=0.01, lr_warmup_steps=3, lr_decay_steps=40, lr_decay_style="WSD",
             wsd_decay_steps=12, lr_wsd_decay_style=style)
        for style in ("exponential", "linear", "cosine", "minus_sqrt")
    ],
    dict(init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=2.5, lr_decay_steps=25, lr_decay_style="cosine"),
]  # fmt: skip


@pytest.mark.parametrize(
    "kw", CASES, ids=lambda kw: f"{kw['lr_decay_style']}-{kw.get('lr_wsd_decay_style', '')}"
)
def test_every_step_matches_megatron_core(kw):
    ours = LRSchedule(
        max_lr=kw["max_lr"], min_lr=kw["min_lr"], warmup_steps=kw["lr_warmup_steps"],
        decay_steps=kw["lr_decay_steps"], decay_style=kw["lr_decay_style"], init_lr=kw["init_lr"],
        wsd_decay_steps=kw.get("wsd_decay_steps"), wsd_decay_style=kw.get("lr_wsd_decay_style", "exponential"),
    )  # fmt: skip
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=123.0)
    sched, got = LRScheduler(opt, ours), []
    for _ in range(45):  # past the decay: min_lr
        got.append(opt.param_groups[0]["lr"])
        sched.step()
    assert got == pytest.approx(_megatron_lrs(45, **kw), abs=1e-12)


def test_flags_build_the_schedule_megatron_builds():
    """--lr-warmup-fraction of the decay steps (not rounded), --lr-warmup-init, WSD's flags."""
    cfg = parse_run_config([*BASE, "--lr", "1.0", "--lr-warmup-fraction", "0.1", "--lr-decay-style", "cosine",
                            "--lr-decay-iters", "25", "--lr-warmup-init", "0.3"])  # fmt: skip
    s = schedule_of(cfg, total_steps=1000)
    assert (s.warmup_steps, s.decay_steps, s.init_lr) == (2.5, 25, 0.3)
    assert [s.lr(n) for n in (0, 1)] == pytest.approx([0.3, 0.3 + 0.7 / 2.5])  # hand-checked
    cfg = parse_run_config([*BASE, "--lr", "1.0", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "4",
                            "--lr-wsd-decay-style", "linear", "--lr-decay-iters", "10"])  # fmt: skip
    s = schedule_of(cfg, total_steps=10)
    assert [s.lr(n) for n in (5, 6, 7, 8, 10)] == pytest.approx([1.0, 1.0, 0.75, 0.5, 0.0])


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--lr-decay-style", "WSD"], "needs --lr-wsd-decay-iters"),
        (["--lr-wsd-decay-iters", "3"], "only --lr-decay-style WSD"),
        (["--lr-warmup-init", "0.1"], "no effect without warmup"),
        (["--use-checkpoint-lr-scheduler", "--override-lr-scheduler"], "give one"),
        (
            ["--lr-decay-style", "cosine", "--lr-warmup-iters", "10", "--lr-decay-iters", "10"],
            "warmup < decay",
        ),
    ],
)
def test_contradictions_are_refused_before_start(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_run_config([*BASE, *argv])


def _sched(use_checkpoint=False, override=False, **kw):
    base = dict(max_lr=1.0, min_lr=0.0, warmup_steps=2, decay_steps=20, decay_style="linear")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return LRScheduler(opt, LRSchedule(**{**base, **kw}), use_checkpoint, override)


def test_resume_rules_follow_megatron():
    saved = _sched()
    for _ in range(7):
        saved.step()
    sd = saved.state_dict()
    same = _sched()
    same.load_state_dict(sd)
    assert same.num_steps == 7 and same.get_last_lr() == saved.get_last_lr()
    with pytest.raises(ConfigError, match="--use-checkpoint-lr-scheduler.*--override-lr-scheduler"):
        _sched(max_lr=0.5).load_state_dict(sd)
    kept = _sched(use_checkpoint=True, max_lr=0.5)
    kept.load_state_dict(sd)
    assert kept.get_last_lr() == saved.get_last_lr()  # the checkpoint's values
    new = _sched(override=True, max_lr=0.5)
    new.load_state_dict(sd)
    assert new.num_steps == 7 and new.get_last_lr() == pytest.approx([0.5 * (1 - 5 / 18)])  # the flags'
    constant = _sched(decay_style="constant")  # a constant schedule ignores its decay steps
    constant.load_state_dict({**_sched(decay_style="constant").state_dict(), "decay_steps": 99})
    legacy = _sched()  # a LambdaLR state from before: the step count, the flags' values
    legacy.load_state_dict({"last_epoch": 3, "base_lrs": [1.0]})
    assert legacy.num_steps == 3 and legacy.get_last_lr() == pytest.approx([1 - 1 / 18])
