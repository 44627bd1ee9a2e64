"""Where a run's outputs go: the storage root and run name (directories and partition keys), and the
experiment trackers (miles_platform/trackers.py), which say where metrics go, never what is trained."""

from __future__ import annotations

import re
from dataclasses import dataclass

from miles_platform.config.flags import NON_NEGATIVE, flag
from miles_platform.errors import ConfigError

WANDB_MODES = ("online", "offline", "disabled")
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
TRAIN_SAMPLES_AUTO_BYTES = 4 << 20  # --save-train-samples auto: a rollout's rows stay under this
RANGES: dict[str, tuple] = {
    "log_rollout_samples": NON_NEGATIVE,
    "profile_step_start": NON_NEGATIVE,
    "profile_step_end": NON_NEGATIVE,
}
PROFILE_TARGETS = ("train_overall", "train_actor", "train_log_probs")


@dataclass
class StorageFlags:
    run_name: str = flag("run", "storage", "run name: partition keys are <run>.v<NNNNNN>")
    storage_root: str = flag(".miles", "storage", "storage root (local dir or any fsspec URI)")


@dataclass
class LoggingFlags:
    use_wandb: bool = flag(False, "logging", "log each rollout's metrics to wandb (the `trackers` extra)")
    wandb_project: str | None = flag(None, "logging", "wandb project")
    wandb_team: str | None = flag(None, "logging", "wandb entity (team) the run is logged under")
    wandb_host: str | None = flag(
        None, "logging", "wandb server URL (WANDB_BASE_URL), for a self-hosted wandb"
    )
    wandb_key: str | None = flag(
        None, "logging", "wandb API key (WANDB_API_KEY); kept out of the saved config and wandb's config"
    )
    wandb_group: str | None = flag(None, "logging", "wandb group and run name (default: --run-name)")
    wandb_mode: str | None = flag(
        None,
        "logging",
        "overrides WANDB_MODE; offline writes under --wandb-dir with no network",
        choices=WANDB_MODES,
    )
    wandb_dir: str | None = flag(None, "logging", "dir wandb writes into (default: ./wandb)")
    wandb_run_id: str | None = flag(
        None, "logging", "wandb run id (default: a resumed run continues the one its checkpoint dir names)"
    )
    disable_wandb_random_suffix: bool = flag(
        False, "logging", "wandb group and name get a random suffix by default; this disables it"
    )
    use_tensorboard: bool = flag(False, "logging", "log each rollout's metrics as TensorBoard scalars")
    tensorboard_dir: str | None = flag(
        None, "logging", "TensorBoard event dir (default: <storage-root>/runs/<run>/tensorboard)"
    )
    log_rollout_samples: int = flag(
        0,
        "logging",
        "every --log-interval rollouts, the rollout's first N samples (prompt, response, reward, status) "
        "to wandb as a table and to TensorBoard as text; 0: none",
    )
    custom_rollout_log_function_path: str | None = flag(
        None,
        "logging",
        "<module>.<fn>(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool, "
        "per rollout; True skips the default logging of its rollout metrics",
    )
    save_train_samples: str = flag(
        "auto",
        "logging",
        "which trained samples get a train_samples row (per token: advantage, trainer and rollout "
        "log-probs, ratio, clip flags, KL to the reference, loss mask; joinable with rollouts): all | none | "
        "N (the first N samples of each rollout) | auto (default: every sample while a rollout's rows stay "
        f"under {TRAIN_SAMPLES_AUTO_BYTES >> 20} MiB, about 8 bytes per value, else the first whole groups "
        "that fit, at least one)",
    )
    custom_eval_rollout_log_function_path: str | None = flag(
        None,
        "logging",
        "<module>.<fn>(rollout_id, args, data, extra_metrics) -> bool, per eval; True skips its default logging",
    )
    log_passrate: bool = flag(
        False,
        "logging",
        "log passrate/pass@<k> of each rollout's prompt groups (k = 1, 2, 4, ... <= --n-samples-per-prompt; "
        "unbiased, a reward of 1 passes) and each eval's eval/<dataset>-pass@<k> over --n-samples-per-eval-prompt",
    )
    use_pytorch_profiler: bool = flag(
        False,
        "logging",
        "torch.profiler on every trainer rank: a gzipped trace of rollouts [--profile-step-start, "
        "--profile-step-end) of this launch in --tensorboard-dir (default <storage-root>/runs/<run>/tensorboard)",
    )
    profile_step_start: int = flag(10, "logging", "--use-pytorch-profiler: the first rollout traced")
    profile_step_end: int = flag(12, "logging", "--use-pytorch-profiler: the rollout the trace stops before")
    profile_target: list[str] = flag(
        ["train_overall"],
        "logging",
        "--use-pytorch-profiler: what is traced, steps counted in train calls (train_overall) or in the "
        "micro-batches of each optimizer step (train_actor) / log-prob pass (train_log_probs; both fsdp)",
        choices=PROFILE_TARGETS,
        nargs="+",
    )

    def _check_logging_flags(self) -> None:
        if self.wandb_mode is not None and self.wandb_mode not in WANDB_MODES:
            raise ConfigError(f"--wandb-mode {self.wandb_mode!r}: must be one of {', '.join(WANDB_MODES)}")
        train_samples_keep(self.save_train_samples)
        self._check_profiler_flags()
        eval_groups = (
            bool(self.eval_prompt_data and self.eval_interval) and self.n_samples_per_eval_prompt > 1
        )
        if self.log_passrate and self.n_samples_per_prompt == 1 and not eval_groups:
            raise ConfigError(
                "--log-passrate: pass@k of prompt groups, and --n-samples-per-prompt is 1 (Miles logs nothing "
                "then); for evals it needs --n-samples-per-eval-prompt > 1"
            )

    def _check_profiler_flags(self) -> None:
        """Miles' profiler flags where they trace something; refused, naming why, where they would not."""
        from miles_platform.config.flags import changed_flags

        knobs = changed_flags(self, ("profile_step_start", "profile_step_end", "profile_target"))
        if knobs and not self.use_pytorch_profiler:
            raise ConfigError(f"{', '.join(knobs)}: settings of --use-pytorch-profiler; add it")
        if not self.use_pytorch_profiler:
            return
        if self.debug_rollout_only:
            raise ConfigError(
                "--use-pytorch-profiler traces the trainer ranks; --debug-rollout-only trains nothing"
            )
        start, end = self.profile_step_start, self.profile_step_end
        if end <= start:
            raise ConfigError(
                f"--profile-step-end {end} must be > --profile-step-start {start} (the steps traced)"
            )
        d = self.tensorboard_dir or self.storage_root
        if "://" in d:
            raise ConfigError(
                f"--use-pytorch-profiler writes its traces to a local dir, not {d}: pass --tensorboard-dir <local dir>"
            )
        if "train_overall" in self.profile_target and self.num_rollout is not None and end > self.num_rollout:
            raise ConfigError(
                f"--profile-step-end {end}: the train_overall trace is written when rollout {end - 1} of this launch "
                f"has trained, and --num-rollout is {self.num_rollout}: lower --profile-step-start / -end "
                "(Miles' defaults are 10 and 12)"
            )
        self._check_loop_profiler()

    def _check_loop_profiler(self) -> None:
        """--profile-target train_actor / train_log_probs: fsdp, and loops long enough for the window."""
        loops = sorted(set(self.profile_target) - {"train_overall"})
        if not loops:
            return
        if self.train_backend != "fsdp":
            raise ConfigError(
                f"--profile-target {' '.join(loops)}: a profiler per micro-batch loop is fsdp only (Miles' megatron "
                "backend refuses it too: pipeline stages run the micro-batches); train_overall traces whole train calls"
            )
        ranks = self.actor_num_nodes * self.actor_num_gpus_per_node
        if self.use_dynamic_batch_size or not self.global_batch_size:
            return  # micro-batches by token budget: their count is the data's
        per_step = self.global_batch_size // max(ranks * self.micro_batch_size, 1)
        counts = {"train_actor": per_step, "train_log_probs": per_step * (self.num_steps_per_rollout or 1)}
        short = [t for t in loops if self.profile_step_end > counts[t]]
        if short:
            raise ConfigError(
                f"--profile-step-end {self.profile_step_end} with --profile-target {' '.join(short)}: steps are a "
                f"rank's micro-batches there, {counts[short[0]]} per loop here (--global-batch-size / ranks / "
                "--micro-batch-size): lower --profile-step-start / -end"
            )


def train_samples_keep(value: str | int) -> str | int:
    """--save-train-samples as the trainer reads it: 'all', 'none', 'auto' or a sample count >= 0."""
    text = str(value).strip().lower()
    if text in ("all", "none", "auto"):
        return text
    if text.isdigit():
        return int(text)
    raise ConfigError(
        f"--save-train-samples {value!r}: must be all, none, auto or a number of samples per rollout (>= 0)"
    )


def check_run_name(name: str) -> None:
    """A run name becomes a directory (`run=<name>`) and a partition key: letters, digits, '.',
    '_' and '-', starting with a letter or digit, at most 128 characters (no '/', no '..')."""
    if not isinstance(name, str) or not RUN_NAME.fullmatch(name):
        raise ConfigError(
            f"--run-name {name!r}: use letters, digits, '.', '_' and '-' (starting with a letter or digit, "
            "at most 128 characters): it names directories under the storage root and partition keys"
        )
