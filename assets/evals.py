"""`eval_results`: pass@1 / pass@k / mean reward of one policy version on the eval datasets.

One partition per policy version `<run>.v<NNNNNN>`. The asset reads that version's HF export
(the `hf_path` of its `policy_versions` materialization, else the StoragePaths convention),
scores it with `miles_platform.rollout.evaluate` (the RL reward hub, so eval and training
rewards mean the same thing), then records the numbers three ways:

- the `evals` table (one row per dataset x metric), queryable with the DuckDB `evals` view;
- float materialization metadata `<dataset>/pass@1` ..., so the UI plots accuracy across versions;
- a lineage row `eval:<partition>` --evaluates--> `<partition>` (+ one per dataset evaluated_on).

The `eval_on_new_policy` sensor and the `nightly_eval` schedule (sensors/evals.py) request it.
"""

import os

import dagster as dg

from assets.partitions import policy_version_partitions
from miles_platform.store.paths import StoragePaths, parse_partition_key
from miles_platform.store.tables import append_rows
from resources.storage import StorageRootResource

EVAL_METRICS = ("pass@1", "pass@k", "mean_reward")


class EvalConfig(dg.Config):
    """Miles eval flags (snake_case). Sampling applies to pass@k / mean reward; pass@1 is greedy."""

    eval_prompt_data: list[str] = []  # `name path` pairs; empty = the latest eval_dataset materialization
    n_samples_per_eval_prompt: int = 1  # responses per prompt (the k of pass@k)
    eval_max_response_len: int = 16  # max new tokens per response
    eval_temperature: float = 1.0
    eval_top_p: float = 1.0
    eval_top_k: int = -1
    rm_type: str = "math"  # --rm-type of the reward hub
    custom_rm_path: str | None = None  # --custom-rm-path (dotted path), overrides rm_type
    input_key: str = "prompt"  # normalized eval_dataset columns
    label_key: str = "label"
    max_prompts: int | None = None  # evaluate only the first N prompts of each dataset
    seed: int = 0


def _latest_materialization(
    instance: dg.DagsterInstance, key: str, partition: str | None = None
) -> dg.AssetMaterialization | None:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(
            asset_key=dg.AssetKey(key), asset_partitions=[partition] if partition else None
        ),
        limit=1,
    ).records
    return records[0].asset_materialization if records else None


def _md(mat: dg.AssetMaterialization | None, key: str) -> str | None:
    value = None if mat is None else mat.metadata.get(key)
    return None if value is None or value.value in (None, "") else str(value.value)


def resolve_hf_path(instance: dg.DagsterInstance, paths: StoragePaths, partition: str) -> str:
    """HF export of a policy version: its materialization's hf_path, else the path convention."""
    run, version = parse_partition_key(partition)
    hf_path = _md(_latest_materialization(instance, "policy_versions", partition), "hf_path")
    hf_path = hf_path or paths.hf_export(run, version)
    if "://" not in hf_path and not os.path.isfile(os.path.join(hf_path, "config.json")):
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
    path = _md(_latest_materialization(instance, "eval_dataset"), "path")
    if path is None:
        raise dg.Failure(
            "no eval datasets: materialize eval_dataset or set eval_prompt_data (`name path` pairs)"
        )
    return [("eval", path)]


def eval_rows(partition: str, results: dict[str, dict]) -> list[dict]:
    """One `evals` table row per dataset x float metric (pass@1, pass@k, mean_reward, breakdowns)."""
    run, version = parse_partition_key(partition)
    return [
        {
            "version": version,
            "partition_key": partition,
            "dataset": name,
            "metric": metric,
            "value": float(value),
            "n_samples": int(res["n"]),
        }
        for name, res in results.items()
        for metric, value in res.items()
        if isinstance(value, float)
    ]


@dg.asset(
    partitions_def=policy_version_partitions,
    deps=["policy_versions", "eval_dataset"],
    group_name="evals",
    kinds={"pytorch", "duckdb"},
)
def eval_results(
    context: dg.AssetExecutionContext, config: EvalConfig, storage: StorageRootResource
) -> dg.MaterializeResult:
    """pass@1 (greedy), pass@k and mean reward of this policy version on each eval dataset."""
    from types import SimpleNamespace

    from miles_platform.rollout.evaluate import evaluate

    partition, paths = context.partition_key, storage.paths
    run, version = parse_partition_key(partition)
    hf_path = resolve_hf_path(context.instance, paths, partition)
    datasets = resolve_datasets(context.instance, config)
    context.log.info(f"evaluating {partition} ({hf_path}) on {', '.join(n for n, _ in datasets)}")
    rm_args = SimpleNamespace(
        rm_type=config.rm_type, custom_rm_path=config.custom_rm_path, group_rm=False, reward_key=None
    )
    results = evaluate(
        hf_path,
        datasets,
        n_samples_per_eval_prompt=config.n_samples_per_eval_prompt,
        max_new_tokens=config.eval_max_response_len,
        temperature=config.eval_temperature,
        top_p=config.eval_top_p,
        top_k=config.eval_top_k,
        args=rm_args,
        seed=config.seed,
        input_key=config.input_key,
        label_key=config.label_key,
        max_prompts=config.max_prompts,
    )
    append_rows(paths, "evals", run, eval_rows(partition, results))
    policy_hash = _md(_latest_materialization(context.instance, "policy_versions", partition), "content_hash")
    eval_data_version = _md(_latest_materialization(context.instance, "eval_dataset"), "content_hash")
    edges = [(partition, "policy_version", "evaluates", policy_hash)]
    edges += [(path, "dataset", "evaluated_on", eval_data_version) for _, path in datasets]
    append_rows(
        paths,
        "lineage",
        run,
        [
            {
                "child": f"eval:{partition}",
                "child_kind": "eval",
                "parent": parent,
                "parent_kind": kind,
                "relation": relation,
                "data_version": dv,
            }
            for parent, kind, relation, dv in edges
        ],
    )
    metadata: dict = {
        f"{name}/{metric}": float(value)
        for name, res in results.items()
        for metric, value in res.items()
        if isinstance(value, float)
    }
    metadata |= {
        "run": run,
        "version": version,
        "hf_path": dg.MetadataValue.path(hf_path),
        "datasets": dg.MetadataValue.json({name: path for name, path in datasets}),
        "num_prompts": dg.MetadataValue.json({name: res["num_prompts"] for name, res in results.items()}),
        "n_samples_per_eval_prompt": config.n_samples_per_eval_prompt,
        "summary": dg.MetadataValue.md(_summary(results)),
    }
    return dg.MaterializeResult(metadata=metadata)


def _summary(results: dict[str, dict]) -> str:
    lines = [
        "| dataset | pass@1 | pass@k | mean reward | prompts | k |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {name} | {r['pass@1']:.4f} | {r['pass@k']:.4f} | {r['mean_reward']:.4f} | {r['num_prompts']} | {r['k']} |"
        for name, r in results.items()
    ]
    return "\n".join(lines)
