"""`eval_results`: greedy pass@1, sampled pass@k and mean reward of one policy version on the eval datasets.

One partition per policy version `<run>.v<NNNNNN>`. The asset reads that version's HF export
(the `hf_path` of its `policy_versions` materialization, else the StoragePaths convention),
scores it with `miles_platform.rollout.evaluate` (the RL reward hub, so eval and training
rewards mean the same thing), then records the numbers three ways:

- the `evals` table (one row per dataset x metric, `source` "asset", with the sampling used),
  queryable with the DuckDB `evals` view;
- float materialization metadata `<dataset>/<metric>`, so the UI plots accuracy across versions,
  and a `summary` table; the metric names say their sampling (`pass@1` greedy, `pass@4(T=1)`,
  `mean_reward@4(T=1)`: miles_platform/rollout/evaluate.py), the same in rows and metadata;
- a lineage row `eval:<partition>` --evaluates--> `<partition>` (+ one per dataset evaluated_on).

The `eval_on_new_policy` sensor and the `nightly_eval` schedule (sensors/evals.py) request it,
with the training run's eval settings (`eval_config_for_run`): under Dagster it is the run's
evaluator of record (the `rl_training` op turns the loop's own eval off).
"""

import os

import dagster as dg

from assets.metadata import latest_materialization, metadata_text
from assets.partitions import policy_version_partitions
from miles_platform.config import DATASET_FLAGS, REWARD_FLAGS, RewardSettings, RunConfig
from miles_platform.store.lineage_identity import Edge, write_edges
from miles_platform.store.paths import StoragePaths, parse_partition_key
from miles_platform.store.tables import append_rows
from resources.storage import StorageRootResource


class EvalConfig(dg.Config):
    """Miles eval flags (snake_case). The sampling makes pass@<n>(T=<T>) / mean_reward@<n>(T=<T>);
    pass@1 is greedy."""

    eval_prompt_data: list[str] = []  # `name path` pairs; empty = the latest eval_dataset materialization
    n_samples_per_eval_prompt: int = 1  # responses per prompt (the n of pass@<n>(T=..))
    eval_max_response_len: int = 16  # max new tokens per response
    eval_temperature: float = 1.0
    eval_top_p: float = 1.0
    eval_top_k: int = -1
    rm_type: str = "math"  # --rm-type of the reward hub
    rm_url: str | None = None  # --rm-url for rm_type remote_rm
    custom_rm_path: str | None = None  # --custom-rm-path (dotted path), overrides rm_type
    group_rm: bool = False  # --group-rm: custom_rm_path scores a whole group
    reward_key: str | None = None  # key of a dict reward (--reward-key) ...
    eval_reward_key: str | None = None  # ... or its eval override (--eval-reward-key)
    input_key: str = "prompt"  # normalized eval_dataset columns
    label_key: str = "label"
    metadata_key: str = "metadata"
    apply_chat_template: bool = False  # render prompts with the policy's chat template
    multimodal_keys: str | None = None  # --multimodal-keys (JSON): image prompts, a vision-language policy
    max_prompts: int | None = None  # evaluate only the first N prompts of each dataset
    seed: int = 0


def resolve_hf_path(instance: dg.DagsterInstance, paths: StoragePaths, partition: str) -> str:
    """HF export of a policy version: its materialization's hf_path, else the path convention. A
    LoRA version (adapter + frozen base, no HF export) is merged on demand, once, at the
    convention's path: what eval_results and weight_publications read."""
    run, version = parse_partition_key(partition)
    mat = latest_materialization(instance, "policy_versions", partition)
    hf_path = metadata_text(mat, "hf_path")
    adapter, base = metadata_text(mat, "adapter_path"), metadata_text(mat, "base_checkpoint")
    if not hf_path and adapter and base:
        hf_path = paths.hf_export(run, version)
        if not os.path.isfile(os.path.join(hf_path, "config.json")):
            from miles_platform.training.lora import export_merged_hf_dir

            export_merged_hf_dir(base, adapter, hf_path)  # atomic: a tmp dir renamed into place
    hf_path = hf_path or paths.hf_export(run, version)
    exported = any(os.path.isfile(os.path.join(hf_path, f)) for f in ("config.json", "model_index.json"))
    if "://" not in hf_path and not exported:  # an HF dir, or a diffusers pipeline (diffusion runs)
        raise dg.Failure(
            f"policy version {partition}: no HF export at {hf_path} (config.json missing); "
            "materialize policy_versions with an hf_path or export the version there"
        )
    return hf_path


