"""The train loop, as in Miles' train.py: generate -> store shard -> train -> save -> update weights.

    for rollout_id in range(start_rollout_id, num_rollout):
        samples = rollout_manager.generate(rollout_id)
        store.write_shard(rollout_id, samples)
        actor.train(rollout_id, samples)
        actor.update_weights()          # new policy version, HF export, engines load it
        if save due: actor.save(rollout_id)
        report materializations + metrics

Runs without Dagster (`miles-platform train ...`); the Dagster op passes a Reporter to turn
each policy version into asset materializations.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_platform.cluster.ports import free_port
from miles_platform.config import ConfigError, RunConfig, parse_run_config
from miles_platform.store.paths import StoragePaths, partition_key


class Reporter:
    """Callbacks of a run. The Dagster op overrides them; the CLI prints."""

    def log(self, msg: str) -> None:
        print(msg, flush=True)

    def on_rollout(self, rollout_id: int, metrics: dict[str, float]) -> None:
        pass

    def on_policy_version(self, info: dict[str, Any]) -> None:
        pass


@dataclass
class RunResult:
    run: str
    start_rollout_id: int
    last_rollout_id: int
    final_version: int
    final_hf_path: str | None
    versions: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)
    ci_checks: dict[str, float] = field(default_factory=dict)
    eval_before_train: dict[str, float] = field(default_factory=dict)  # v0's eval, as in Miles


class CITestFailure(AssertionError):
    pass


def validate_before_start(cfg: RunConfig) -> None:
    """Everything checkable before any engine or actor starts: config, rewards, custom paths, data."""
    cfg.validate()
    if not cfg.hf_checkpoint:
        raise ConfigError("--hf-checkpoint is required (HF dir with config, weights and tokenizer)")
    from miles_platform.models.checkpoint import validate_hf_dir

    validate_hf_dir(cfg.hf_checkpoint)
    cfg.resolve_api_key()  # secure by default: no run is open to other local processes
    if cfg.rollout_engine == "embedded" and not cfg.rollout_external_engine_addrs:
        from miles_platform.rollout.engines import embedded_max_running_requests

        other = sorted(k for k in cfg.sglang_args if k.replace("_", "-") != "max-running-requests")
        if other:
            raise ConfigError(
                f"--sglang-{other[0]} (and {len(other) - 1} more) would be ignored: the embedded engine takes "
                "only --sglang-max-running-requests; use --rollout-engine sglang for the others"
            )
        embedded_max_running_requests(cfg)
    if cfg.load_debug_rollout_data:
        return
    if not cfg.prompt_data:
        raise ConfigError("--prompt-data is required (JSONL or Parquet of prompts)")
    if cfg.loss_type != "sft_loss" and not cfg.debug_train_only:
        from miles_platform.rollout import rm_hub

        rm_hub.validate_reward_config(cfg)
    from miles_platform.rollout import filter_hub

    filter_hub.load_dynamic_filter(cfg)
    filter_hub.load_rollout_sample_filter(cfg)
    from miles_platform.plugins import load_function

    if cfg.custom_loss_function_path:
        load_function(cfg.custom_loss_function_path, "--custom-loss-function-path")
    if cfg.custom_update_weight_post_write_path:
        load_function(cfg.custom_update_weight_post_write_path, "--custom-update-weight-post-write-path", 3)


def _fill_defaults(cfg: RunConfig, paths: StoragePaths, dataset_rows: int) -> None:
    if cfg.save is None:
        cfg.save = paths.checkpoints(cfg.run_name)
    if cfg.num_rollout is None:
        epochs = cfg.num_epoch or 1
        cfg.num_rollout = max(1, epochs * dataset_rows // cfg.rollout_batch_size)


# staging names of the atomic writers (store/atomic.py, export, checkpoints, disk-delta publish)
_TMP = re.compile(r"^\..*\.tmp-[0-9a-f]+$|^\.tmp-.+-[0-9a-f]{8}$")


class RLRun:
    def __init__(self, cfg: RunConfig, reporter: Reporter | None = None):
        self.cfg = cfg
        self.reporter = reporter or Reporter()
        self.paths = StoragePaths(cfg.storage_root)
        self.worker = None
        self._highest_version = 0

    # ------------------------------------------------------------------ setup
    def _load_data(self, tokenizer):
        from miles_platform.data.dataset import content_hash
        from miles_platform.data.source import RolloutDataSource

        src = RolloutDataSource.from_config(self.cfg, tokenizer=tokenizer)
        return src, content_hash(src.records)

    def _start_trainers(self, world: int, groups):
        import ray

        from miles_platform.cluster.ray_cluster import create_role_actors
        from miles_platform.training.actor import TrainerActor

        dist_init = f"tcp://127.0.0.1:{free_port()}" if world > 1 else None
        threads = os.environ.get("MILES_TRAIN_THREADS", "1")
        env = {"env_vars": {"OMP_NUM_THREADS": threads, "MILES_TRAIN_THREADS": threads}}
        actors = create_role_actors(
            TrainerActor,
            self.cfg,
            groups,
            "actor",
            self.cfg,
            world_size=world,
            dist_init=dist_init,
            options={"runtime_env": env},
        )
        ray.get([a.ready.remote() for a in actors])
        return actors

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        import ray

        from miles_platform.cluster.ray_cluster import init_ray, shutdown_ray
        from miles_platform.models.checkpoint import content_hash as ckpt_hash
        from miles_platform.models.checkpoint import load_tokenizer

        cfg = self.cfg
        validate_before_start(cfg)
        tok = load_tokenizer(cfg.hf_checkpoint)
        src, data_version = (None, None) if cfg.load_debug_rollout_data else self._load_data(tok)
        _fill_defaults(cfg, self.paths, len(src) if src else 1)
        base_version = ckpt_hash(cfg.hf_checkpoint)
        world = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
        if cfg.global_batch_size % world:
            raise ConfigError(
                f"--global-batch-size {cfg.global_batch_size} must divide over {world} trainer ranks"
            )
        from miles_platform.store.run_lock import RunLock

        # one writer per run, taken after validation and before anything starts
        lock = None if "://" in self.paths.root else RunLock(self.paths.run_dir(cfg.run_name), cfg.run_name)
        if lock is not None:
            lock.acquire()
        try:
            self._remove_dead_writers_tmp()
            self._check_resume_config()
            ctx = init_ray(cfg)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        engines = router = groups = manager = None
        try:
            from miles_platform.cluster.ray_cluster import create_placement_groups

            groups = create_placement_groups(cfg)
            trainers = [] if cfg.debug_rollout_only else self._start_trainers(world, groups)
            state = ray.get([t.load.remote() for t in trainers])[0] if trainers else None
            start = 0 if state is None else state["rollout_id"] + 1
            version = 0 if state is None else int(state["weight_version"])
            # versions a crashed run made after its last checkpoint keep their numbers: new ones continue
            # after the highest recorded version, branching from the checkpoint's (no key is reused)
            self._highest_version = max(version, self._recorded_max_version())
            if state is not None and src is not None:
                src.load_state_dict(state["data_source"])
                self.reporter.log(
                    f"[resume] from {cfg.load or cfg.save} rollout {state['rollout_id']}, v{version}"
                )
            session = None
            if not cfg.debug_train_only:
                from miles_platform.rollout.engines import start_engines

                engines, router = start_engines(cfg, groups)
                from miles_platform.rollout.manager import RolloutManager
                from miles_platform.weights.update_session import UpdateSession

                # one engine: talk to it directly (a router hop would add latency and nothing else)
                url = engines[0].url if len(engines) == 1 else router.url
                self.reporter.log(
                    f"engines {' '.join(e.url for e in engines)} router {router.url}: every call needs the "
                    "run's bearer token (--api-key / --api-key-file / $MILES_API_KEY, else generated)"
                )
                manager = RolloutManager(cfg, tok, src, url)
                session = UpdateSession(cfg, self.paths, engines, trainers) if trainers else None
                if session is not None:
                    self._initial_sync(trainers, session, version, resumed=state is not None)
            ctx_info = {"data_version": data_version, "base_version": base_version}
            initial_eval = self._eval_before_train(manager, start, version)
            if cfg.fully_async and manager is not None:
                from miles_platform.rollout.async_worker import AsyncRolloutWorker

                self.worker = AsyncRolloutWorker(manager, cfg.async_buffer_capacity).start()
            result = self._loop(trainers, manager, session, engines, start, version, ctx_info)
            result.eval_before_train = initial_eval
            return result
        finally:
            if self.worker is not None:
                self.worker.stop()
            if manager is not None:
                manager.close()
            if router is not None:
                router.stop()
            if engines:
                from miles_platform.rollout.engines import stop_engines

                stop_engines(engines)
            if groups:
                from miles_platform.cluster.ray_cluster import remove_placement_groups

                remove_placement_groups(groups)
            shutdown_ray(ctx)
            if lock is not None:
                lock.release()

    def _remove_dead_writers_tmp(self) -> None:
        """Holding the run lock, every `.tmp-*` under the run's dirs (checkpoint, HF export and
        publication staging of a killed writer) is garbage nothing can observe: remove it."""
        import shutil

        cfg = self.cfg
        roots = [self.paths.run_dir(cfg.run_name), cfg.save, cfg.update_weight_disk_dir]
        seen = set()
        for root in roots:
            if not root or "://" in root or not os.path.isdir(root) or root in seen:
                continue
            seen.add(root)
            for d in [
                Path(root),
                *(p for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith(".")),
            ]:
                for p in d.iterdir():
                    if _TMP.match(p.name):
                        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                        self.reporter.log(f"[startup] removed {p} (left by a writer that died)")

    def _check_resume_config(self) -> None:
        """A resume must train what the saved run trained: differing flags (other than schedule,
        eval, logging and placement ones, config.RESUMABLE) are refused unless --allow-config-change.
        The checkpoint dir then records this run's config."""
        from miles_platform.config import config_changes, saved_config
        from miles_platform.store.atomic import write_atomic
        from miles_platform.training.actor import read_latest

        cfg = self.cfg
        src = cfg.load or cfg.save
        if not src or "://" in src:
            return
        rec = Path(src) / "run_config.json"
        if read_latest(src) is not None and rec.is_file():
            changes = config_changes(json.loads(rec.read_text()), cfg)
            if changes and not cfg.allow_config_change:
                raise ConfigError(
                    f"resuming run {cfg.run_name!r} from {src} with a different config: {'; '.join(changes)}. "
                    "Relaunch with the saved flags, a new --run-name, or --allow-config-change"
                )
            if changes:
                self.reporter.log(f"[resume] --allow-config-change: {'; '.join(changes)}")
        if cfg.save and "://" not in cfg.save:
            Path(cfg.save).mkdir(parents=True, exist_ok=True)
            write_atomic(Path(cfg.save) / "run_config.json", saved_config(cfg))

    def _initial_sync(self, trainers, session, version: int, resumed: bool) -> None:
        """Engines start from --hf-checkpoint (v0); a resumed run pushes its policy to them first."""
        import ray

        snapshot = self.cfg.update_weight_transfer_mode == "disk-delta" and not resumed
        if not (snapshot or resumed):
            return  # engines already hold v0
        weights = ray.get([t.get_hf_weights.remote() for t in trainers])[0]
        hf_dir = self.paths.hf_export(self.cfg.run_name, version)
        if snapshot:
            session.transport.snapshot_base(weights, version)
        elif self.cfg.update_weight_transfer_mode == "disk-delta":  # resumed: never republish a version
            from miles_platform.training.export import export_hf_dir

            if not os.path.exists(os.path.join(hf_dir, "model.safetensors")):
                hf_dir = export_hf_dir(weights, self.cfg.hf_checkpoint, hf_dir)
            session.transport.load_export(hf_dir, version)
        else:
            session.update(weights, version, hf_dir if os.path.exists(hf_dir) else None)
        if resumed and (self.cfg.ci_test or self.cfg.check_weight_update_equal):
            self._check_weights_equal(session.engines, weights, version)

    def _loop(self, trainers, manager, session, engines, start, version, ctx_info) -> RunResult:
        import ray

        from miles_platform.store.shards import write_rollout_shard
        from miles_platform.training.actor import TrainBatch
        from miles_platform.training.export import export_hf_dir

        cfg, run = self.cfg, self.cfg.run_name
        last_export = self.paths.hf_export(run, version)
        result = RunResult(
            run, start, start - 1, version, last_export if os.path.exists(last_export) else None
        )
        for rollout_id in range(start, cfg.num_rollout):
            t0 = time.time()
            if cfg.load_debug_rollout_data:
                samples, metrics = self._load_debug(rollout_id), {}
            elif self.worker is not None:
                samples, metrics = self.worker.get_rollout(rollout_id, version)
            else:
                samples, metrics = manager.generate(rollout_id)
            shard = write_rollout_shard(self.paths, run, rollout_id, samples)
            if cfg.save_debug_rollout_data:
                self._save_debug(rollout_id, samples)
            if not trainers:  # --debug-rollout-only
                self._finish_rollout(result, rollout_id, metrics, t0, version)
                continue
            batch = TrainBatch.from_samples(samples)
            handle = self._handoff(batch)
            metrics.update(ray.get([t.train.remote(rollout_id, handle) for t in trainers])[0])
            self._store.remove(handle)
            if cfg.ci_test and rollout_id == 0:
                result.ci_checks = self._ci_step0(metrics)
            hf_dir = None
            if session is not None and (rollout_id + 1) % cfg.update_weights_interval == 0:
                parent, version = version, max(version, self._highest_version) + 1
                self._highest_version = version
                weights = ray.get([t.get_hf_weights.remote() for t in trainers])[0]
                hf_dir = export_hf_dir(weights, cfg.hf_checkpoint, self.paths.hf_export(run, version))
                metrics.update(session.update(weights, version, hf_dir))
                if cfg.ci_test or cfg.check_weight_update_equal:
                    self._check_weights_equal(engines, weights, version)
            ckpt = None
            if cfg.save and self._save_due(rollout_id):
                extra = {
                    "weight_version": version,
                    "data_source": self._data_source_state(manager),
                    "run": run,
                    "config_hash": cfg.config_hash(),
                }
                ckpt = ray.get([t.save.remote(rollout_id, extra) for t in trainers])[0]
            if ckpt and cfg.save_hf and hf_dir is not None:
                self._save_hf(rollout_id, hf_dir)
            if manager is not None and self._eval_due(version, hf_dir):
                metrics.update(self._evaluate(manager, version))
            if hf_dir is not None:
                info = self._record_version(run, version, parent, rollout_id, shard, hf_dir, ckpt, ctx_info)
                result.versions.append(info)
                self.reporter.on_policy_version(info)
                result.final_hf_path = hf_dir
            self._finish_rollout(result, rollout_id, metrics, t0, version)
        return result

    def _finish_rollout(
        self, result: RunResult, rollout_id: int, metrics: dict, t0: float, version: int
    ) -> None:
        """Metrics of one rollout: to the `metrics` table, the reporter and the result."""
        from miles_platform.store.tables import append_rows

        step = int(metrics.get("train/step", 0))
        rows = [
            {"rollout_id": rollout_id, "step": step, "name": k, "value": float(v)} for k, v in metrics.items()
        ]
        append_rows(self.paths, "metrics", self.cfg.run_name, rows)
        self._report(rollout_id, metrics, t0)
        result.metrics.append(metrics)
        result.last_rollout_id, result.final_version = rollout_id, version

    def _handoff(self, batch):
        """Rollout data to the trainer ranks through the object store (`--object-store-backend`)."""
        import dataclasses

        from miles_platform.cluster.object_store import put_rollout_data, store_from_config

        self._store = store_from_config(self.cfg)
        return put_rollout_data(dataclasses.asdict(batch), self._store)

    def _recorded_max_version(self) -> int:
        """The highest version any store knows: catalog rows, HF exports (`hf/v000006`, also a
        half-written one) and the disk-delta publication's LATEST. A run killed between publishing
        or exporting a version and recording it continues past it, so no number is reused and no
        export is overwritten."""
        from miles_platform.store.tables import read_rows

        rows = read_rows(self.paths, "policy_versions", self.cfg.run_name)
        known = [int(r["version"]) for r in rows]
        hf = Path(self.paths.hf_export(self.cfg.run_name, 0)).parent
        if "://" not in str(hf) and hf.is_dir():
            known += [int(m.group(1)) for d in hf.iterdir() if (m := re.match(r"v(\d+)", d.name))]
        pub = self.cfg.update_weight_disk_dir
        if self.cfg.update_weight_transfer_mode == "disk-delta" and pub and "://" not in pub:
            from miles_platform.weights.delta_format import read_latest

            latest = read_latest(pub) if Path(pub).is_dir() else None
            known += [latest] if latest is not None else []
        return max(known, default=0)

    def _save_hf(self, rollout_id: int, hf_dir: str) -> None:
        """--save-hf: a copy of the saved policy in HF layout (template may use {rollout_id})."""
        import shutil

        from miles_platform.store.atomic import fsync_tree, replace_dir

        dest = self.cfg.save_hf.format(rollout_id=rollout_id)
        tmp = f"{dest}.tmp-{os.getpid()}"
        shutil.copytree(hf_dir, tmp)
        fsync_tree(tmp)
        replace_dir(tmp, dest)

    def _eval_due(self, version: int, hf_dir: str | None) -> bool:
        c = self.cfg
        return bool(
            c.eval_prompt_data and c.eval_interval and hf_dir is not None and version % c.eval_interval == 0
        )

    def _eval_before_train(self, manager, start: int, version: int) -> dict[str, float]:
        """Miles evaluates the initial policy before the first rollout of a fresh run when eval is
        configured, unless --skip-eval-before-train. A resumed run does not evaluate again."""
        c = self.cfg
        if manager is None or start != 0 or not (c.eval_prompt_data and c.eval_interval):
            return {}
        if c.skip_eval_before_train:
            self.reporter.log("--skip-eval-before-train: no eval of v0")
            return {}
        return self._evaluate(manager, version)

    def _evaluate(self, manager, version: int) -> dict[str, float]:
        """Miles' in-loop eval (--eval-interval) through the router, on the engines' current policy."""
        from miles_platform.rollout.evaluate import evals_table_rows, evaluate
        from miles_platform.rollout.manager import router_generate_fn
        from miles_platform.store.tables import append_rows

        c, t0 = self.cfg, time.time()
        s = c.eval_sampling()
        res = evaluate(
            None, c.eval_datasets(), c.n_samples_per_eval_prompt, s["max_new_tokens"], s["temperature"],
            s["top_p"], s["top_k"], rm_type=c.rm_type or "math", args=c, seed=c.seed,
            generate_fn=router_generate_fn(manager), input_key=c.input_key,
            label_key=c.label_key or "label", metadata_key=c.metadata_key,
            apply_chat_template=c.apply_chat_template, tokenizer=manager.tok,
        )  # fmt: skip
        out = {f"eval/{name}/{k}": v for name, r in res.items() for k, v in r.items() if isinstance(v, float)}
        rows = evals_table_rows(partition_key(c.run_name, version), res, "loop", s)
        append_rows(self.paths, "evals", c.run_name, rows)
        out["perf/eval_time"] = time.time() - t0
        self.reporter.log(f"eval v{version}: " + " ".join(f"{k}={v:.4g}" for k, v in out.items()))
        return out

    def _data_source_state(self, manager) -> dict:
        if self.worker is not None:
            return self.worker.data_source_state()
        return manager.data_source.state_dict(manager.unfinished_records()) if manager else {}

    def _save_due(self, rollout_id: int) -> bool:
        c = self.cfg
        return rollout_id + 1 == c.num_rollout or bool(
            c.save_interval and (rollout_id + 1) % c.save_interval == 0
        )

    def _record_version(self, run, version, parent_version, rollout_id, shard, hf_dir, ckpt, ctx_info):
        from miles_platform.models.checkpoint import content_hash
        from miles_platform.store.tables import append_rows

        key, parent = partition_key(run, version), partition_key(run, parent_version)
        info = {
            "run": run,
            "version": version,
            "partition_key": key,
            "parent_version": parent_version,
            "parent_partition_key": parent,
            "rollout_id": rollout_id,
            "checkpoint_path": ckpt,
            "hf_path": hf_dir,
            "content_hash": content_hash(hf_dir),
            "config_hash": self.cfg.config_hash(),
            "base_data_version": ctx_info["base_version"],
            "dataset_data_version": ctx_info["data_version"],
            "shard_path": shard.path,
            "shard_rows": shard.rows,
            "mean_reward": shard.mean_reward,
            "base_checkpoint": self.cfg.hf_checkpoint,
            "prompt_data": self.cfg.prompt_data,
            "eval_interval": self.cfg.eval_interval,
        }
        append_rows(
            self.paths,
            "policy_versions",
            run,
            [
                {
                    k: info[k]
                    for k in (
                        "version",
                        "partition_key",
                        "parent_version",
                        "rollout_id",
                        "checkpoint_path",
                        "hf_path",
                        "content_hash",
                        "config_hash",
                        "base_data_version",
                        "dataset_data_version",
                        "shard_path",
                        "shard_rows",
                        "mean_reward",
                    )
                }
            ],
        )
        edges = [
            (
                parent if parent_version > 0 else self.cfg.hf_checkpoint,
                "policy_version" if parent_version > 0 else "checkpoint",
                "trained_from",
                ctx_info["base_version"] if parent_version == 0 else None,
            ),
            (shard.path, "rollout_shard", "trained_on", None),
            (self.cfg.prompt_data, "dataset", "prompt_data", ctx_info["data_version"]),
            (self.cfg.hf_checkpoint, "checkpoint", "base_checkpoint", ctx_info["base_version"]),
        ]
        append_rows(
            self.paths,
            "lineage",
            run,
            [
                {
                    "child": key,
                    "child_kind": "policy_version",
                    "parent": p,
                    "parent_kind": pk,
                    "relation": rel,
                    "data_version": dv,
                }
                for p, pk, rel, dv in edges
            ],
        )
        return info

    def _report(self, rollout_id: int, metrics: dict[str, float], t0: float) -> None:
        metrics["perf/rollout_total_time"] = time.time() - t0
        self.reporter.on_rollout(rollout_id, metrics)
        if rollout_id % self.cfg.log_interval == 0:
            keys = (
                "rollout/raw_reward",
                "train/loss",
                "train/pg_loss",
                "train/pg_clipfrac",
                "train/ppo_kl",
                "train/grad_norm",
                "train/train_rollout_logprob_abs_diff",
                "perf/rollout_time",
                "perf/actor_train_time",
                "perf/update_weights_time",
            )
            shown = " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
            self.reporter.log(f"rollout {rollout_id}: {shown}")

    # ------------------------------------------------------------------ --ci-test
    def _ci_step0(self, m: dict[str, float]) -> dict[str, float]:
        checks = {
            "step0_ppo_kl": abs(m.get("train/step0_ppo_kl", 0.0)),
            "step0_pg_clipfrac": m.get("train/step0_pg_clipfrac", 0.0),
            "train_rollout_logprob_abs_diff": m.get("train/train_rollout_logprob_abs_diff", 0.0),
        }
        self.reporter.log(f"[ci-test] rollout 0: {json.dumps(checks)}")
        if checks["step0_ppo_kl"] >= 1e-9:
            raise CITestFailure(f"--ci-test: |train/ppo_kl| at step 0 = {checks['step0_ppo_kl']:.3g} >= 1e-9")
        if checks["step0_pg_clipfrac"] >= 1e-10:
            raise CITestFailure(
                f"--ci-test: train/pg_clipfrac at step 0 = {checks['step0_pg_clipfrac']:.3g} >= 1e-10"
            )
        if (
            not self.cfg.use_rollout_logprobs
            and checks["train_rollout_logprob_abs_diff"] >= self.cfg.ci_logprob_abs_diff_threshold
        ):
            raise CITestFailure(
                f"--ci-test: trainer-vs-engine log-prob abs diff {checks['train_rollout_logprob_abs_diff']:.3g} "
                f">= {self.cfg.ci_logprob_abs_diff_threshold}"
            )
        return checks

    def _check_weights_equal(self, engines, weights, version: int) -> None:
        import ray
        import torch

        for e in engines:
            if e.actor is None:
                continue
            got = ray.get(e.actor.get_weights.remote())
            for name, t in weights.items():
                if name not in got or not torch.equal(got[name].to(t.dtype), t):
                    raise CITestFailure(
                        f"--ci-test: engine {e.url} tensor {name} differs from trainer at v{version}"
                    )

    # ------------------------------------------------------------------ debug data
    def _save_debug(self, rollout_id: int, samples) -> None:
        from miles_platform.store.shards import samples_to_table, write_parquet_atomic

        path = self.cfg.save_debug_rollout_data.format(rollout_id=rollout_id)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_parquet_atomic(samples_to_table(samples), path)

    def _load_debug(self, rollout_id: int):
        import pyarrow.parquet as pq

        from miles_platform.data.sample import Sample

        path = self.cfg.load_debug_rollout_data.format(rollout_id=rollout_id)
        if not os.path.exists(path):
            raise ConfigError(f"--load-debug-rollout-data: {path} not found for rollout {rollout_id}")
        samples = [Sample.from_row(r) for r in pq.read_table(path).to_pylist()]
        for s in samples:  # a replay belongs to this run; the source run stays in metadata
            s.metadata = {**s.metadata, "replayed_from_run": s.run}
            s.run, s.rollout_id = self.cfg.run_name, rollout_id
        return samples


def train(cfg: RunConfig, reporter: Reporter | None = None) -> RunResult:
    return RLRun(cfg, reporter).run()


def cli_main(argv: list[str]) -> int:
    cfg = parse_run_config(argv)
    try:
        result = train(cfg)
    except CITestFailure as e:
        print(f"miles-platform train: {e}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                "run": result.run,
                "last_rollout_id": result.last_rollout_id,
                "final_version": result.final_version,
                "final_hf_path": result.final_hf_path,
                "ci_checks": result.ci_checks,
            }
        )
    )
    return 0
