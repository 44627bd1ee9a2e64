"""The train loop, as in Miles' train.py: generate -> store shard -> train -> update weights -> save.

    for rollout_id in range(start_rollout_id, num_rollout):
        samples = rollout_manager.generate(rollout_id)
        store.write_shard(rollout_id, samples)  # on a thread, beside the train call
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
from concurrent.futures import Future, ThreadPoolExecutor

from miles_platform.config import ConfigError, RunConfig, parse_run_config
from miles_platform.errors import ActorDied, NonFiniteTraining
from miles_platform.preflight import check_batch_fits, fill_defaults, validate_before_start
from miles_platform.run_types import CITestFailure, PolicyVersion, Reporter, RunResult
from miles_platform.startup import StartupClock, bytecode_note
from miles_platform.store.paths import StoragePaths
from miles_platform.store.remote import exists  # a local path or an object-store URI
from miles_platform.training.ci_checks import MetricChecker, rollout_checks

__all__ = ["CITestFailure", "PolicyVersion", "RLRun", "Reporter", "RunResult", "train", "validate_before_start"]  # fmt: skip

LOG_KEYS = ("rollout/raw_reward", "train/loss", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl",
            "train/grad_norm", "train/train_rollout_logprob_abs_diff", "perf/rollout_time",
            "perf/actor_train_time", "perf/update_weights_time")  # fmt: skip


class RLRun:
    """One `train`: validate, start the run's services, resume where the checkpoint left off, loop
    over rollouts, record every policy version, tear down in order (see run_services.py)."""

    def __init__(self, cfg: RunConfig, reporter: Reporter | None = None, startup: StartupClock | None = None):
        self.cfg, self.reporter, self.paths = cfg, reporter or Reporter(), StoragePaths(cfg.storage_root)
        self.startup = startup or StartupClock()  # the phases up to the first rollout (startup.py)
        self.nonfinite: list[int] = []  # the rollout of each optimizer step skipped for a NaN / inf
        self.ahead: RolloutAhead | None = None  # train-async: the next rollout, generating
        self.queued: tuple | None = None  # train-async's pipeline: the next rollout, its train queued
        # each rollout's shard is written beside its train call (taken before its version's record)
        self.shards = ThreadPoolExecutor(1, thread_name_prefix="rollout-shard")

    def run(self) -> RunResult:
        from miles_platform.cluster.ray_cluster import prestart_fork_server

        prestart_fork_server(self.cfg)  # the actors' warm process imports beside what follows
        from miles_platform.models.checkpoint import content_hash, load_tokenizer
        from miles_platform.rollout.loop_eval import eval_before_train
        from miles_platform.run_lifecycle import published_version
        from miles_platform.run_services import RunServices, actor_died
        from miles_platform.store.recorder import VersionRecorder, close_quietly
        from miles_platform.training.qat import check_int4_qat
        from miles_platform.weights.rollout_quant import quantized_serving
        from miles_platform.weights.sync import initial_sync

        cfg = self.cfg
        validate_before_start(cfg)
        for line in cfg.miles_flags_taken():  # Miles flags taken with the same result: say how
            self.reporter.log(f"[miles flags] {line}")
        for line in [*quantized_serving(cfg), check_int4_qat(cfg), bytecode_note()]:  # fp8 / int4, QAT, .pyc
            if line:
                self.reporter.log(line)
        self.startup.mark("preflight")
        tok = load_tokenizer(cfg.hf_checkpoint)
        src = data_source(cfg, tok)
        fill_defaults(cfg, self.paths, len(src) if src else 1)
        self.base_version, self.data_version = content_hash(cfg.hf_checkpoint), data_version(cfg, src)
        self.startup.mark("data")
        with RunServices(cfg, self.paths, self.reporter, tok, src, startup=self.startup) as s:
            # the imports and actors are up: GC again before the initial sync and eval, whose garbage
            # (~6k objects for a 512-prompt eval) is then collected; start-up's (~10k objects, a few
            # MB, 2026-12-07) is frozen with what start-up built
            self.startup.started()
            self.s, state = s, s.state
            self.rec = VersionRecorder(cfg, self.paths, self.reporter, self.base_version, self.data_version,
                                       LOG_KEYS, trackers=s.trackers, teachers=s.teachers,
                                       extra_metrics=s.service_metrics)  # fmt: skip
            # versions a crashed run made after its last checkpoint keep their numbers and are
            # abandoned; an allowed config change goes into the next version's lineage
            start, version = self.rec.resume(state, s.config_changes, published_version(cfg))
            if s.session is not None:
                initial_sync(cfg, self.paths, s, version, state is not None, self.base_version)
            s.colocation.start()  # --offload-train: the trainer leaves the devices to the engines
            initial_eval = eval_before_train(cfg, self.paths, s, self.reporter, start, version)
            self.metric_checker = MetricChecker.maybe_create(cfg)  # --ci-metric-checker-key gate
            if self.metric_checker is not None:
                self.metric_checker.on_eval(initial_eval, self.reporter.log)
            self.startup.mark("resume")
            self.reporter.log(self.startup.summary())  # the first rollout's generation starts now
            s.start_async_worker()
            if cfg.train_async and not cfg.fully_async:  # train-async: Miles' one-step overlap
                self.ahead = RolloutAhead(cfg, s)
            try:
                result = self._loop(start, version)
                if self.metric_checker is not None:
                    self.metric_checker.dispose()
            except Exception as e:
                died = actor_died(cfg, e, s.hooks.due_in_ranks())
                if died is None:
                    raise
                raise died from e
            finally:
                self.shards.shutdown(wait=True)  # a shard being written is whole or absent (atomic)
                close_quietly(self.rec, failed=sys.exc_info()[0] is not None, log=self.reporter.log)
                if self.ahead is not None:  # a rollout still in flight fails with the engines' shutdown
                    self.ahead.pool.shutdown(wait=False, cancel_futures=True)
                if self.queued is not None:  # a failed run: the queued rollout's data leaves the store
                    _, store, handle, _ = self.queued[3]
                    store.remove(handle)
            result.eval_before_train = initial_eval
            return result

    def _loop(self, start: int, version: int) -> RunResult:
        from miles_platform.rollout.loop_eval import eval_due, evaluate_and_log
        from miles_platform.training.checkpoint import iter_dir
        from miles_platform.training.hooks import post_save_hook
        from miles_platform.weights.sync import publish_version, save_hf_copy

        cfg, s, rec, run = self.cfg, self.s, self.rec, self.cfg.run_name
        last = self.paths.hf_export(run, version)
        result = RunResult(
            run, start, start - 1, version, last if exists(f"{last}/model.safetensors") else None
        )
        hook, phase, ahead = s.hooks, s.hooks.phase, self.ahead
        with_weights, pipeline = self._weights_with_train(), self._pipelines()
        for rollout_id in range(start, cfg.num_rollout):
            t0, hook.rollout_id = time.time(), rollout_id
            with phase("step", end=bool(s.trainers)):  # --debug-rollout-only: no phase past the rollout
                with phase("rollout"):
                    if self.queued is not None:  # taken, written, queued while the rollout before it trained
                        samples, metrics, shard, pending = self.queued
                        self.queued = None
                    else:
                        samples, metrics, shard = self._take_rollout(rollout_id, version, t0, launch=True)
                        if rollout_id == start:  # where the start-up went (startup.py)
                            metrics.update(self.startup.metrics())
                        pending = None
                if not s.trainers:
                    shard, metrics["perf/rollout_shard_time"] = shard.result()
                    rec.finish_rollout(result, rollout_id, metrics, t0, version)
                    continue
                s.colocation.after_generate()  # --colocate / --offload-rollout: engines release their memory
                decided = None  # (forced, save due), when decided before the train ends
                with phase("train"):
                    if pending is None:  # the version's weights come back with its train call
                        publishes = (rollout_id + 1) % cfg.update_weights_interval == 0
                        pending = self._submit_train(rollout_id, samples, version, with_weights and publishes)
                    if pipeline and rollout_id + 1 < cfg.num_rollout:
                        # the trainer never waits on the driver: rollout k+1 (generated while k-1
                        # trained) queues behind k unless a checkpoint of k is due, which must hold k's weights
                        decided = rec.save_requested(), rec.save_due(rollout_id)
                        if not decided[1]:
                            self.queued = self._queue_next(rollout_id + 1, version)
                    trained, weights = self._wait_train(pending)
                    metrics.update(trained)
                self._check_finite(rollout_id, metrics)
                if cfg.ci_test:  # Miles' checkers after every rollout; the result keeps rollout 0's
                    checks = rollout_checks(cfg, rollout_id, metrics, self.reporter.log)
                    if rollout_id == 0:
                        result.ci_checks = checks
                hf_dir = None  # the version's policy dir: its HF export, or a LoRA run's adapter dir
                s.colocation.before_weight_update()
                if s.publishes_versions and (rollout_id + 1) % cfg.update_weights_interval == 0:
                    with phase("weight_update"):
                        if ahead is not None:  # Miles: no weight update in the middle of a generation
                            metrics["perf/rollout_wait_time"] = (
                                metrics.get("perf/rollout_wait_time", 0) + ahead.wait()
                            )
                        parent, version = rec.next_version(version)
                        hf_dir, m = publish_version(cfg, self.paths, s, version, self.base_version, weights)
                        metrics.update(m)
                    if self.queued is not None and rollout_id + 2 < cfg.num_rollout:
                        ahead.launch(rollout_id + 2)  # on the version just published, as train_async.py
                s.colocation.after_weight_update()  # --colocate: the trainer parks, the engines resume
                metrics.update(s.colocation.metrics())
                # the row, the eval, the metrics, the checkpoint last (store/recorder.py)
                # --save-trigger-sentinel: a save now, written synchronously
                forced, save_due = decided or (rec.save_requested(), rec.save_due(rollout_id))
                # on disk before anything names it (the version's row, a checkpoint)
                shard, metrics["perf/rollout_shard_time"] = shard.result()
                if hf_dir is not None:
                    with phase("record"):
                        t, ckpt = time.time(), iter_dir(cfg.save, rollout_id) if save_due else None
                        rec.record(result, version, parent, rollout_id, shard, hf_dir, ckpt)
                        metrics["perf/record_version_time"] = time.time() - t
                if s.manager is not None and eval_due(cfg, version, hf_dir):
                    with phase("eval"):
                        evaluated = evaluate_and_log(cfg, self.paths, s, self.reporter, version, rollout_id)
                        metrics.update(evaluated)
                        if self.metric_checker is not None:
                            self.metric_checker.on_eval(evaluated, self.reporter.log)
                with phase("metrics"):
                    rec.finish_rollout(result, rollout_id, metrics, t0, version)
                if save_due:
                    with phase("save"), s.colocation.around_save():
                        self._save(rollout_id, version, sync=forced or rollout_id + 1 == cfg.num_rollout)
                    if forced:  # the checkpoint is durable: "file gone" means "saved" (Miles')
                        rec.save_request_done(rollout_id)
                    hf_copy = cfg.save_hf.format(rollout_id=rollout_id) if cfg.save_hf and hf_dir else None
                    if hf_copy:
                        save_hf_copy(cfg, rollout_id, hf_dir)
                    post_save_hook(cfg, rollout_id, iter_dir(cfg.save, rollout_id), hf_copy)
        if s.trainers:  # the last train call's train_samples rows (written beside the steps) are in
            from miles_platform.run_services import call_trainers

            call_trainers(cfg, s.trainers, "drain_rows")
        return result

    def _weights_with_train(self) -> bool:
        """A publishing rollout's train call hands back the version's weights (one call, not a second
        one to ask for them: ~10 ms a step on the demo) where the driver feeds them to the engines:
        not through the trainer-driven transports (broadcast, colocated) nor for a LoRA adapter."""
        s = self.s
        return s.session is not None and not self.cfg.uses_lora and not s.session.transport.needs_trainers

    def _pipelines(self) -> bool:
        """train-async queues rollout k+1's train behind rollout k's (the trainer hands each version's
        weights back with its train call, so the driver publishes, records and evaluates k while k+1
        trains; the versions each rollout is generated and trained on are train_async.py's). Only
        where nothing between two trains needs the trainer: the weights with the train call
        (`_weights_with_train`), a version every rollout, no offload schedule. A checkpoint's rollout
        never queues the next."""
        return (
            self.ahead is not None
            and self._weights_with_train()
            and self.cfg.update_weights_interval == 1
            and not self.s.colocation.active
        )

    def _take_rollout(
        self, rollout_id: int, version: int, t0: float, launch: bool
    ) -> tuple[list, dict, Future]:
        """The rollout's samples and metrics, and its shard being written (a future: the train call
        need not wait for the file, the version's row does); `launch` (train-async): the next
        rollout starts generating on `version` as soon as this one is taken."""
        from miles_platform.store.debug_rollouts import save_debug_rollout
        from miles_platform.store.shards import shard_table, write_shard_table

        cfg, ahead = self.cfg, self.ahead
        samples, metrics = self._generate(rollout_id, version, t0)
        if launch and ahead is not None and rollout_id + 1 < cfg.num_rollout:
            ahead.launch(rollout_id + 1)  # generates on `version` while this rollout trains
        t = time.time()
        table = shard_table(cfg.run_name, rollout_id, samples)  # as taken, whatever changes them later
        encode = time.time() - t

        def write():  # perf/rollout_shard_time: the table's and the file's own time, not the wait
            t = time.time()
            return write_shard_table(self.paths, cfg.run_name, rollout_id, *table), encode + time.time() - t

        shard = self.shards.submit(write)
        if cfg.save_debug_rollout_data:
            save_debug_rollout(cfg, rollout_id, samples)
        return samples, metrics, shard

    def _queue_next(self, rollout_id: int, version: int) -> tuple:
        """Train-async's pipeline: take rollout `rollout_id` (it was generated while the one before it
        trained), write its shard and queue its train behind the one running; its next rollout is
        launched after the version now training is published (`_loop`). Its rollout_end and
        trainer_controller_step_start hooks fire here, inside the previous rollout's train phase."""
        hook = self.s.hooks
        hook.rollout_id = rollout_id
        try:
            with hook.phase("rollout"):
                samples, metrics, shard = self._take_rollout(rollout_id, version, time.time(), launch=False)
            hook.fire("trainer_controller_step_start")
            # the version it makes: the one after the version the running train makes
            pending = self._submit_train(rollout_id, samples, version, True, later=1)
        finally:
            hook.rollout_id = rollout_id - 1
        return samples, metrics, shard, pending

    def _generate(self, rollout_id: int, version: int, t0: float) -> tuple[list, dict]:
        """The rollout's samples and metrics: from --load-debug-rollout-data, the fully async
        worker, a train-only rollout function (Miles' SFT) or the rollout manager; the custom
        rollout log function sees them first."""
        from miles_platform.store.debug_rollouts import load_debug_rollout

        cfg, s = self.cfg, self.s
        if cfg.load_debug_rollout_data:
            samples, metrics = load_debug_rollout(cfg, rollout_id), {}
        elif self.ahead is not None and self.ahead.launched == rollout_id:
            samples, metrics = self.ahead.take()
        elif s.worker is not None:
            samples, metrics = s.worker.get_rollout(rollout_id, version)
        elif s.train_only is not None:
            samples, metrics = s.train_only.generate(rollout_id)
        else:
            samples, metrics = s.manager.generate(rollout_id)
        if cfg.ci_inject_rollout_data_path and rollout_id >= cfg.ci_inject_rollout_data_start_rollout_id:
            from miles_platform.store.debug_rollouts import inject_rollout

            samples, metrics["ci/inject_match_ratio"] = inject_rollout(cfg, rollout_id, samples)
        if cfg.log_passrate:  # Miles' passrate/pass@<k> of the rollout's prompt groups
            from miles_platform.rollout.passrate import rollout_passrate

            metrics.update(rollout_passrate(samples, cfg.n_samples_per_prompt, cfg.reward_key))
        s.trackers.rollout_data(rollout_id, samples, metrics, t0)
        return samples, metrics

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

    def _submit_train(self, rollout_id: int, samples: list, version: int, with_weights: bool,
                      later: int = 0) -> tuple:  # fmt: skip
        """Rollout data to the trainer ranks through the object store (`--object-store-backend`), their
        train call queued; they record its train_samples rows under the version their steps make
        (`later` versions past the next one; none in a replay). -> what `_wait_train` reads."""
        import dataclasses

        from miles_platform.cluster.object_store import put_rollout_data, store_from_config
        from miles_platform.run_services import submit_trainers
        from miles_platform.training.train_batch import train_data
        from miles_platform.training.train_samples import TrainSamplesTarget

        upcoming = self.rec.upcoming_version(version) + later if self.s.publishes_versions else None
        batch = train_data(self.cfg, samples)
        store = store_from_config(self.cfg)
        # shallow (the store serializes it now): asdict's deep copy of every list cost ~4 ms a step
        fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
        handle = put_rollout_data(fields, store)
        try:
            refs = submit_trainers(self.s.trainers, "train", rollout_id, handle,
                                   TrainSamplesTarget(upcoming, background=True), with_weights)  # fmt: skip
        except BaseException:
            store.remove(handle)
            raise
        return refs, store, handle, with_weights

    def _wait_train(self, pending: tuple) -> tuple[dict[str, float], dict | None]:
        """(the train call's metrics, the version's weights when it was asked for them, else None)."""
        from miles_platform.run_services import wait_trainers
        from miles_platform.weights.transports import decode_state

        refs, store, handle, with_weights = pending
        try:
            out = wait_trainers(self.cfg, refs, "train")
        finally:
            store.remove(handle)
        return (out[0], decode_state(out[1])) if with_weights else (out, None)

    def _save(self, rollout_id: int, version: int, sync: bool = True) -> str:
        """The trainers' checkpoint; with --async-save and not `sync` written in the background (the
        run's last save and a sentinel's are synchronous, so the run ends with its checkpoint on disk)."""
        if hasattr(self.s.src, "saving_rollout_id"):  # --data-source-path: its save(rollout_id)
            self.s.src.saving_rollout_id = rollout_id
        rollout_side = self.ahead.checkpoint_state() if self.ahead is not None else self.s.checkpoint_state()
        extra = {"weight_version": version, **rollout_side, "run": self.cfg.run_name,
                 "config_hash": self.cfg.config_hash()}  # fmt: skip
        from miles_platform.run_services import call_trainers
        from miles_platform.training.checkpoint import prune_checkpoints

        self.rec.flush()  # the rows of every rollout the checkpoint holds are on disk before it
        saved = call_trainers(self.cfg, self.s.trainers, "save", rollout_id, extra, sync)
        if self.cfg.save_retain_interval:
            for path in prune_checkpoints(self.cfg.save, rollout_id, self.cfg.save_retain_interval):
                self.reporter.log(f"--save-retain-interval {self.cfg.save_retain_interval}: deleted {path}")
        return saved


