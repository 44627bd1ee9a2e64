"""What a rollout is: the prompt data and its batching, the rollout / generate function, how
responses are sampled, and the fully async mode."""

from __future__ import annotations

from dataclasses import dataclass

from miles_platform.config.flags import FINITE, FRACTION, NON_NEGATIVE, POSITIVE, flag, json_flag
from miles_platform.errors import ConfigError

RANGES: dict[str, tuple] = {
    **dict.fromkeys(
        (
            "num_epoch",
            "rollout_batch_size",
            "n_samples_per_prompt",
            "global_batch_size",
            "num_steps_per_rollout",
            "over_sampling_batch_size",
            "rollout_max_prompt_len",
            "rollout_max_concurrency",
            "async_max_concurrent_samples",
        ),
        POSITIVE,
    ),  # fmt: skip
    **dict.fromkeys(("num_rollout", "max_weight_staleness"), NON_NEGATIVE),
    "async_data_buffer_capacity_factor": (0, None, True, "> 0"),
    "rollout_top_p": FRACTION,
    "rollout_temperature": FINITE,
}

# The flags other commands share with `train` (one definition each, see `cli.add_flags`)
DATASET_FLAGS = ("input_key", "label_key", "metadata_key", "apply_chat_template")
# Miles' SFT through train.py (rollout/sft_rollout.py): its name and ours
SFT_ROLLOUT_PATHS = (
    "miles.rollout.sft_rollout.generate_rollout",
    "miles_platform.rollout.sft_rollout.generate_rollout",
)