def resolve_datasets(instance: dg.DagsterInstance, config: EvalConfig) -> list[tuple[str, str]]:
    pairs = list(config.eval_prompt_data)
    if pairs:
        if len(pairs) % 2:
            raise dg.Failure(f"eval_prompt_data takes `name path` pairs, got {pairs}")
        return list(zip(pairs[::2], pairs[1::2], strict=True))
    path = metadata_text(latest_materialization(instance, "eval_dataset"), "path")
    if path is None:
        raise dg.Failure(
            "no eval datasets: materialize eval_dataset or set eval_prompt_data (`name path` pairs)"
        )
    return [("eval", path)]


def sampling_of(config: EvalConfig) -> dict:
    """The sampling of pass@<n>(T=..) / mean_reward@<n>(T=..), as `evaluate` takes it and the `evals`
    rows record it."""
    return {
        "max_new_tokens": config.eval_max_response_len,
        "temperature": config.eval_temperature,
        "top_p": config.eval_top_p,
        "top_k": config.eval_top_k,
    }


def eval_config_for_run(cfg: RunConfig) -> dict:
    """The EvalConfig that evaluates a training run's versions as its own flags ask: eval sampling
    (inheriting the rollout's as `train` does), reward and seed; its `--eval-prompt-data` (read with
    the run's dataset keys) when given, else the latest `eval_dataset`. Under Dagster the
    `eval_results` asset is the run's evaluator of record; the sensor passes this as run config."""
    e = cfg.eval_settings()
    out = {
        "n_samples_per_eval_prompt": e.n_samples_per_eval_prompt,
        "eval_max_response_len": e.max_new_tokens,
        "eval_temperature": e.temperature,
        "eval_top_p": e.top_p,
        "eval_top_k": e.top_k,
        **{k: getattr(cfg, k) for k in REWARD_FLAGS},
        "seed": cfg.seed,
    }
    if cfg.eval_prompt_data:  # read as `train` reads them (the normalized eval_dataset has its own keys)
        out |= {k: getattr(cfg, k) for k in ("eval_prompt_data", *DATASET_FLAGS, "multimodal_keys")}
        out["label_key"] = cfg.label_key or "label"
    return {k: v for k, v in out.items() if v is not None and k in EvalConfig.model_fields}


def reward_settings(config: EvalConfig) -> RewardSettings:
    """The reward hub's view of an EvalConfig (rm_type, custom_rm_path, reward keys ...); a custom
    reward function receives these settings as its `args`."""
    return RewardSettings(**{k: getattr(config, k) for k in REWARD_FLAGS})


def evaluate_and_record(
    paths: StoragePaths,
    partition: str,
    hf_path: str,
    datasets: list[tuple[str, str]],
    config: EvalConfig,
    evaluates: tuple[str, str, str | None],
    eval_data_version: str | None,
) -> dict[str, dict]:
    """Evaluate `hf_path` on `datasets` as `config` says; append the `evals` rows (source `asset`) and
    the lineage rows `eval:<partition>` --evaluates--> `evaluates` (key, kind, data version) and
    --evaluated_on--> each dataset. eval_results and the scoreboard's base eval both call it."""
    from miles_platform.data.images import parse_multimodal_keys
    from miles_platform.rollout.evaluate import evals_table_rows, evaluate

    run, _ = parse_partition_key(partition)
    results = evaluate(
        hf_path,
        datasets,
        n_samples_per_eval_prompt=config.n_samples_per_eval_prompt,
        **sampling_of(config),
        rewards=reward_settings(config),
        seed=config.seed,
        input_key=config.input_key,
        label_key=config.label_key,
        metadata_key=config.metadata_key,
        apply_chat_template=config.apply_chat_template,
        max_prompts=config.max_prompts,
        multimodal_keys=parse_multimodal_keys(config.multimodal_keys),
    )
    append_rows(paths, "evals", run, evals_table_rows(partition, results, "asset", sampling_of(config)))
    key, kind, data_version = evaluates
    child = f"eval:{partition}"
    edges = [Edge(child, "eval", key, kind, "evaluates", data_version)]
    edges += [Edge(child, "eval", path, "dataset", "evaluated_on", eval_data_version) for _, path in datasets]
    write_edges(paths, run, edges)
    return results