class RolloutAhead:
    """`train-async` without --fully-async, Miles' train_async.py loop: rollout k+1 generates on a
    thread while rollout k trains, and a weight update first waits for it, so rollout k+1 comes from
    the version rollout k-1 made (the first two of a launch from its start version); each sample's
    weight_version_start / _end say which. A checkpoint at rollout k keeps the rollout side as it was
    before k+1 took its prompts: a resume (after a kill -9 too) generates k+1 again from the same ones."""

    def __init__(self, cfg: RunConfig, services):
        from concurrent.futures import ThreadPoolExecutor

        self.cfg, self.s = cfg, services
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead")
        self.future, self.launched, self.state = None, None, None

    def launch(self, rollout_id: int) -> None:
        self.state = self.s.checkpoint_state() if self.cfg.save else None  # before it takes prompts
        self.future, self.launched = self.pool.submit(self.s.manager.generate, rollout_id), rollout_id

    def wait(self) -> float:
        """Block until the launched rollout is generated (its error is raised by `take`); seconds waited."""
        import concurrent.futures

        t = time.time()
        if self.future is not None:
            concurrent.futures.wait([self.future])
        return time.time() - t

    def take(self) -> tuple[list, dict]:
        """The launched rollout's (samples, metrics); `perf/rollout_wait_time`: what the loop waited now
        (the weight update's wait goes to the rollout before it)."""
        waited = self.wait()
        (samples, metrics), self.future, self.launched = self.future.result(), None, None
        return samples, {**metrics, "perf/rollout_wait_time": waited}

    def checkpoint_state(self) -> dict:
        return self.state if self.launched is not None else self.s.checkpoint_state()


