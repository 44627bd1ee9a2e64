"""The train loop, as in Miles' train.py: generate -> store shard -> train -> update weights -> save.

    for rollout_id in range(start_rollout_id, num_rollout):
        samples = rollout_manager.generate(rollout_id)
        store.write_shard(rollout_id, samples)
        actor.train(rollout_id, samples)
        actor.update_weights()          # new policy version, HF export, engines load it
        if save due: actor.save(rollout_id)
        report materializations + metrics

Runs without Dagster (`miles-platform train ...`); the Dagster op passes a Reporter to turn
each policy version into asset materializations. The processes live in `run_services.py`, the
checks before them in `preflight.py`, the records in `store/`.
"""

from __future__ import annotations

import json
import sys
import time

from miles_platform.config import RunConfig, parse_run_config
from miles_platform.errors import ActorDied, NonFiniteTraining
from miles_platform.preflight import check_batch_fits, fill_defaults, validate_before_start
from miles_platform.run_types import CITestFailure, PolicyVersion, Reporter, RunResult
from miles_platform.store.paths import StoragePaths
from miles_platform.store.remote import exists  # a local path or an object-store URI
from miles_platform.training.ci_checks import step0_checks

__all__ = ["CITestFailure", "PolicyVersion", "RLRun", "Reporter", "RunResult", "train", "validate_before_start"]  # fmt: skip

LOG_KEYS = ("rollout/raw_reward", "train/loss", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl",
            "train/grad_norm", "train/train_rollout_logprob_abs_diff", "perf/rollout_time",
            "perf/actor_train_time", "perf/update_weights_time")  # fmt: skip