@dataclass
class RolloutFlags:
    prompt_data: str | None = flag(None, "rollout", "prompt dataset (JSONL or Parquet, any fsspec URI)")
    input_key: str = flag("input", "rollout", "dataset key for Sample.prompt")
    label_key: str | None = flag(None, "rollout", "dataset key for Sample.label")
    metadata_key: str = flag("metadata", "rollout", "dataset key for Sample.metadata")
    apply_chat_template: bool = flag(False, "rollout", "apply the tokenizer's chat template")
    apply_chat_template_kwargs: str | None = flag(
        None,
        "rollout",
        "JSON object of extra arguments to the tokenizer's apply_chat_template (e.g. "
        "'{\"enable_thinking\": false}'): train and eval prompts (--apply-chat-template), the multi-turn "
        "generate function's tool turns, the session server's default (a request's own chat_template_kwargs win)",
    )
    rollout_shuffle: bool = flag(False, "rollout", "shuffle prompts each epoch")
    data_source_path: str | None = flag(
        None,
        "rollout",
        "a data source class <module>.<Class>, built as cls(args) (Miles' DataSource: get_samples(n) -> "
        "list[list[Sample]], add_samples, save(rollout_id), load(rollout_id)); replaces reading --prompt-data",
    )
    disable_rollout_global_dataset: bool = flag(
        False,
        "rollout",
        "load no --prompt-data: the --rollout-function-path (with a --data-source-path or on its own) "
        "brings its data; needs --num-rollout",
    )
    rollout_seed: int = flag(42, "rollout", "seed of the data-source shuffle")
    num_rollout: int | None = flag(
        None, "rollout", "total rollout iterations (derived from dataset and --num-epoch if unset)"
    )
    num_epoch: int | None = flag(None, "rollout", "epochs over the prompt data when --num-rollout is unset")
    rollout_batch_size: int | None = flag(None, "rollout", "prompts per rollout (required)")
    n_samples_per_prompt: int = flag(1, "rollout", "responses per prompt (GRPO group size)")
    global_batch_size: int | None = flag(None, "rollout", "samples per optimizer step (derived)")
    num_steps_per_rollout: int | None = flag(None, "rollout", "optimizer steps per rollout (derived)")
    over_sampling_batch_size: int | None = flag(
        None, "rollout", "prompts to sample per dynamic-sampling round"
    )
    rollout_max_prompt_len: int | None = flag(None, "rollout", "drop prompts longer than this many tokens")
    rollout_function_path: str | None = flag(
        None,
        "rollout",
        "replace the whole rollout: <module>.<fn>(args, rollout_id, data_source, evaluation=False) -> "
        "RolloutFnTrainOutput | list[list[Sample]] (or a class, as Miles); see docs/rollout.md",
    )
    custom_generate_function_path: str | None = flag(
        None,
        "rollout",
        "per-sample generate <module>.<fn>: async fn(input: GenerateFnInput) -> GenerateFnOutput, or the "
        "old form async fn(args, sample, sampling_params) -> Sample; built-ins: "
        "miles_platform.rollout.generate_hub.{single_turn,multi_turn}.generate",
    )
    rollout_max_concurrency: int = flag(
        64, "rollout", "max in-flight generate requests (per-sample generate functions: samples in flight)"
    )

    @property
    def uses_sft_rollout(self) -> bool:
        """Miles' SFT: the rollout function hands out finished conversations (messages kept as such)."""
        return self.rollout_function_path in SFT_ROLLOUT_PATHS

    def chat_template_kwargs(self) -> dict:
        """--apply-chat-template-kwargs as a dict (empty when unset)."""
        return template_kwargs(self.apply_chat_template_kwargs)

    def _check_chat_template_kwargs(self) -> None:
        """Parsed, and refused where no chat template is rendered with them."""
        if not self.chat_template_kwargs():
            return
        multi_turn = (self.custom_generate_function_path or "").endswith("multi_turn.generate")
        if self.uses_sft_rollout:
            raise ConfigError(
                "--apply-chat-template-kwargs: the SFT rollout renders its conversations with the template's "
                "defaults (the loss masks follow that rendering); drop the flag"
            )
        if not (self.apply_chat_template or self.use_session_server or multi_turn):
            raise ConfigError(
                "--apply-chat-template-kwargs: this run renders no chat template (add --apply-chat-template, "
                "--use-session-server or the multi-turn generate function)"
            )

    @property
    def uses_global_dataset(self) -> bool:
        """The run reads --prompt-data into its own data source (not a replay, a custom source, or none)."""
        return not (
            self.load_debug_rollout_data or self.data_source_path or self.disable_rollout_global_dataset
        )

    def _check_data_source_flags(self) -> None:
        """--data-source-path / --disable-rollout-global-dataset where they have an effect (Miles' rules)."""
        if self.load_debug_rollout_data and (self.data_source_path or self.disable_rollout_global_dataset):
            raise ConfigError(
                "--data-source-path / --disable-rollout-global-dataset: --load-debug-rollout-data replays "
                "rollouts and reads no prompts"
            )
        if self.disable_rollout_global_dataset:
            missing = [f for f, bad in (("--rollout-function-path", not self.rollout_function_path),
                                        ("--num-rollout", self.num_rollout is None)) if bad]  # fmt: skip
            if missing:
                raise ConfigError(
                    f"--disable-rollout-global-dataset needs {' and '.join(missing)} (as Miles: without the "
                    "global dataset a custom rollout function brings the data, and the run cannot count rollouts)"
                )
            if self.prompt_data and not self.data_source_path:
                raise ConfigError(
                    "--disable-rollout-global-dataset: --prompt-data would not be read; drop one (a "
                    "--data-source-path class may read args.prompt_data itself)"
                )

    def _check_sft_rollout(self) -> None:
        if not self.uses_sft_rollout:
            return
        wrong = [f for f, bad in (("--loss-type sft_loss", self.loss_type != "sft_loss"),
                 ("--debug-train-only", not self.debug_train_only),
                 ("--n-samples-per-prompt 1", self.n_samples_per_prompt != 1)) if bad]  # fmt: skip
        if wrong:
            raise ConfigError(
                f"--rollout-function-path {self.rollout_function_path} (SFT: each record is a finished "
                f"conversation, nothing is generated) needs {', '.join(wrong)}, as Miles' SFT scripts pass"
            )