def data_source(cfg: RunConfig, tok):
    """The run's data source: --prompt-data read here, the --data-source-path class, or none (a replay;
    --disable-rollout-global-dataset without a class: the rollout function brings its data)."""
    if cfg.data_source_path:
        from miles_platform.data.custom_source import CustomDataSource

        src = CustomDataSource(cfg)
        if not len(src) and cfg.num_rollout is None:
            raise ConfigError(
                f"--data-source-path {cfg.data_source_path}: the source has no .dataset to count rollouts by "
                "(Miles reads len(data_source.dataset)); give --num-rollout"
            )
        return src
    if not cfg.uses_global_dataset:
        return None
    from miles_platform.data.source import RolloutDataSource

    src = RolloutDataSource.from_config(cfg, tokenizer=tok)
    check_batch_fits(cfg, len(src))
    return src


def data_version(cfg: RunConfig, src) -> str | None:
    """The lineage's data version: the prompts' content hash, or the custom source's path."""
    from miles_platform.data.dataset import content_hash

    if src is None:
        return None
    return content_hash(src.records) if src.records else f"data-source:{cfg.data_source_path}"


def train(cfg: RunConfig, reporter: Reporter | None = None, startup: StartupClock | None = None) -> RunResult:
    return RLRun(cfg, reporter, startup).run()


