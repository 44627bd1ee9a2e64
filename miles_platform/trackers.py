"""Experiment trackers, as in Miles: each rollout's metric dict to wandb and/or TensorBoard.

    --use-wandb [--wandb-project P --wandb-group G --wandb-mode offline --wandb-dir D --wandb-run-id ID]
    --use-tensorboard [--tensorboard-dir D]
    --log-rollout-samples N
    --custom-rollout-log-function-path pkg.mod.log_rollout_data
    --custom-eval-rollout-log-function-path pkg.mod.log_eval_rollout_data

The loop hands `Trackers` the metric dict it reports per rollout (keys under Miles' `train/`,
`rollout/`, `perf/`, `eval/<dataset>/<key>`), logged with the rollout id as step (`rollout/step`),
and with --log-rollout-samples every --log-interval rollouts its first N samples (a wandb table,
TensorBoard text), both under `rollout/samples`.

A relaunch that resumes follows its run: the wandb run's id (and group and name) is kept in the
checkpoint dir (`wandb_run.json` beside `run_config.json`) when wandb starts, and a resume continues
that run (`resume="allow"`; an explicit --wandb-run-id wins); TensorBoard's writer starts with
`purge_step` at the resumed rollout, so the steps the crashed process logged past its checkpoint
are dropped by TensorBoard's readers and each step shows once (wandb keeps the points it got: a
resumed history shows the abandoned rollouts' points beside the new ones at the same `rollout/step`).
The custom functions have Miles' signatures and are called before the default logging; a truthy
return leaves what that call covers (the rollout's generation metrics, or one eval's metrics) out
of the default logging: the stdout line and the trackers. The `metrics` and `evals` tables
record everything either way.
"""

from __future__ import annotations

import glob
import json
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
WANDB_RUN = "wandb_run.json"  # a checkpoint dir's record of its run's wandb run: a resume continues it
SAMPLES_KEY = "rollout/samples"
SAMPLE_COLUMNS = ("rollout_id", "index", "prompt", "response", "reward", "status")


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
    # --tensorboard-dir also holds --use-pytorch-profiler's traces (Miles')
    inert += (
        ["tensorboard_dir"]
        if cfg.tensorboard_dir and not (cfg.use_tensorboard or cfg.use_pytorch_profiler)
        else []
    )
    inert += (
        ["log_rollout_samples"]
        if cfg.log_rollout_samples and not (cfg.use_wandb or cfg.use_tensorboard)
        else []
    )
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


def checkpoint_start(cfg: RunConfig) -> int:
    """The rollout a launch starts at: past its checkpoint's (--load, else --save), else 0."""
    from miles_platform.training.checkpoint import read_latest

    latest = read_latest(cfg.load or cfg.save)
    return 0 if latest is None else latest + 1


def _read(path: str) -> bytes | None:
    from miles_platform.store import remote

    if remote.is_remote(path):
        return remote.read_bytes(path)
    return open(path, "rb").read() if os.path.isfile(path) else None  # noqa: SIM115


def kept_wandb_run(cfg: RunConfig) -> dict | None:
    """The wandb run a resume continues ({id, group, name}): the one its checkpoint dir names, when
    there is a checkpoint to resume and the record is this run's (None: start a new wandb run)."""
    src = cfg.load or cfg.save
    if not src or checkpoint_start(cfg) == 0:
        return None
    raw = _read(f"{src.rstrip('/')}/{WANDB_RUN}")
    try:
        rec = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and rec.get("run_name") == cfg.run_name and rec.get("id") else None


def keep_wandb_run(cfg: RunConfig, run) -> None:
    """Record the wandb run in the checkpoint dir (--save), for a relaunch that resumes."""
    if not cfg.save:
        return
    from miles_platform.store import remote
    from miles_platform.store.atomic import write_atomic

    data = json.dumps({"run_name": cfg.run_name, "id": run.id, "group": run.group, "name": run.name,
                       "project": run.project}, indent=1)  # fmt: skip
    if remote.is_remote(cfg.save):
        remote.write_bytes(remote.join(cfg.save, WANDB_RUN), data)  # one PUT: atomic
    else:
        os.makedirs(cfg.save, exist_ok=True)
        write_atomic(os.path.join(cfg.save, WANDB_RUN), data)


