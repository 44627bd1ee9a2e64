"""Experiment trackers, as in Miles: each rollout's metric dict to wandb and/or TensorBoard.

    --use-wandb [--wandb-project P --wandb-group G --wandb-mode offline --wandb-dir D --wandb-run-id ID]
    --use-tensorboard [--tensorboard-dir D]
    --custom-rollout-log-function-path pkg.mod.log_rollout_data
    --custom-eval-rollout-log-function-path pkg.mod.log_eval_rollout_data

The loop hands `Trackers` the metric dict it reports per rollout (keys under Miles' `train/`,
`rollout/`, `perf/`, `eval/<dataset>/<key>`), logged with the rollout id as step (`rollout/step`).
The custom functions have Miles' signatures and are called before the default logging; a truthy
return leaves what that call covers (the rollout's generation metrics, or one eval's metrics) out
of the default logging: the stdout line and the trackers. The `metrics` and `evals` tables
record everything either way.
"""

from __future__ import annotations

import math
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

from miles_platform.config import ConfigError, RunConfig
from miles_platform.plugins import load_function

STEP_KEY = "rollout/step"  # Miles' step key of rollout metrics; here every metric plots against it
_INSTALL = "pip install 'miles-platform[trackers]'"
_WANDB_FLAGS = ("wandb_project", "wandb_team", "wandb_host", "wandb_key", "wandb_group", "wandb_mode",
                "wandb_dir", "wandb_run_id", "disable_wandb_random_suffix")  # fmt: skip


def load_log_functions(cfg: RunConfig) -> tuple[Callable[..., Any] | None, Callable[..., Any] | None]:
    """The custom rollout / eval log functions, checked against Miles' signatures."""
    rollout = eval_ = None
    if cfg.custom_rollout_log_function_path:
        # log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool
        rollout = load_function(cfg.custom_rollout_log_function_path, "--custom-rollout-log-function-path", 5)
    if cfg.custom_eval_rollout_log_function_path:
        # log_eval_rollout_data(rollout_id, args, data, extra_metrics) -> bool
        eval_ = load_function(
            cfg.custom_eval_rollout_log_function_path, "--custom-eval-rollout-log-function-path", 4
        )
    return rollout, eval_


def validate_trackers(cfg: RunConfig, paths) -> None:
    """Before Ray starts: the packages are there, the dirs are local, the custom functions load,
    and no tracker flag is set without its tracker (it would do nothing: refused, not ignored)."""
    inert = [f for f in _WANDB_FLAGS if not cfg.use_wandb and getattr(cfg, f) not in (None, False)]
    inert += ["tensorboard_dir"] if cfg.tensorboard_dir and not cfg.use_tensorboard else []
    if inert:
        names = ", ".join("--" + f.replace("_", "-") for f in inert)
        raise ConfigError(f"{names}: set without --use-wandb / --use-tensorboard, so nothing would be logged")
    load_log_functions(cfg)
    if cfg.use_wandb and cfg.wandb_mode != "disabled":
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError(f"--use-wandb needs the wandb package: {_INSTALL}") from None
    if cfg.use_tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError(f"--use-tensorboard needs the tensorboard package: {_INSTALL}") from None
        d = tensorboard_dir(cfg, paths)
        if "://" in d:
            raise ConfigError(
                f"--use-tensorboard writes a local dir, not {d}: pass --tensorboard-dir <local dir>"
            )


def tensorboard_dir(cfg: RunConfig, paths) -> str:
    return cfg.tensorboard_dir or paths.join("runs", cfg.run_name, "tensorboard")