def cli_main(argv: list[str], train_async: bool = False) -> int:
    """`miles-platform train`: Miles' train.py argv (docs/miles_flags.md), or --config run.yaml."""
    from miles_platform.config import build_parser
    from miles_platform.launch.ray_jobs import add_launch_flags, split_launch_flags, submit_cli

    prog = "miles-platform train-async" if train_async else "miles-platform train"
    opts, argv = split_launch_flags(argv)
    if "-h" in argv or "--help" in argv:
        parser = build_parser(prog)
        add_launch_flags(parser)
        parser.parse_args(["--help"])  # prints the help and exits 0, as argparse does
    cfg = parse_run_config(argv, prog, train_async=train_async)
    if opts.submit is not None:
        return submit_cli(cfg, opts)
    try:
        startup = StartupClock.from_process_start()  # `launch`: the process's own start
        startup.pause_gc()  # this process's own: until its services are up (startup.py)
        result = train(cfg, startup=startup)
    except (CITestFailure, ActorDied, NonFiniteTraining) as e:
        print(f"miles-platform train: {e}", file=sys.stderr)
        return 1
    out = {"run": result.run, "last_rollout_id": result.last_rollout_id, "final_version": result.final_version,
           "final_hf_path": result.final_hf_path, "ci_checks": result.ci_checks}  # fmt: skip
    print(json.dumps(out))
    return 0


def cli_main_async(argv: list[str]) -> int:
    """`miles-platform train-async`: Miles' train_async.py argv and loop: the next rollout generates
    while this one trains (one step off-policy), or --fully-async's worker (config/cli.py)."""
    return cli_main(argv, train_async=True)