def sample_rows(rollout_id: int, samples: list, n: int) -> list[list]:
    """The first `n` samples as SAMPLE_COLUMNS rows."""
    rows = []
    for s in samples[:n]:
        prompt = s.prompt if isinstance(s.prompt, str) else json.dumps(s.prompt)
        status = getattr(s.status, "value", s.status)
        rows.append([rollout_id, s.index, prompt, s.response, s.scalar_reward_or_none(), str(status)])
    return rows


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
                self.sinks.append(_TensorBoardSink(tensorboard_dir(cfg, paths), checkpoint_start(cfg)))
        except BaseException:
            self.close(failed=True)
            raise
        for s in self.sinks:
            log(f"[trackers] {s.describe()}")

    def rollout_data(self, rollout_id: int, samples: list, metrics: dict[str, float], t0: float) -> None:
        """Miles' `log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time)`.
        `metrics` is the rollout's dict: keys the function adds are logged (unless it returns True).
        Then --log-rollout-samples: the first N samples to the trackers (unless it returned True)."""
        if self._log_rollout is not None:
            before = set(metrics)
            rollout_time = metrics.get("perf/rollout_time", time.time() - t0)
            if self._log_rollout(rollout_id, self.cfg, samples, metrics, rollout_time):
                self._suppressed |= before | set(metrics)
                return
        n = self.cfg.log_rollout_samples if self.cfg is not None else 0
        if n and self.sinks and rollout_id % self.cfg.log_interval == 0:
            rows = sample_rows(rollout_id, samples, n)
            for s in self.sinks:
                s.log_samples(rollout_id, rows)

    def resume(self, start: int) -> None:
        """The loop starts at rollout `start` (store/recorder.py resume): what a crashed process
        logged from there on is abandoned (TensorBoard's purge_step)."""
        for s in self.sinks:
            s.resume(start)

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

        kept = None if cfg.wandb_run_id else kept_wandb_run(cfg)  # a resume continues its wandb run
        group = cfg.wandb_group or cfg.run_name
        if not cfg.disable_wandb_random_suffix:  # as Miles: group and name get the same suffix
            group = f"{group}_{secrets.token_hex(3)}"
        group, name = (kept.get("group") or group, kept.get("name") or group) if kept else (group, group)
        run_id = cfg.wandb_run_id or (kept["id"] if kept else None)
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
            name=name,
            id=run_id,
            resume="allow" if run_id else None,
            dir=cfg.wandb_dir,
            mode=cfg.wandb_mode,  # None: WANDB_MODE, else online; set, it overrides WANDB_MODE (Miles)
            config=json.loads(saved_config(cfg)),  # the run's flags without the secret (--api-key)
        )
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        self.continued = kept is not None
        keep_wandb_run(cfg, self.run)

    def describe(self) -> str:
        how = ", continues the run its checkpoint dir names" if self.continued else ""
        return f"wandb run {self.run.id} ({self.run.settings.mode}{how}) in {self.run.dir}"

    def log(self, rollout_id: int, metrics: dict[str, float]) -> None:
        self.run.log({**metrics, STEP_KEY: rollout_id})

    def log_samples(self, rollout_id: int, rows: list[list]) -> None:
        import wandb

        self.run.log(
            {SAMPLES_KEY: wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows), STEP_KEY: rollout_id}
        )

    def resume(self, start: int) -> None:
        pass  # the points a crashed process logged stay in the wandb run (module docstring)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class _TensorBoardSink:
    """`start`: the rollout this launch starts at (the checkpoint's; the loop's resume point replaces
    it). Where an earlier launch logged, the writer opens with `purge_step=start`: TensorBoard's
    readers drop that launch's events from `start` on (the rollouts past its checkpoint, logged
    again by this one). Opened at the first event, once the loop said where it starts."""

    def __init__(self, log_dir: str, start: int = 0):
        self.log_dir, self.start, self._writer = log_dir, start, None
        self.earlier = bool(glob.glob(os.path.join(glob.escape(log_dir), "events.out.tfevents.*")))

    @property
    def purge_step(self) -> int | None:
        return self.start if self.earlier or self.start > 0 else None

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir, purge_step=self.purge_step)
        return self._writer

    def resume(self, start: int) -> None:
        if start != self.start:
            if self._writer is not None:  # something was logged before the loop's start was known
                self._writer.close()
                self._writer = None
            self.start = start

    def describe(self) -> str:
        purge = "" if self.purge_step is None else f", steps >= {self.purge_step} of earlier launches dropped"
        return f"tensorboard events in {self.log_dir}{purge}"

    def log_samples(self, rollout_id: int, rows: list[list]) -> None:
        def cell(v) -> str:
            return str(v).replace("|", "\\|").replace("\n", "<br>")

        lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + " --- |" * len(SAMPLE_COLUMNS)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self.writer.add_text(SAMPLES_KEY, "\n".join(lines), global_step=rollout_id)
        self.writer.flush()

    def log(self, rollout_id: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, global_step=rollout_id)
        self.writer.flush()  # a crashed run keeps every rollout it logged

    def close(self, failed: bool) -> None:
        self.writer.close()  # never opened (a run that failed first): an events file all the same
