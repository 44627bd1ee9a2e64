"""Reward hub (`--rm-type`): a registry of built-in rewards plus `--custom-rm-path`.

A new built-in reward is one file with `async def my_rm(rewards, sample, response) -> float | dict`
(`rewards`: the run's RewardSettings; or a plain `fn(response, label)` wrapped by `_graded`) and one
line in `REWARDS`. The hub's entry points take RewardSettings (`cfg.reward_settings()`) or anything
`RewardSettings.of` reads (a RunConfig, Miles' args); a `--custom-rm-path` function receives the
run's own args (`RewardSettings.user_args`), as in Miles.

Dispatch per sample, as in Miles:
  --custom-rm-path set      -> the user function (per sample, or per group with --group-rm)
  else rm_type = sample.metadata["rm_type"] or --rm-type
       boxed_<type>         -> grade the last \\boxed{...} of the response with <type>
       <type>               -> REWARDS[<type>]
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from miles_platform.config import ConfigError
from miles_platform.config.reward import RewardSettings
from miles_platform.data.sample import Sample
from miles_platform.errors import MilesError, UserFunctionError
from miles_platform.plugins import load_function
from miles_platform.rollout.rm_hub import math_rm
from miles_platform.rollout.rm_hub.boxed import last_boxed
from miles_platform.rollout.rm_hub.dapo_rm import dapo_reward
from miles_platform.rollout.rm_hub.deepscaler_rm import deepscaler_reward
from miles_platform.rollout.rm_hub.deterministic_random_rm import deterministic_random_rm
from miles_platform.rollout.rm_hub.f1_rm import f1_reward
from miles_platform.rollout.rm_hub.final_answer_rm import final_answer_rm
from miles_platform.rollout.rm_hub.gemma_math_rm import gemma_math_reward
from miles_platform.rollout.rm_hub.gpqa_rm import gpqa_rm
from miles_platform.rollout.rm_hub.math_rm import math_reward
from miles_platform.rollout.rm_hub.random_rm import random_rm
from miles_platform.rollout.rm_hub.remote_rm import RemoteRewardError, remote_rm

Reward = float | dict[str, float]
RewardFn = Callable[[RewardSettings, Sample, str], Awaitable[Reward]]

__all__ = [
    "REWARDS",
    "RemoteRewardError",
    "async_rm",
    "batched_async_rm",
    "RewardSettings",
    "compute_rewards",
    "valid_rm_types",
    "validate_reward_config",
    "run_graders",
    "warm_up_rewards",
    "warm_up_rewards_in_background",
]


def _graded(fn: Callable[[str, str | None], Reward]) -> RewardFn:
    """Adapt a pure `fn(response, label)` grader to the hub's async signature."""

    async def rm(rewards: RewardSettings, sample: Sample, response: str) -> Reward:
        return fn(response, sample.label)

    rm.__name__ = fn.__name__
    return rm


REWARDS: dict[str, RewardFn] = {
    "math": _graded(math_reward),
    "dapo": _graded(dapo_reward),
    "deepscaler": _graded(deepscaler_reward),
    "f1": _graded(f1_reward),
    "final_answer": final_answer_rm,  # the last number after the last tool answer (multi-turn)
    "random": random_rm,
    "deterministic_random": deterministic_random_rm,  # sha256 of the sample's tokens + response (Miles')
    "gemma_math": _graded(gemma_math_reward),
    "gpqa": gpqa_rm,  # multiple choice; reads metadata choices / correct_letter
    "remote_rm": remote_rm,
}

# Miles rewards refused by name: what they need that this build does not ship
REFUSED_REWARDS = {
    "ifbench": "Miles' ifbench reward clones allenai/IFBench at run time and imports its instruction checkers "
    "(with their requirements: nltk, langdetect, emoji, syllapy, ...); this build does not ship them. Score "
    "instruction following with --custom-rm-path (your function may import IFBench's instructions_registry)",
}

# graders with a heavy lazy dependency: loaded when the run starts (warm_up_rewards)
WARM_UPS: dict[str, Callable[[], None]] = {
    "math": math_rm.warm_up, "deepscaler": math_rm.warm_up, "gemma_math": math_rm.warm_up
}  # fmt: skip