class Trackers:
    """The run's sinks and custom log functions. Without flags it does nothing (and imports nothing)."""

    def __init__(self, cfg: RunConfig | None = None, paths=None, log: Callable[[str], None] = print):
        self.cfg, self.sinks, self._suppressed = cfg, [], set()
        self._log_rollout = self._log_eval = None
        if cfg is None:
            return
        self._log_rollout, self._log_eval = load_log_functions(cfg)
        try:
            if cfg.use_wandb and cfg.wandb_mode != "disabled":
                self.sinks.append(_WandbSink(cfg))
            if cfg.use_tensorboard:
                self.sinks.append(_TensorBoardSink(tensorboard_dir(cfg, paths)))
        except BaseException:
            self.close(failed=True)
            raise
        for s in self.sinks:
            log(f"[trackers] {s.describe()}")

    def rollout_data(self, rollout_id: int, samples: list, metrics: dict[str, float], t0: float) -> None:
        """Miles' `log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time)`.
        `metrics` is the rollout's dict: keys the function adds are logged (unless it returns True)."""
        if self._log_rollout is None:
            return
        before = set(metrics)
        rollout_time = metrics.get("perf/rollout_time", time.time() - t0)
        if self._log_rollout(rollout_id, self.cfg, samples, metrics, rollout_time):
            self._suppressed |= before | set(metrics)

    def eval_data(self, rollout_id: int, data: dict[str, dict], metrics: dict[str, float]) -> bool:
        """Miles' `log_eval_rollout_data(rollout_id, args, data, extra_metrics)`; `data` is the eval's
        per-dataset result (`pass@1` greedy, `pass@<n>(T=<T>)`, `mean_reward@<n>(T=<T>)`, `n`, ...).
        True: default logging skipped."""
        if self._log_eval is None:
            return False
        before = set(metrics)
        if self._log_eval(rollout_id, self.cfg, data, metrics):
            self._suppressed |= before | set(metrics)
            return True
        return False

    def log(self, rollout_id: int, metrics: dict[str, float]) -> dict[str, float]:
        """Log one rollout's metrics at step `rollout_id`; returns what the default logging shows
        (the metrics less those a custom log function took over since the last call)."""
        shown = {k: v for k, v in metrics.items() if k not in self._suppressed}
        self._suppressed = set()
        scalars = {k: float(v) for k, v in shown.items() if _is_scalar(v)}
        if scalars:
            for s in self.sinks:
                s.log(rollout_id, scalars)
        return shown

    def close(self, failed: bool = False) -> None:
        """Flush and close every sink; a failed run is marked failed (wandb exit code 1)."""
        sinks, self.sinks = self.sinks, []
        for s in sinks:
            try:
                s.close(failed)
            except Exception as e:  # a tracker that cannot close must not hide the run's own error
                print(f"[trackers] closing {type(s).__name__}: {type(e).__name__}: {e}", flush=True)


def _is_scalar(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


class _WandbSink:
    def __init__(self, cfg: RunConfig):
        import json

        import wandb

        from miles_platform.config import saved_config

        group = cfg.wandb_group or cfg.run_name
        if not cfg.disable_wandb_random_suffix:  # as Miles: group and name get the same suffix
            group = f"{group}_{secrets.token_hex(3)}"
        if cfg.wandb_dir:
            os.makedirs(cfg.wandb_dir, exist_ok=True)
        # Miles' --wandb-key / --wandb-host: what wandb reads from its environment (no argv, no config)
        for var, value in (("WANDB_API_KEY", cfg.wandb_key), ("WANDB_BASE_URL", cfg.wandb_host)):
            if value:
                os.environ[var] = value
        self.run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_team,
            group=group,
            name=group,
            id=cfg.wandb_run_id,
            resume="allow" if cfg.wandb_run_id else None,
            dir=cfg.wandb_dir,
            mode=cfg.wandb_mode,  # None: WANDB_MODE, else online; set, it overrides WANDB_MODE (Miles)
            config=json.loads(saved_config(cfg)),  # the run's flags without the secret (--api-key)
        )
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)

    def describe(self) -> str:
        return f"wandb run {self.run.id} ({self.run.settings.mode}) in {self.run.dir}"

    def log(self, rollout_id: int, metrics: dict[str, float]) -> None:
        self.run.log({**metrics, STEP_KEY: rollout_id})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class _TensorBoardSink:
    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir)

    def describe(self) -> str:
        return f"tensorboard events in {self.log_dir}"

    def log(self, rollout_id: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, global_step=rollout_id)
        self.writer.flush()  # a crashed run keeps every rollout it logged

    def close(self, failed: bool) -> None:
        self.writer.close()
