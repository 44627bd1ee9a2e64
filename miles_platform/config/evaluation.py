"""Evaluation during a run: the eval datasets, when to evaluate, and eval sampling, which inherits
from rollout sampling as in Miles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_platform.config.flags import FRACTION, NON_NEGATIVE, POSITIVE, flag
from miles_platform.errors import ConfigError

RANGES: dict[str, tuple] = {
    **dict.fromkeys(("eval_interval", "n_samples_per_eval_prompt", "eval_max_response_len"), POSITIVE),
    "eval_temperature": NON_NEGATIVE,
    "eval_top_p": FRACTION,
}


@dataclass
class EvalFlags:
    eval_prompt_data: list[str] = flag([], "eval", "one or more `name path` pairs", nargs="*")
    eval_interval: int | None = flag(None, "eval", "rollouts between evals")
    n_samples_per_eval_prompt: int = flag(1, "eval", "responses per eval prompt (the n of pass@<n>(T=..))")
    eval_max_response_len: int | None = flag(None, "eval", "inherits --rollout-max-response-len")
    eval_temperature: float | None = flag(
        None, "eval", "inherits --rollout-temperature (pass@1 greedy uses 0)"
    )
    eval_top_p: float | None = flag(None, "eval", "inherits --rollout-top-p")
    eval_top_k: int | None = flag(None, "eval", "inherits --rollout-top-k")
    skip_eval_before_train: bool = flag(
        False, "eval", "skip the eval of the initial policy (v0) before the first rollout of a fresh run"
    )

    def _check_eval_flags(self) -> None:
        if self.eval_prompt_data and len(self.eval_prompt_data) % 2:
            raise ConfigError(f"--eval-prompt-data takes `name path` pairs, got {self.eval_prompt_data}")

    # eval sampling inherits from rollout sampling, as in Miles
    def eval_sampling(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.eval_max_response_len or self.rollout_max_response_len,
            "temperature": self.rollout_temperature
            if self.eval_temperature is None
            else self.eval_temperature,
            "top_p": self.rollout_top_p if self.eval_top_p is None else self.eval_top_p,
            "top_k": self.rollout_top_k if self.eval_top_k is None else self.eval_top_k,
        }

    def eval_datasets(self) -> list[tuple[str, str]]:
        it = iter(self.eval_prompt_data)
        return list(zip(it, it))