@dataclass
class SamplingFlags:
    rollout_max_response_len: int = flag(
        32, "sampling", "max tokens per response (Miles: required; small CPU default)"
    )
    rollout_temperature: float = flag(1.0, "sampling", "sampling temperature")
    rollout_top_p: float = flag(1.0, "sampling", "top-p truncation")
    rollout_top_k: int = flag(-1, "sampling", "top-k truncation (-1 disables)")
    rollout_stop: list[str] = flag([], "sampling", "stop strings", nargs="*")
    rollout_stop_token_ids: list[int] = flag(
        [], "sampling", "stop token ids (EOS is always a stop)", nargs="*"
    )

    def _check_sampling_flags(self) -> None:
        """Training samples need a positive temperature; truncated sampling needs a bounded support
        and a support-normalized actor score, which reference KL cannot use."""
        if self.rollout_max_response_len is not None and self.rollout_max_response_len <= 0:
            raise ConfigError(f"--rollout-max-response-len must be > 0, got {self.rollout_max_response_len}")
        if not self.rollout_temperature > 0:
            raise ConfigError(
                f"--rollout-temperature {self.rollout_temperature}: training samples need a positive "
                "temperature (the trainer scores log_softmax(logits / T)); greedy decoding is for eval "
                "(--eval-temperature 0)"
            )
        if self.rollout_top_p < 1 and self.rollout_top_k <= 0:
            raise ConfigError(
                f"--rollout-top-p {self.rollout_top_p} needs a positive --rollout-top-k: sampling-support "
                "replay records each token's support, which must be bounded (e.g. --rollout-top-k 64)"
            )
        if self.sampling_support_replay():
            clash = [f for f, on in (("--use-kl-loss", self.use_kl_loss), (f"--kl-coef {self.kl_coef}", self.kl_coef != 0)) if on]  # fmt: skip
            if clash:
                raise ConfigError(
                    f"{' and '.join(clash)} with sampling-support replay (--rollout-top-k "
                    f"{self.rollout_top_k}, --rollout-top-p {self.rollout_top_p}): reference KL needs a "
                    "full-vocabulary actor score and replay gives a support-normalized one; Miles rejects "
                    "the combination too. Drop the KL or sample with --rollout-top-k -1 --rollout-top-p 1"
                )

    def sampling_support_replay(self) -> bool:
        """Miles' sampling-support replay: on whenever rollouts sample from a truncated distribution."""
        return self.rollout_top_p < 1 or self.rollout_top_k > 0


@dataclass
class AsyncFlags:
    fully_async: bool = flag(False, "async", "background generation with a bounded buffer")
    train_async: bool = flag(
        False,
        "async",
        "Miles' train_async.py loop (set by `miles-platform train-async`): rollout k+1 generates while "
        "rollout k trains and each weight update waits for it, so rollout k+1 comes from the weights "
        "rollout k-1 made (one step off-policy); with --fully-async the fully async worker instead",
    )
    async_unused_samples_handler: str = flag(
        "drop",
        "async",
        "a group training does not use (aborted, or past --max-weight-staleness): drop it, or retry "
        "(its prompt goes back to the data source)",
        choices=("drop", "retry"),
    )
    max_weight_staleness: int | None = flag(
        None, "async", "drop groups whose oldest version lags the engine by more"
    )
    async_data_buffer_capacity_factor: float = flag(
        2.0,
        "async",
        "the data buffer holds floor(factor x --rollout-batch-size) groups; full: the worker blocks",
    )
    async_max_concurrent_samples: int | None = flag(
        None, "async", "in-flight cap in trajectories, floored to value // --n-samples-per-prompt groups "
        "(default: --rollout-batch-size groups)"
    )  # fmt: skip
    rollout_submission_granularity: str | None = flag(
        None,
        "async",
        "what frees a submission slot: each finished sample, or the whole group (default: sample under "
        "--fully-async, group otherwise)",
        choices=("group", "sample"),
    )
    custom_async_data_buffer_path: str | None = flag(
        None, "async", "the fully async data buffer: <module>.<Class>, a subclass of "
        "miles_platform.rollout.data_buffer.DataBuffer (docs/rollout.md)"
    )  # fmt: skip

    def _check_async_flags(self) -> None:
        if self.fully_async or self.train_async:
            self._check_off_policy_correction()
        if self.train_async and not self.fully_async:  # the one-step overlap (loop.py RolloutAhead)
            self._check_one_step_overlap()
        if not self.fully_async:
            only_async = [f for f, on in (
                (f"--async-unused-samples-handler {self.async_unused_samples_handler}",
                 self.async_unused_samples_handler != "drop"),
                (f"--max-weight-staleness {self.max_weight_staleness}", self.max_weight_staleness is not None),
                (f"--async-data-buffer-capacity-factor {self.async_data_buffer_capacity_factor}",
                 self.async_data_buffer_capacity_factor != 2.0),
                (f"--async-max-concurrent-samples {self.async_max_concurrent_samples}",
                 self.async_max_concurrent_samples is not None),
                (f"--custom-async-data-buffer-path {self.custom_async_data_buffer_path}",
                 bool(self.custom_async_data_buffer_path)),
                ("--rollout-submission-granularity sample", self.rollout_submission_granularity == "sample"),
            ) if on]  # fmt: skip
            if only_async:
                raise ConfigError(
                    f"{', '.join(only_async)} shape the fully async worker and its data buffer; without "
                    "--fully-async a rollout is one batched request per round and nothing is buffered "
                    "across steps: add --fully-async (or train-async) or drop the flag"
                )
            return
        if self.pause_generation_mode == "abort":
            raise ConfigError("--fully-async rejects --pause-generation-mode abort (use retract or in_place)")
        clash = [f for f, on in (
            (f"--over-sampling-batch-size {self.over_sampling_batch_size}", self.over_sampling_batch_size),
            (f"--buffer-filter-path {self.buffer_filter_path}", self.buffer_filter_path),
        ) if on]  # fmt: skip
        if clash:
            raise ConfigError(
                f"--fully-async does not take {', '.join(clash)}: the worker submits one group at a time as "
                "slots free (no over-sampling rounds) and its data buffer picks groups first in first out "
                "(--custom-async-data-buffer-path replaces it)"
            )

    def _check_off_policy_correction(self) -> None:
        """Miles' validate_async_off_policy_correction: an async PPO run's rollouts come from older
        weights than the actor that recomputes the ratio's old log-probs, so the behaviour policy must
        be chosen explicitly (Miles' third choice, --keep-old-actor, is not built here)."""
        if self.uses_critic and not (self.use_rollout_logprobs or self.use_tis):
            mode = "--fully-async" if self.fully_async else "train-async"
            raise ConfigError(
                f"{mode} with --advantage-estimator ppo: rollouts are generated before the current weight "
                "update while the old log-probs are recomputed by the current actor, so PPO needs an explicit "
                "behaviour-policy correction (as Miles requires): add --use-rollout-logprobs (the engine's "
                "log-probs are the ratio's denominator) or --use-tis (truncated importance sampling)"
            )

    def _check_one_step_overlap(self) -> None:
        """What the one-step overlap loop cannot run, before Ray starts, naming why."""
        nothing = [f for f, on in (
            ("--debug-train-only", self.debug_train_only),
            ("--load-debug-rollout-data", bool(self.load_debug_rollout_data)),
            ("--debug-rollout-only", self.debug_rollout_only),
        ) if on]  # fmt: skip
        if nothing:
            raise ConfigError(
                f"--train-async with {', '.join(nothing)}: the run does not both generate and train, so there "
                "is nothing to overlap; drop --train-async (`miles-platform train-async` leaves it unset here)"
            )
        if self.colocate or self.offload_train or self.offload_rollout:
            raise ConfigError(
                "train-async generates the next rollout while the trainer trains: it cannot share the engines' "
                "devices (--colocate; Miles asserts `not args.colocate` too) or take their memory away "
                "(--offload-train / --offload-rollout); use `miles-platform train` for a colocated run"
            )
        if self.data_source_path:
            raise ConfigError(
                f"train-async with --data-source-path {self.data_source_path}: rollout k+1 takes its prompts "
                "before rollout k's checkpoint, and the class's save(rollout_id) records only its live position, "
                "so a resume would skip them; use `miles-platform train` or add --fully-async"
            )