@dg.asset(
    partitions_def=policy_version_partitions,
    deps=["policy_versions", "eval_dataset"],
    group_name="evals",
    kinds={"pytorch", "duckdb"},
)
def eval_results(
    context: dg.AssetExecutionContext, config: EvalConfig, storage: StorageRootResource
) -> dg.MaterializeResult:
    """pass@1 (greedy), pass@<n>(T=<T>) and mean_reward@<n>(T=<T>) (n samples at temperature T)
    of this policy version on each eval dataset."""
    partition, paths = context.partition_key, storage.paths
    run, version = parse_partition_key(partition)
    hf_path = resolve_hf_path(context.instance, paths, partition)
    datasets = resolve_datasets(context.instance, config)
    context.log.info(f"evaluating {partition} ({hf_path}) on {', '.join(n for n, _ in datasets)}")
    policy_hash = metadata_text(
        latest_materialization(context.instance, "policy_versions", partition), "content_hash"
    )
    eval_data_version = metadata_text(
        latest_materialization(context.instance, "eval_dataset"), "content_hash"
    )
    results = evaluate_and_record(
        paths,
        partition,
        hf_path,
        datasets,
        config,
        (partition, "policy_version", policy_hash),
        eval_data_version,
    )
    metadata: dict = {
        f"{name}/{metric}": float(value)
        for name, res in results.items()
        for metric, value in res.items()
        if isinstance(value, float)
    }
    metadata |= {
        "run": run,
        "version": dg.MetadataValue.text(str(version)),  # text: an identifier, not a curve
        "source": "asset",
        "sampling": dg.MetadataValue.json(sampling_of(config)),
        "hf_path": dg.MetadataValue.path(hf_path),
        "datasets": dg.MetadataValue.json({name: path for name, path in datasets}),
        "num_prompts": dg.MetadataValue.json({name: res["num_prompts"] for name, res in results.items()}),
        "n_samples_per_eval_prompt": config.n_samples_per_eval_prompt,
        "summary": dg.MetadataValue.md(_summary(results)),
    }
    return dg.MaterializeResult(metadata=metadata)


def eval_run_config(mat: dg.AssetMaterialization | None) -> dict:
    """`eval_results` run config for a policy version: its training run's eval settings (the
    `eval_config` metadata of its policy_versions materialization), else {} (EvalConfig defaults)."""
    md = None if mat is None else mat.metadata.get("eval_config")
    value = None if md is None else md.value
    if not isinstance(value, dict):
        return {}
    config = {k: v for k, v in value.items() if k in EvalConfig.model_fields}
    return {"ops": {"eval_results": {"config": config}}} if config else {}


def run_config_for_version(instance: dg.DagsterInstance, partition: str) -> dict:
    """What the sensor, the nightly schedule and the quickstart launch `eval_results[partition]` with."""
    return eval_run_config(latest_materialization(instance, "policy_versions", partition))


def _summary(results: dict[str, dict]) -> str:
    """One line per dataset, one column per metric, named as in the rows and the metadata."""
    metrics = list(dict.fromkeys(m for r in results.values() for m, v in r.items() if isinstance(v, float)))
    heads = [f"{m} (greedy)" if m == "pass@1" else m for m in metrics]
    lines = [f"| dataset | {' | '.join(heads)} | prompts |", "| --- |" + " --- |" * (len(metrics) + 1)]
    for name, r in results.items():
        cells = " | ".join("-" if r.get(m) is None else f"{r[m]:.4f}" for m in metrics)
        lines.append(f"| {name} | {cells} | {r['num_prompts']} |")
    return "\n".join(lines)