# rewards that return a dict and therefore need --reward-key to train on
DICT_REWARDS = {"dapo"}


def valid_rm_types() -> list[str]:
    return sorted(REWARDS) + ["boxed_<type>"]


def _resolve(rm_type: str | None, flag: str = "--rm-type") -> tuple[RewardFn, bool]:
    """rm_type -> (reward fn, grade only the boxed answer)."""
    name = (rm_type or "").strip()
    boxed = name.startswith("boxed_")
    if boxed:
        name = name[len("boxed_") :]
    if name in REFUSED_REWARDS:
        raise ConfigError(f"{flag} {rm_type!r}: {REFUSED_REWARDS[name]}")
    if name not in REWARDS:
        if not rm_type:
            raise ConfigError(f"no reward: set --rm-type (one of {valid_rm_types()}) or --custom-rm-path")
        raise ConfigError(f"{flag} {rm_type!r} is not a reward; valid: {valid_rm_types()}")
    return REWARDS[name], boxed


def _rm_type_of(rewards: RewardSettings, sample: Sample) -> tuple[str | None, str]:
    meta = sample.metadata if isinstance(sample.metadata, dict) else {}
    if meta.get("rm_type"):
        return meta["rm_type"], f"metadata.rm_type of sample {sample.index}"
    return rewards.rm_type, "--rm-type"


def _check_every_prompt_names_a_reward(rewards: RewardSettings) -> None:
    """No --rm-type, no --custom-rm-path: only a dataset whose every row names its reward
    (metadata.rm_type, Miles' per-sample dispatch) can train; else no sample would have a reward."""
    from miles_platform.data.dataset import load_prompt_dataset

    none = f"no reward: set --rm-type (one of {valid_rm_types()}) or --custom-rm-path"
    data = rewards.prompt_data
    if not data:
        raise ConfigError(none)
    records = load_prompt_dataset(data, rewards.input_key, rewards.label_key, rewards.metadata_key)
    unnamed = next((i for i, r in enumerate(records) if not r.metadata.get("rm_type")), None)
    if unnamed is not None:
        raise ConfigError(f"{none}; --prompt-data {data} record {unnamed} has no metadata.rm_type")


def validate_reward_config(args: RewardSettings | Any) -> None:
    """Fail before any engine starts: no reward, unknown --rm-type, missing --rm-url, bad custom path."""
    rewards = RewardSettings.of(args)
    if rewards.custom_rm_path:
        load_function(rewards.custom_rm_path, "--custom-rm-path", required_params=2)
    elif rewards.group_rm:
        raise ConfigError("--group-rm needs --custom-rm-path (a fn(args, samples) -> list of rewards)")
    elif rewards.pure_opd:
        pass  # pure on-policy distillation: reward 0, the teacher is the whole signal
    elif not rewards.rm_type:
        _check_every_prompt_names_a_reward(rewards)
    else:
        fn, _ = _resolve(rewards.rm_type)
        if fn is remote_rm and not rewards.rm_url:
            raise ConfigError("--rm-type remote_rm needs --rm-url")
        base = rewards.rm_type.removeprefix("boxed_")
        if base in DICT_REWARDS and not rewards.reward_key:
            raise ConfigError(
                f"--rm-type {rewards.rm_type} returns a dict {{'score', 'acc'}}: pass --reward-key score (or acc)"
            )


def run_graders(cfg: Any) -> tuple[str | None, ...]:
    """The --rm-type values a run grades with, to warm up: its own, else the in-loop eval's `math`
    when it evaluates."""
    return (cfg.rm_type or ("math" if cfg.eval_interval else None),)


def _warm_ups(rm_types: tuple[str | None, ...]) -> set[Callable[[], None]]:
    return {WARM_UPS[n] for t in rm_types if t and (n := t.removeprefix("boxed_")) in WARM_UPS}


_warming: dict[Callable[[], None], threading.Thread] = {}