class RLRun:
    """One `train`: validate, start the run's services, resume where the checkpoint left off, loop
    over rollouts, record every policy version, tear down in order (see run_services.py)."""

    def __init__(self, cfg: RunConfig, reporter: Reporter | None = None):
        self.cfg, self.reporter, self.paths = cfg, reporter or Reporter(), StoragePaths(cfg.storage_root)
        self.nonfinite: list[int] = []  # the rollout of each optimizer step skipped for a NaN / inf

    def run(self) -> RunResult:
        from miles_platform.models.checkpoint import content_hash, load_tokenizer
        from miles_platform.rollout.loop_eval import eval_before_train
        from miles_platform.run_services import RunServices, actor_died
        from miles_platform.store.run_state import note_resume, recorded_max_version
        from miles_platform.weights.sync import initial_sync

        cfg = self.cfg
        validate_before_start(cfg)
        tok = load_tokenizer(cfg.hf_checkpoint)
        src = None
        if not cfg.load_debug_rollout_data:
            from miles_platform.data.dataset import content_hash as data_hash
            from miles_platform.data.source import RolloutDataSource

            src = RolloutDataSource.from_config(cfg, tokenizer=tok)
            check_batch_fits(cfg, len(src))
        fill_defaults(cfg, self.paths, len(src) if src else 1)
        self.base_version, self.data_version = content_hash(cfg.hf_checkpoint), src and data_hash(src.records)
        with RunServices(cfg, self.paths, self.reporter, tok, src) as s:
            self.s, state = s, s.state
            start = 0 if state is None else state["rollout_id"] + 1
            version = 0 if state is None else int(state["weight_version"])
            # versions a crashed run made after its last checkpoint keep their numbers: new ones continue
            # after the highest any store knows, branching from the checkpoint's (no key is reused)
            self.highest = max(version, recorded_max_version(cfg, self.paths))
            # a relaunch abandons what a stopped run made after the checkpoint (store/run_events.py);
            # an allowed config change goes into the next version's lineage
            self.config_changed_from = note_resume(cfg, self.paths, self.reporter, state, self.highest,
                                                   s.config_changes)  # fmt: skip
            if s.session is not None:
                initial_sync(cfg, self.paths, s, version, state is not None, self.base_version)
            initial_eval = eval_before_train(cfg, self.paths, s, self.reporter, start, version)
            s.start_async_worker()
            try:
                result = self._loop(start, version)
            except Exception as e:
                died = actor_died(cfg, e, s.hooks.due_in_ranks())
                if died is None:
                    raise
                raise died from e
            result.eval_before_train = initial_eval
            return result

    def _loop(self, start: int, version: int) -> RunResult:
        from miles_platform.rollout.loop_eval import eval_due, evaluate_and_log
        from miles_platform.store.debug_rollouts import load_debug_rollout, save_debug_rollout
        from miles_platform.store.run_state import save_hf_copy
        from miles_platform.store.shards import write_rollout_shard
        from miles_platform.training.actor import TrainBatch
        from miles_platform.training.checkpoint import iter_dir
        from miles_platform.weights.sync import publish_version

        cfg, s, run = self.cfg, self.s, self.cfg.run_name
        last = self.paths.hf_export(run, version)
        result = RunResult(
            run, start, start - 1, version, last if exists(f"{last}/model.safetensors") else None
        )
        hook = s.hooks
        for rollout_id in range(start, cfg.num_rollout):
            t0, hook.rollout_id = time.time(), rollout_id
            hook.fire("orchestrator_step_start")
            if cfg.load_debug_rollout_data:
                samples, metrics = load_debug_rollout(cfg, rollout_id), {}
            elif s.worker is not None:
                samples, metrics = s.worker.get_rollout(rollout_id, version)
            else:
                samples, metrics = s.manager.generate(rollout_id)
            s.trackers.rollout_data(rollout_id, samples, metrics, t0)
            shard = write_rollout_shard(self.paths, run, rollout_id, samples)
            if cfg.save_debug_rollout_data:
                save_debug_rollout(cfg, rollout_id, samples)
            hook.fire("rollout_end")
            if not s.trainers:  # --debug-rollout-only
                self._finish_rollout(result, rollout_id, metrics, t0, version)
                continue
            hook.fire("trainer_controller_step_start")
            metrics.update(self._train(rollout_id, TrainBatch.from_samples(samples)))
            hook.fire("trainer_controller_step_end")
            self._check_finite(rollout_id, metrics)
            if cfg.ci_test and rollout_id == 0:
                result.ci_checks = step0_checks(cfg, metrics, self.reporter.log)
            hf_dir = None  # the version's policy dir: its HF export, or a LoRA run's adapter dir
            if s.session is not None and (rollout_id + 1) % cfg.update_weights_interval == 0:
                hook.fire("weight_update_start")
                parent, version = version, max(version, self.highest) + 1
                self.highest = version
                hf_dir, m = publish_version(cfg, self.paths, s, version, self.base_version)
                metrics.update(m)
            # the version's row first (naming the checkpoint the rollout will save, when one is due),
            # then its eval and the rollout's metrics, the checkpoint last: a crash anywhere before the
            # checkpoint is complete abandons all of them on resume (store/run_events.py), none is lost
            save_due = bool(cfg.save) and self._save_due(rollout_id)
            if hf_dir is not None:
                ckpt = iter_dir(cfg.save, rollout_id) if save_due else None
                self._record_version(result, version, parent, rollout_id, shard, hf_dir, ckpt)
                hook.fire("version_recorded")
            if s.manager is not None and eval_due(cfg, version, hf_dir):
                hook.fire("eval_start")
                metrics.update(evaluate_and_log(cfg, self.paths, s, self.reporter, version, rollout_id))
            self._finish_rollout(result, rollout_id, metrics, t0, version)
            hook.fire("metrics_recorded")
            if save_due:
                hook.fire("save_start")
                self._save(rollout_id, version)
                hook.fire("save_end")
                if cfg.save_hf and hf_dir is not None:
                    save_hf_copy(cfg, rollout_id, hf_dir)
            hook.fire("orchestrator_step_end")
        return result

    def _check_finite(self, rollout_id: int, metrics: dict) -> None:
        """Skipped steps (NaN / inf loss or gradient) are logged with their rollout; past
        --max-nonfinite-steps in the run, it stops before this rollout's version is published."""
        skipped = int(metrics.get("train/nonfinite_steps", 0))
        if not skipped:
            return
        self.nonfinite += [rollout_id] * skipped
        self.reporter.log(
            f"rollout {rollout_id}: {skipped} optimizer step(s) skipped: non-finite loss or gradient"
        )
        if len(self.nonfinite) > self.cfg.max_nonfinite_steps:
            raise NonFiniteTraining(
                f"{len(self.nonfinite)} optimizer steps had a non-finite loss or gradient (rollouts "
                f"{sorted(set(self.nonfinite))}), more than --max-nonfinite-steps {self.cfg.max_nonfinite_steps}: "
                "the run stopped before publishing rollout "
                f"{rollout_id}'s version. Look at those rollouts' samples (rollouts table) and the loss "
                "settings; relaunching resumes from the last checkpoint"
            )

    def _train(self, rollout_id: int, batch) -> dict[str, float]:
        """Rollout data to the trainer ranks through the object store (`--object-store-backend`)."""
        import dataclasses

        from miles_platform.cluster.object_store import put_rollout_data, store_from_config

        store = store_from_config(self.cfg)
        handle = put_rollout_data(dataclasses.asdict(batch), store)
        try:
            from miles_platform.run_services import call_trainers

            return call_trainers(self.cfg, self.s.trainers, "train", rollout_id, handle)
        finally:
            store.remove(handle)

    def _save(self, rollout_id: int, version: int) -> str:
        extra = {"weight_version": version, "data_source": self.s.data_source_state(), "run": self.cfg.run_name,
                 "config_hash": self.cfg.config_hash()}  # fmt: skip
        from miles_platform.run_services import call_trainers

        return call_trainers(self.cfg, self.s.trainers, "save", rollout_id, extra)

    def _save_due(self, rollout_id: int) -> bool:
        c = self.cfg
        return rollout_id + 1 == c.num_rollout or bool(
            c.save_interval and (rollout_id + 1) % c.save_interval == 0
        )

    def _record_version(self, result: RunResult, version, parent, rollout_id, shard, hf_dir, ckpt) -> None:
        from miles_platform.store.versions import record_policy_version

        pv = record_policy_version(self.cfg, self.paths, version, parent, rollout_id, shard, hf_dir, ckpt,
                                   self.base_version, self.data_version, self.s.teachers,
                                   config_changed_from=self.config_changed_from)  # fmt: skip
        self.config_changed_from = None  # on the first version after the change only
        result.versions.append(pv.to_dict())
        self.reporter.on_policy_version(pv.to_dict())
        result.final_hf_path = pv.hf_path

    def _finish_rollout(
        self, result: RunResult, rollout_id: int, metrics: dict, t0: float, version: int
    ) -> None:
        """Metrics of one rollout: to the `metrics` table, the reporter, the trackers and the result."""
        from miles_platform.store.tables import append_rows

        metrics["perf/rollout_total_time"] = time.time() - t0
        if self.s.monitor is not None:  # --use-fault-tolerance: engines replaced so far in this process
            metrics["rollout/engine_restarts"] = float(self.s.monitor.restarts)
        step = int(metrics.get("train/step", 0))
        rows = [
            {"rollout_id": rollout_id, "step": step, "name": k, "value": float(v)} for k, v in metrics.items()
        ]
        append_rows(self.paths, "metrics", self.cfg.run_name, rows)
        self.reporter.on_rollout(rollout_id, metrics)
        logged = self.s.trackers.log(rollout_id, metrics)  # less what a custom log function took over
        if rollout_id % self.cfg.log_interval == 0:
            shown = " ".join(f"{k}={logged[k]:.4g}" for k in LOG_KEYS if k in logged)
            self.reporter.log(f"rollout {rollout_id}: {shown}")
        result.metrics.append(metrics)
        result.last_rollout_id, result.final_version = rollout_id, version


def train(cfg: RunConfig, reporter: Reporter | None = None) -> RunResult:
    return RLRun(cfg, reporter).run()


def cli_main(argv: list[str]) -> int:
    from miles_platform.cluster.ray_jobs import add_launch_flags, split_launch_flags, submit_cli
    from miles_platform.config import build_parser

    opts, argv = split_launch_flags(argv)
    if "-h" in argv or "--help" in argv:
        parser = build_parser()
        add_launch_flags(parser)
        parser.parse_args(["--help"])  # prints the help and exits 0, as argparse does
    cfg = parse_run_config(argv)
    if opts.submit is not None:
        return submit_cli(cfg, opts)
    try:
        result = train(cfg)
    except (CITestFailure, ActorDied, NonFiniteTraining) as e:
        print(f"miles-platform train: {e}", file=sys.stderr)
        return 1
    out = {"run": result.run, "last_rollout_id": result.last_rollout_id, "final_version": result.final_version,
           "final_hf_path": result.final_hf_path, "ci_checks": result.ci_checks}  # fmt: skip
    print(json.dumps(out))
    return 0