def derive_batch_knobs(cfg) -> None:
    """rollout_batch_size * n_samples_per_prompt = global_batch_size * num_steps_per_rollout."""
    rbs, n, gbs, steps = (
        cfg.rollout_batch_size,
        cfg.n_samples_per_prompt,
        cfg.global_batch_size,
        cfg.num_steps_per_rollout,
    )

    def state() -> str:
        return (
            f"--rollout-batch-size={rbs} x --n-samples-per-prompt={n} must equal "
            f"--global-batch-size={gbs} x --num-steps-per-rollout={steps}"
        )

    if rbs is None:
        raise ConfigError(f"--rollout-batch-size is required ({state()})")
    if rbs <= 0 or n <= 0 or (gbs is not None and gbs <= 0) or (steps is not None and steps <= 0):
        raise ConfigError(f"batch knobs must be positive: {state()}")
    total = rbs * n
    if gbs is None and steps is None:
        steps = 1
    if gbs is None:
        if total % steps:
            raise ConfigError(
                f"cannot derive --global-batch-size: {total} not divisible by {steps}: {state()}"
            )
        gbs = total // steps
    elif steps is None:
        if total % gbs:
            raise ConfigError(
                f"cannot derive --num-steps-per-rollout: {total} not divisible by {gbs}: {state()}"
            )
        steps = total // gbs
    if gbs * steps != total:
        raise ConfigError(f"contradictory batch knobs: {state()} ({total} != {gbs * steps})")
    cfg.global_batch_size, cfg.num_steps_per_rollout = gbs, steps


def template_kwargs(value: str | dict | None) -> dict:
    """--apply-chat-template-kwargs (JSON text, or a mapping from YAML / the Launchpad) as a dict."""
    if not value:
        return {}
    return dict(json_flag(value, "--apply-chat-template-kwargs", dict, "a JSON object"))