def warm_up_rewards_in_background(*rm_types: str | None) -> None:
    """Start loading these graders on a daemon thread (a run starts it once Ray is up, while its
    main thread waits for the actors: math_verify + sympy are ~0.6 CPU-s of imports on this 2-core
    VM, ~2 where no .pyc is written); `warm_up_rewards` (the rollout manager's start) waits for it."""
    for fn in _warm_ups(rm_types):
        if fn not in _warming:
            _warming[fn] = threading.Thread(target=_quietly, args=(fn,), name="warm-up-rewards", daemon=True)
            _warming[fn].start()


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - warm_up_rewards runs it again on the caller's thread and raises there
        pass


def warm_up_rewards(*rm_types: str | None) -> None:
    """Load the graders of these --rm-type values (boxed_ included) before the first rollout, so a
    step never pays a grader's one-time import (math_verify: ~0.35 s, fired by the first answer
    that is not a plain number). One started in the background is waited for (and run again here,
    a no-op once done, so a failure there is raised here)."""
    for fn in _warm_ups(rm_types):
        started = _warming.pop(fn, None)
        if started is not None:
            started.join()
        fn()


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


async def async_rm(args: RewardSettings | Any, sample: Sample) -> Reward:
    """The reward of one sample (float, or a dict for multi-part rewards)."""
    rewards = RewardSettings.of(args)
    if rewards.pure_opd and not (sample.metadata or {}).get("rm_type"):
        return 0.0
    if rewards.custom_rm_path:
        fn = load_function(rewards.custom_rm_path, "--custom-rm-path", required_params=2)
        return await _maybe_await(fn(rewards.user_args, sample))
    rm_type, source = _rm_type_of(rewards, sample)
    fn, boxed = _resolve(rm_type, source)
    response = sample.response
    if boxed:
        response = last_boxed(response) or ""
    return await fn(rewards, sample, response)


async def batched_async_rm(args: RewardSettings | Any, samples: list[Sample]) -> list[Reward]:
    """Rewards of `samples`, computed concurrently; one call of the group reward with --group-rm."""
    rewards = RewardSettings.of(args)
    if rewards.custom_rm_path and rewards.group_rm:
        fn = load_function(rewards.custom_rm_path, "--custom-rm-path", required_params=2)
        out = list(await _maybe_await(fn(rewards.user_args, samples)))
        if len(out) != len(samples):
            raise ConfigError(
                f"--custom-rm-path {rewards.custom_rm_path} with --group-rm returned {len(out)} rewards "
                f"for {len(samples)} samples"
            )
        return out
    return list(await asyncio.gather(*(async_rm(rewards, s) for s in samples)))


def _groups(samples: list[Sample]) -> list[list[Sample]]:
    """Consecutive runs of the same group_index."""
    out: list[list[Sample]] = []
    for s in samples:
        if out and out[-1][0].group_index == s.group_index:
            out[-1].append(s)
        else:
            out.append([s])
    return out


async def _score_all(rewards: RewardSettings, samples: list[Sample]) -> list[Reward]:
    if rewards.group_rm:
        per_group = await asyncio.gather(*(batched_async_rm(rewards, g) for g in _groups(samples)))
        return [r for group in per_group for r in group]
    return await batched_async_rm(rewards, samples)


def compute_rewards(args: RewardSettings | Any, samples: list[Sample]) -> list[Reward]:
    """Blocking: score `samples`, set `sample.reward` and `sample.raw_reward` (the training scalar)."""
    settings = RewardSettings.of(args)
    try:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            rewards = asyncio.run(_score_all(settings, samples))
        else:  # called from async code: run on a fresh loop in a helper thread
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                rewards = pool.submit(asyncio.run, _score_all(settings, samples)).result()
    except MilesError:
        raise
    except Exception as e:
        if not settings.custom_rm_path:
            raise  # a built-in reward (a remote RM's connection): maybe transient
        raise UserFunctionError(
            f"--custom-rm-path {settings.custom_rm_path} raised {type(e).__name__}: {e}"
        ) from e
    key = settings.reward_key
    for sample, reward in zip(samples, rewards, strict=True):
        sample.reward = reward if isinstance(reward, dict) else float(reward)
        try:
            sample.raw_reward = sample.scalar_reward(key)
        except ValueError as e:
            raise ConfigError(f"sample {sample.index}: {e}") from e
    return rewards
