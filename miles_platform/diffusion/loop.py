"""The diffusion train loop, the LLM loop's shape (Miles' train_diffusion.py):

    for rollout_id in range(start_rollout_id, num_rollout):
        samples, trajectories = rollout.generate(rollout_id)   # engine records x_t -> x_t+1, rewards
        store.write_shard(rollout_id, samples)                 # PNG + prompt + reward + log-probs
        trainer.train(rollout_id, trajectories)                 # Flow-GRPO or DiffusionNFT
        version += 1: export, engine loads it, policy_versions row + lineage
        if save due: trainer.save(rollout_id);  if eval due: held-out reward + image grid

Engine and trainer are Ray actors; the engine serves HTTP on 127.0.0.1 with the run's secret.
Everything the run reads is checked before Ray starts (`preflight`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

from miles_platform.diffusion.config import RESUMABLE, DiffusionRunConfig, parse_diffusion_config
from miles_platform.errors import ConfigError
from miles_platform.run_types import CITestFailure, Reporter, RunResult
from miles_platform.store.paths import DIFFUSION_CONFIG, StoragePaths, partition_key

LOG_KEYS = ("rollout/raw_reward", "train/loss", "train/pg_loss", "train/ratio_abs_minus_1",
            "train/log_prob_mean_abs_diff", "train/grad_norm", "perf/rollout_time", "perf/actor_train_time")  # fmt: skip
# --ci-test: before the first optimizer step the trainer re-scores the engine's transitions
CI_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2}


def preflight(cfg: DiffusionRunConfig, paths: StoragePaths) -> tuple[list, dict[str, list]]:
    """Everything a run reads, checked before Ray starts and before anything is written."""
    from miles_platform.data.dataset import load_prompt_dataset
    from miles_platform.diffusion.family import family_for
    from miles_platform.diffusion.rollout import nft_strategy, reward_function, step_strategy
    from miles_platform.diffusion.sde import backend_for
    from miles_platform.store.remote import is_remote

    if is_remote(paths.root):
        raise ConfigError(
            f"--storage-root {paths.root}: diffusion runs write to a local root (object stores: not built)"
        )
    family_for(cfg.diffusion_model_family, cfg.hf_checkpoint)
    from miles_platform.diffusion.model import load_pipeline

    try:
        pipe = load_pipeline(cfg.hf_checkpoint)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--hf-checkpoint {cfg.hf_checkpoint}: {e}") from None
    size = int(pipe.transformer.config.sample_size)
    for name in ("diffusion_height", "diffusion_width"):
        if getattr(cfg, name) not in (None, size):
            raise ConfigError(
                f"--{name.replace('_', '-')} {getattr(cfg, name)}: this DiT generates {size}x{size}"
            )
    if cfg.diffusion_forward_dtype != "fp32":  # the family's rules must match the model (zero hits: an error)
        from miles_platform.diffusion.family import precision_policy
        from miles_platform.training.precision import compile_policy

        compile_policy(pipe.transformer, precision_policy(cfg))
    records = load_prompt_dataset(cfg.prompt_data, input_key=cfg.input_key)
    evals = {name: load_prompt_dataset(path, input_key=cfg.input_key)
             for name, path in cfg.eval_datasets()}  # fmt: skip
    if not cfg.custom_rm_path:
        from miles_platform.diffusion.task import parse_prompt

        for where, recs in (
            ("--prompt-data", records),
            *((f"--eval-prompt-data {n}", r) for n, r in evals.items()),
        ):
            for r in recs:
                try:
                    parse_prompt(r.prompt)
                except ValueError as e:
                    raise ConfigError(
                        f"{where}: {e} (--rm-type image_attributes reads these attributes)"
                    ) from None
    strategy = step_strategy(cfg)
    if strategy is not None:  # its flags (window range, candidates) fail here, not mid-run
        strategy(cfg, None, cfg.diffusion_num_steps, cfg.rollout_seed)
    reward_function(cfg), backend_for(cfg.diffusion_sde_type, cfg.sde_step_backend_path)
    if cfg.loss_type == "nft":
        import torch

        nft_strategy(cfg)(cfg, cfg.diffusion_num_steps, torch.Generator().manual_seed(0))
    if cfg.num_rollout is None:
        cfg.num_rollout = max(1, cfg.num_epoch * len(records) // cfg.rollout_batch_size)
    return records, evals


class DiffusionRun:
    def __init__(self, cfg: DiffusionRunConfig, reporter: Reporter | None = None):
        self.cfg, self.reporter, self.paths = cfg, reporter or Reporter(), StoragePaths(cfg.storage_root)

    def run(self) -> RunResult:
        from miles_platform.data.dataset import content_hash as data_hash
        from miles_platform.data.source import RolloutDataSource
        from miles_platform.models.checkpoint import content_hash
        from miles_platform.run_lifecycle import RunLifecycle
        from miles_platform.store.recorder import VersionRecorder, close_quietly

        cfg = self.cfg
        records, self.evals = preflight(cfg, self.paths)
        cfg.resolve_api_key()
        self.src = RolloutDataSource(
            records, rollout_shuffle=cfg.rollout_shuffle, rollout_seed=cfg.rollout_seed
        )
        self.rec = VersionRecorder(cfg, self.paths, self.reporter, content_hash(cfg.hf_checkpoint),
                                   data_hash(records), LOG_KEYS)  # fmt: skip
        # run lock, dead writers' staging, the resume config (this loop's RESUMABLE), Ray
        life = RunLifecycle(
            cfg, self.paths, self.reporter.log, resumable=RESUMABLE, cpus_needed=2, trackers=False
        )
        with life:
            self.hooks = life.hooks
            self._write_config()
            self._start_actors(life.stack)
            try:
                return self._loop(life.config_changes)
            finally:  # the recorder's rows to disk before the run's end compacts its tables
                close_quietly(self.rec, failed=sys.exc_info()[0] is not None, log=self.reporter.log)

    def _write_config(self) -> None:
        """runs/<run>/diffusion_config.json: what the catalog sensor reads to report this run as a
        diffusion run (its versions are evaluated in the loop; never by the LLM evaluator)."""
        from miles_platform.store.atomic import write_atomic

        d = self.paths.run_dir(self.cfg.run_name)
        os.makedirs(d, exist_ok=True)
        data = {k: v for k, v in self.cfg.to_dict().items() if k != "api_key"}
        write_atomic(os.path.join(d, DIFFUSION_CONFIG), json.dumps(data, indent=1, sort_keys=True))

    def _start_actors(self, stack: contextlib.ExitStack) -> None:
        import ray

        from miles_platform.cluster import forkserver
        from miles_platform.cluster.ray_cluster import remote_class
        from miles_platform.diffusion.engine import DiffusionEngineActor
        from miles_platform.diffusion.rollout import DiffusionRollout
        from miles_platform.diffusion.trainer import DiffusionTrainerActor

        cfg = self.cfg
        opts = {"num_cpus": 1, "runtime_env": forkserver.runtime_env({"env_vars": {"OMP_NUM_THREADS": "1"}})}
        roots = [self.paths.run_dir(cfg.run_name), os.path.dirname(os.path.abspath(cfg.hf_checkpoint))]
        self.engine = remote_class(DiffusionEngineActor).options(**opts).remote(
            cfg.hf_checkpoint, api_key=cfg.api_key, dit_precision=cfg.sglang_dit_precision, weight_roots=roots,
            num_threads=1,
        )  # fmt: skip
        stack.callback(lambda: _quiet(lambda: ray.get(self.engine.shutdown.remote(), timeout=10)))
        self.trainer = None
        if not cfg.debug_rollout_only:
            self.trainer = (
                remote_class(DiffusionTrainerActor).options(**opts).remote(cfg.to_dict(), num_threads=1)
            )
        url = ray.get(self.engine.url.remote())
        self.rollout = DiffusionRollout(cfg, url, cfg.api_key)
        stack.callback(self.rollout.close)

    # ------------------------------------------------------------------ the loop
    def _loop(self, config_changes: list[str]) -> RunResult:
        import ray

        from miles_platform.store.shards import write_rollout_shard
        from miles_platform.training.checkpoint import iter_dir, read_latest

        cfg, run, rec, hook = self.cfg, self.cfg.run_name, self.rec, self.hooks
        phase, state = hook.phase, None
        latest = read_latest(cfg.load or cfg.save) if self.trainer is not None else None
        if latest is not None:
            state = ray.get(self.trainer.load.remote(iter_dir(cfg.load or cfg.save, latest)))
            self.src.load_state_dict(state["data_source"])
        start, version = rec.resume(state, config_changes)
        if state is not None:
            self._serve(version, ray.get(self.trainer.export.remote(self.paths.hf_export(run, version))))
        result = RunResult(run, start, start - 1, version, None)
        if start == 0 and self.evals and not cfg.skip_eval_before_train:
            result.eval_before_train = self._evaluate(version)
        for rollout_id in range(start, cfg.num_rollout):
            t0, hook.rollout_id = time.time(), rollout_id
            with phase("step"):
                with phase("rollout"):
                    samples, traj, metrics = self.rollout.generate(
                        rollout_id, self.src.get_samples(cfg.rollout_batch_size), run
                    )
                    shard = write_rollout_shard(self.paths, run, rollout_id, samples)
                if self.trainer is None:
                    with phase("metrics"):
                        rec.finish_rollout(result, rollout_id, metrics, t0, version)
                    continue
                with phase("train"):
                    metrics.update(ray.get(self.trainer.train.remote(rollout_id, traj.to_dict())))
                if cfg.ci_test and rollout_id == start:
                    result.ci_checks = self._ci_check(metrics)
                with phase("weight_update"):
                    parent, version = rec.next_version(version)
                    t1 = time.time()
                    with phase("weight_export"):
                        hf_dir = ray.get(self.trainer.export.remote(self.paths.hf_export(run, version)))
                    with phase("weight_activate"):
                        self._serve(version, hf_dir)
                    metrics["perf/update_weights_time"] = time.time() - t1
                # the row, the eval, the metrics, the checkpoint last (store/recorder.py)
                save_due = rec.save_due(rollout_id)
                with phase("record"):
                    ckpt = iter_dir(cfg.save, rollout_id) if save_due else None
                    rec.record(result, version, parent, rollout_id, shard, hf_dir, ckpt)
                last = rollout_id + 1 == cfg.num_rollout  # the final policy is always evaluated
                if cfg.eval_interval and self.evals and (version % cfg.eval_interval == 0 or last):
                    with phase("eval"):
                        metrics.update(self._evaluate(version))
                with phase("metrics"):
                    rec.finish_rollout(result, rollout_id, metrics, t0, version)
                if save_due:
                    with phase("save"):
                        self._save(rollout_id, version)
        return result

    def _serve(self, version: int, hf_dir: str) -> None:
        r = self.rollout.client.post(f"{self.rollout.url}/update_weights_from_disk", headers=self.rollout.headers,
                                     json={"model_path": hf_dir, "weight_version": version})  # fmt: skip
        if r.status_code != 200:
            raise RuntimeError(
                f"engine refused v{version} from {hf_dir}: HTTP {r.status_code} {r.text[:300]}"
            )

    def _ci_check(self, metrics: dict[str, float]) -> dict[str, float]:
        cfg = self.cfg
        tol = CI_TOLERANCE[cfg.diffusion_forward_dtype]
        keys = (
            ("train/ratio_abs_minus_1", "train/log_prob_mean_abs_diff")
            if cfg.loss_type == "policy_loss"
            else ()
        )
        checks = {k: metrics[k] for k in keys}
        bad = {k: v for k, v in checks.items() if not v <= tol}
        self.reporter.log(f"[ci-test] step 0: {checks} (tolerance {tol} at {cfg.diffusion_forward_dtype})")
        if bad:
            raise CITestFailure(f"--ci-test: trainer and engine disagree at step 0: {bad} > {tol}")
        return checks

    def _save(self, rollout_id: int, version: int) -> str:
        import ray

        extra = {"weight_version": version, "data_source": self.src.state_dict(), "run": self.cfg.run_name,
                 "config_hash": self.cfg.config_hash()}  # fmt: skip
        self.rec.flush()  # the rows of every rollout the checkpoint holds are on disk before it
        return ray.get(self.trainer.save.remote(self.cfg.save, rollout_id, extra))

    def _evaluate(self, version: int) -> dict[str, float]:
        import torch

        from miles_platform.diffusion.task import image_grid
        from miles_platform.store.atomic import write_atomic
        from miles_platform.store.tables import append_rows

        cfg, out, rows, grids = self.cfg, {}, [], {}
        key = partition_key(cfg.run_name, version)
        for name, records in self.evals.items():
            m, shown = self.rollout.evaluate(name, records)
            out.update(m)
            grid_dir = os.path.join(self.paths.run_dir(cfg.run_name), "evals", f"v{version:06d}")
            os.makedirs(grid_dir, exist_ok=True)
            grids[name] = os.path.join(grid_dir, f"{name}.png")
            write_atomic(grids[name], image_grid(torch.stack(_grid_images(shown)), nrow=8))
            rows.append({"version": version, "partition_key": key, "dataset": name, "metric": "mean_reward",
                         "value": m[f"eval/{name}/mean_reward"], "n_samples": cfg.n_samples_per_eval_prompt,
                         "source": "loop", "temperature": None, "top_p": None, "top_k": None,
                         "max_new_tokens": None})  # fmt: skip
        append_rows(self.paths, "evals", cfg.run_name, rows)
        self.reporter.on_eval(key, out, grids)
        self.reporter.log(f"eval v{version}: " + " ".join(f"{k}={v:.4g}" for k, v in out.items()))
        return out


def _grid_images(shown: list, per_prompt: int = 8) -> list:
    """One row per distinct eval prompt: its first `per_prompt` samples (fixed seeds, so the rows of
    two versions compare image by image)."""
    rows: dict[str, list] = {}
    for prompt, image, _ in shown:
        if len(rows.setdefault(prompt, [])) < per_prompt:
            rows[prompt].append(image)
    return [im for ims in rows.values() for im in ims]


def _quiet(fn) -> None:
    with contextlib.suppress(Exception):
        fn()


def train_diffusion(cfg: DiffusionRunConfig, reporter: Reporter | None = None) -> RunResult:
    return DiffusionRun(cfg, reporter).run()


def cli_main(argv: list[str]) -> int:
    try:
        cfg = parse_diffusion_config(argv)
        result = train_diffusion(cfg)
    except ConfigError as e:
        print(f"miles-platform train-diffusion: error: {e}", file=sys.stderr)
        return 2
    except CITestFailure as e:
        print(f"miles-platform train-diffusion: {e}", file=sys.stderr)
        return 1
    out: dict[str, Any] = {"run": result.run, "last_rollout_id": result.last_rollout_id,
                           "final_version": result.final_version, "final_hf_path": result.final_hf_path,
                           "ci_checks": result.ci_checks}  # fmt: skip
    print(json.dumps(out))
    return 0
