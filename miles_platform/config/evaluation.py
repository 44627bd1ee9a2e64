"""Evaluation during a run: the eval datasets, when to evaluate, and eval sampling, which inherits
from rollout sampling as in Miles."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles_platform.config.flags import FRACTION, NON_NEGATIVE, POSITIVE, flag
from miles_platform.config.reward import RewardSettings
from miles_platform.errors import ConfigError

MILES_LEGACY_EVAL_NAME = "aime"  # what Miles names the dataset of a one-path --eval-prompt-data

RANGES: dict[str, tuple] = {
    **dict.fromkeys(("eval_interval", "n_samples_per_eval_prompt", "eval_max_response_len"), POSITIVE),
    "eval_temperature": NON_NEGATIVE,
    "eval_top_p": FRACTION,
}


@dataclass
class EvalFlags:
    eval_prompt_data: list[str] = flag(
        [], "eval", "one or more `name path` pairs; a single path is named aime, as Miles names it", nargs="*"
    )
    eval_interval: int | None = flag(None, "eval", "rollouts between evals")
    eval_input_key: str | None = flag(None, "eval", "dataset key of an eval prompt (default: --input-key)")
    n_samples_per_eval_prompt: int = flag(1, "eval", "responses per eval prompt (the n of pass@<n>(T=..))")
    eval_max_response_len: int | None = flag(None, "eval", "inherits --rollout-max-response-len")
    eval_temperature: float | None = flag(
        None, "eval", "inherits --rollout-temperature (pass@1 greedy uses 0)"
    )
    eval_top_p: float | None = flag(None, "eval", "inherits --rollout-top-p")
    eval_top_k: int | None = flag(None, "eval", "inherits --rollout-top-k")
    eval_function_path: str | None = flag(
        None,
        "eval",
        "the eval rollout <module>.<fn>(args, rollout_id, data_source, evaluation=True) -> RolloutFnEvalOutput "
        "(or a rollout class called with RolloutFnEvalInput), run at each eval instead of the built-in "
        "pass@k eval; logged as eval/<dataset> (mean reward), as Miles",
    )
    skip_eval_before_train: bool = flag(
        False, "eval", "skip the eval of the initial policy (v0) before the first rollout of a fresh run"
    )

    def _check_eval_flags(self) -> None:
        if len(self.eval_prompt_data) == 1:  # Miles' legacy form: one path, the dataset named aime
            self.eval_prompt_data = [MILES_LEGACY_EVAL_NAME, self.eval_prompt_data[0]]
        if self.eval_prompt_data and len(self.eval_prompt_data) % 2:
            raise ConfigError(f"--eval-prompt-data takes `name path` pairs, got {self.eval_prompt_data}")
        if self.eval_function_path and not (self.eval_prompt_data and self.eval_interval):
            raise ConfigError(
                "--eval-function-path: runs at this run's evals, and it has none: add --eval-interval and "
                "--eval-prompt-data (the function reads args.eval_prompt_data or its own data)"
            )
        if self.eval_function_path and self.debug_train_only:
            raise ConfigError(
                "--eval-function-path: --debug-train-only starts no engines and evaluates nothing"
            )

    def eval_settings(self) -> EvalSettings:
        """The run's eval: sampling inherits from rollout sampling, as in Miles; datasets read with
        the run's dataset keys; graded by the run's reward (pure OPD trains on reward 0: its evals
        grade answers with math)."""
        rewards = self.reward_settings()
        return EvalSettings(
            datasets=tuple(self.eval_datasets()),
            n_samples_per_eval_prompt=self.n_samples_per_eval_prompt,
            max_new_tokens=self.eval_max_response_len or self.rollout_max_response_len,
            temperature=self.rollout_temperature if self.eval_temperature is None else self.eval_temperature,
            top_p=self.rollout_top_p if self.eval_top_p is None else self.eval_top_p,
            top_k=self.rollout_top_k if self.eval_top_k is None else self.eval_top_k,
            seed=self.seed,
            input_key=self.eval_input_key or self.input_key,
            label_key=self.label_key or "label",
            metadata_key=self.metadata_key,
            apply_chat_template=self.apply_chat_template,
            chat_template_kwargs=self.chat_template_kwargs(),
            image_keys=self.image_keys(),
            rewards=RewardSettings(rm_type="math") if rewards.pure_opd else rewards,
        )

    def eval_datasets(self) -> list[tuple[str, str]]:
        it = iter(self.eval_prompt_data)
        return list(zip(it, it))


@dataclass(frozen=True)
class EvalSettings:
    """What an eval of a run's policy needs (`cfg.eval_settings()`): the `name path` datasets, the
    sampling of pass@<n>(T=..) / mean_reward@<n>(T=..) (pass@1 is always greedy), the dataset keys
    and the reward that grades the answers."""

    datasets: tuple[tuple[str, str], ...]
    n_samples_per_eval_prompt: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    input_key: str
    label_key: str
    metadata_key: str
    apply_chat_template: bool
    rewards: RewardSettings
    chat_template_kwargs: dict = field(default_factory=dict)  # --apply-chat-template-kwargs
    image_keys: dict | None = None  # --multimodal-keys: eval prompts' images, read as train's

    @property
    def sampling(self) -> dict[str, Any]:
        """The sampling as `evaluate` takes it and the `evals` rows record it."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k}  # fmt: skip
