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
RANGES: dict[str, tuple] = {"log_rollout_samples": NON_NEGATIVE}


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

    def _check_logging_flags(self) -> None:
        if self.wandb_mode is not None and self.wandb_mode not in WANDB_MODES:
            raise ConfigError(f"--wandb-mode {self.wandb_mode!r}: must be one of {', '.join(WANDB_MODES)}")
        train_samples_keep(self.save_train_samples)


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
