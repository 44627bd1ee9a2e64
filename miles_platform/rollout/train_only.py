"""`--debug-train-only` with a `--rollout-function-path`, as Miles runs it (its SFT recipe: the
function `miles.rollout.sft_rollout.generate_rollout`): no engine starts, and each rollout is what
the function returns from the data source, trained as it comes (no reward model, no filters). A
function that calls an engine fails at that call: there is none."""

from __future__ import annotations

import asyncio
import inspect
import time

import numpy as np

from miles_platform.data.sample import Sample
from miles_platform.errors import ConfigError
from miles_platform.plugins import ROLLOUT_FLAG, load_rollout_function
from miles_platform.rollout.base_types import RolloutFnTrainOutput

NO_ENGINE = "http://127.0.0.1:0"  # where the function's args say the router is: nowhere


class TrainOnlyRollouts:
    def __init__(self, cfg, data_source):
        from miles_platform.rollout.generate_hub import function_args

        self.cfg, self.path = cfg, cfg.rollout_function_path
        self.fn = load_rollout_function(self.path).bind(function_args(cfg, NO_ENGINE), data_source)

    def generate(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        c, t0 = self.cfg, time.time()
        out = self.fn(rollout_id)
        if inspect.isawaitable(out):
            out = asyncio.run(_awaited(out))
        extra = {}
        if isinstance(out, RolloutFnTrainOutput):
            out, extra = out.samples, dict(out.metrics or {})
        shape = (
            [len(g) if isinstance(g, list) else type(g).__name__ for g in out]
            if isinstance(out, list)
            else None
        )
        if shape != [c.n_samples_per_prompt] * c.rollout_batch_size:
            raise ConfigError(
                f"{ROLLOUT_FLAG} {self.path!r} returned {shape or type(out).__name__} (group sizes): expected "
                f"--rollout-batch-size={c.rollout_batch_size} groups of --n-samples-per-prompt={c.n_samples_per_prompt}"
            )
        samples = []
        for gi, group in enumerate(out):
            for s in group:
                samples.append(self._checked(s, rollout_id, gi, len(samples)))
        rewards = np.array([s.raw_reward for s in samples], dtype=float)
        metrics = {
            "rollout/raw_reward": float(rewards.mean()),
            "rollout/response_len/mean": float(np.mean([s.response_length for s in samples])),
            "perf/rollout_time": time.time() - t0,
        }
        metrics.update({k: float(v) for k, v in extra.items() if isinstance(v, int | float)})
        return samples, metrics

    def _checked(self, s, rollout_id: int, group: int, index: int) -> Sample:
        where = f"{ROLLOUT_FLAG} {self.path!r}"
        if not isinstance(s, Sample):
            raise ConfigError(f"{where} returned a {type(s).__name__}, not a Sample")
        n = len(s.response_tokens)
        if not s.prompt_tokens or len(s.loss_mask) != n or len(s.rollout_log_probs) not in (0, n):
            raise ConfigError(
                f"{where} returned a Sample with {len(s.prompt_tokens)} prompt_tokens, {n} response_tokens, "
                f"{len(s.loss_mask)} loss_mask and {len(s.rollout_log_probs)} rollout_log_probs: a train-only "
                "sample needs prompt tokens and one loss-mask entry per response token (log-probs: all or none)"
            )
        if s.raw_reward is None:
            if not isinstance(s.reward, int | float):
                raise ConfigError(
                    f"{where} returned a Sample without a reward: with --debug-train-only nothing scores it"
                )
            s.raw_reward = float(s.reward)
        s.run, s.rollout_id, s.group_index, s.index = self.cfg.run_name, rollout_id, group, index
        return s


async def _awaited(x):
    return await x
