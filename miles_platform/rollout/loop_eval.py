"""Miles' in-loop eval (--eval-interval, and v0 before training): the run's eval datasets through
its own engines, on the policy they serve; one `evals` row per (dataset, metric)."""

from __future__ import annotations

import time

from miles_platform.config import RunConfig
from miles_platform.store.paths import StoragePaths, partition_key


def eval_due(cfg: RunConfig, version: int, hf_dir: str | None) -> bool:
    return bool(
        cfg.eval_prompt_data and cfg.eval_interval and hf_dir is not None and version % cfg.eval_interval == 0
    )


def evaluate_policy(
    cfg: RunConfig, paths: StoragePaths, manager, version: int, rollout_id: int = 0
) -> tuple[dict, dict]:
    """-> ({"eval/<dataset>/<metric>": value, "perf/eval_time": s}, per-dataset result dicts)."""
    if cfg.eval_function_path:
        return custom_eval(cfg, paths, manager, version, rollout_id)
    from miles_platform.rollout.evaluate import evals_table_rows, evaluate
    from miles_platform.rollout.manager import router_generate_fn
    from miles_platform.store.tables import append_rows

    e, t0 = cfg.eval_settings(), time.time()
    res = evaluate(
        None, list(e.datasets), e.n_samples_per_eval_prompt, **e.sampling, rewards=e.rewards, seed=e.seed,
        generate_fn=router_generate_fn(manager), input_key=e.input_key, label_key=e.label_key,
        metadata_key=e.metadata_key, apply_chat_template=e.apply_chat_template, tokenizer=manager.tok,
        chat_template_kwargs=e.chat_template_kwargs, log_passrate=cfg.log_passrate, multimodal_keys=e.image_keys,
    )  # fmt: skip
    out = {f"eval/{name}/{k}": v for name, r in res.items() for k, v in r.items() if isinstance(v, float)}
    # --log-passrate: Miles' eval/<dataset>-pass@<k> over each prompt's sampled answers
    out.update({f"eval/{name}-{k}": v for name, r in res.items() for k, v in r.get("passrate", {}).items()})
    rows = evals_table_rows(partition_key(cfg.run_name, version), res, "loop", e.sampling)
    append_rows(paths, "evals", cfg.run_name, rows)
    out["perf/eval_time"] = time.time() - t0
    return out, res


def evaluate_and_log(
    cfg: RunConfig, paths: StoragePaths, services, reporter, version: int, rollout_id: int
) -> dict:
    """evaluate_policy, then to the trackers (or --custom-eval-rollout-log-function-path) and the log."""
    out, res = evaluate_policy(cfg, paths, services.manager, version, rollout_id)
    if not services.trackers.eval_data(rollout_id, res, out):
        reporter.log(f"eval v{version}: " + " ".join(f"{k}={v:.4g}" for k, v in out.items()))
    return out


def eval_before_train(
    cfg: RunConfig, paths: StoragePaths, services, reporter, start: int, version: int
) -> dict:
    """Miles evaluates the initial policy before the first rollout of a fresh run when eval is
    configured, unless --skip-eval-before-train. A resumed run does not evaluate again."""
    if services.manager is None or start != 0 or not (cfg.eval_prompt_data and cfg.eval_interval):
        return {}
    if cfg.skip_eval_before_train:
        reporter.log("--skip-eval-before-train: no eval of v0")
        return {}
    out = evaluate_and_log(cfg, paths, services, reporter, version, start)
    services.trackers.log(start, out)
    return out


def custom_eval(
    cfg: RunConfig, paths: StoragePaths, manager, version: int, rollout_id: int
) -> tuple[dict, dict]:
    """--eval-function-path: Miles' eval rollout, `fn(args, rollout_id, data_source, evaluation=True)` (or a
    rollout class called with RolloutFnEvalInput) -> RolloutFnEvalOutput (or its `data` dict), logged
    as Miles logs it: eval/<dataset> (the mean reward, None as 0), eval/<dataset>-none_reward_ratio,
    eval/<dataset>-truncated_ratio, plus the function's metrics; `evals` rows as mean_reward."""
    import inspect

    from miles_platform.errors import ConfigError
    from miles_platform.plugins import EVAL_FLAG, load_rollout_function
    from miles_platform.rollout.base_types import RolloutFnEvalOutput
    from miles_platform.rollout.evaluate import evals_table_rows
    from miles_platform.rollout.manager import _awaited
    from miles_platform.store.tables import append_rows

    t0, path = time.time(), cfg.eval_function_path
    fn = load_rollout_function(path, EVAL_FLAG).bind(manager.args, manager.data_source, evaluation=True)
    out = fn(rollout_id)
    if inspect.isawaitable(out):
        out = manager.client.submit(_awaited(out)).result()
    data, extra = (out.data, out.metrics) if isinstance(out, RolloutFnEvalOutput) else (out, None)
    if not isinstance(data, dict) or not all(isinstance(d, dict) and "rewards" in d for d in data.values()):
        raise ConfigError(
            f"{EVAL_FLAG} {path!r}: returned {type(out).__name__}; want RolloutFnEvalOutput(data={{dataset: "
            '{"rewards": [...], ...}}) or that data dict'
        )
    metrics, res = dict(extra or {}), {}
    for name, d in data.items():
        rewards = [0.0 if r is None else float(r) for r in d["rewards"]]
        n = max(len(rewards), 1)
        metrics[f"eval/{name}"] = sum(rewards) / n
        metrics[f"eval/{name}-none_reward_ratio"] = sum(r is None for r in d["rewards"]) / n
        if "truncated" in d:
            metrics[f"eval/{name}-truncated_ratio"] = sum(map(bool, d["truncated"])) / max(
                len(d["truncated"]), 1
            )
        if cfg.log_passrate:  # Miles' eval/<name>-pass@<k> over groups of --n-samples-per-eval-prompt
            from miles_platform.rollout.passrate import compute_pass_rate

            pr = compute_pass_rate(rewards, cfg.n_samples_per_eval_prompt)
            metrics.update({f"eval/{name}-{k}": v for k, v in pr.items()})
        res[name] = {"mean_reward": sum(rewards) / n, "n": len(rewards)}
    rows = evals_table_rows(partition_key(cfg.run_name, version), res, "loop", cfg.eval_settings().sampling)
    append_rows(paths, "evals", cfg.run_name, rows)
    metrics["perf/eval_time"] = time.time() - t0
    return metrics, res
