"""Every run in Dagster: `runs_from_catalog` reports the versions of runs trained outside it.

A run launched with `miles-platform train` (or as a Ray job on a cluster) writes the same
`policy_versions` rows and lineage as the `rl_training` op, but no Dagster events. This sensor
reads new rows from the catalog's tables and reports, per version, the dynamic partition and the
`rollout_shards` / `policy_versions` (and for LoRA `lora_adapters`) materializations the op would
have logged: the same lineage metadata (assets/rollouts.py builds both), the rollout's training
metrics from the `metrics` table, the run's eval settings from its `run_config.json`, plus
`reported_by: runs_from_catalog`. When the versions it reports end a run (its --num-rollout-th
rollout is recorded), it requests `check_run_health` for it, as `run_health_after_training` does
for runs Dagster launched.

No duplicates: a partition that already has a `policy_versions` materialization (the op reported
it) is skipped, and runs that an unfinished `rl_training` Dagster run is training are left alone
until it ends (the op reports a version a rollout after writing its row). The cursor is, per run,
the newest part file handled (`part-<time_ns>-...`: one writer per run, so names grow); a run
being trained by Dagster keeps its cursor and is read again once that run ends.
"""

import json
from pathlib import Path
from typing import Any

import dagster as dg
import fsspec
import pyarrow.parquet as pq

from assets.evals import eval_config_for_run
from assets.partitions import policy_version_partitions
from assets.rollouts import lora_adapter_event, policy_version_event, rollout_shard_event
from miles_platform.config import RunConfig
from miles_platform.store.lineage_identity import read_edges
from miles_platform.store.paths import StoragePaths, parse_partition_key, partition_key
from miles_platform.store.run_events import committed_rows, is_abandoned, resume_events
from miles_platform.store.run_health import run_finished, saved_run_config
from miles_platform.store.schemas import TABLE_SCHEMAS
from miles_platform.store.tables import read_rows
from miles_platform.store.versions import is_final_version
from ops.presets import presets, run_name_for
from resources.storage import StorageRootResource
from sensors.run_health import run_health_job

POLICY_VERSIONS = dg.AssetKey("policy_versions")
TRAINING_JOB = "rl_training"
UNFINISHED = [
    dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING,
]  # fmt: skip
REPORTED_BY = {"reported_by": "runs_from_catalog"}
MAX_VERSIONS_PER_TICK = 500


def _training_jobs() -> list[tuple[str, str, str]]:
    """(job, op, run_name when the run config has none) of every job that trains a run."""
    from miles_platform.diffusion.config import DiffusionRunConfig

    def default(cls) -> str:
        return cls.__dataclass_fields__["run_name"].default

    return [
        (TRAINING_JOB, "rl_training_op", default(RunConfig)),
        *((p.job_name, "rl_training_op", p.config["run_name"]) for p in presets()),
        ("diffusion_training", "diffusion_training_op", default(DiffusionRunConfig)),
    ]


def runs_trained_by_dagster_now(instance: dg.DagsterInstance) -> set[str]:
    """Run names (`--run-name`) of the unfinished training runs (`rl_training`, its presets,
    `diffusion_training`) of this instance."""
    names = set()
    for job, op, default in _training_jobs():
        for run in instance.get_runs(filters=dg.RunsFilter(job_name=job, statuses=UNFINISHED)):
            config = (run.run_config or {}).get("ops", {}).get(op, {}).get("config", {})
            names.add(run_name_for(config.get("run_name") or default, run))
    return names


def _run_context(
    paths: StoragePaths,
    run: str,
    rows: list[dict],
    eval_config: dict[str, Any] | None = None,
    extra: dict[str, str] | None = None,
) -> dict[str, Any]:
    lineage = read_edges(paths, run)
    base = next((e["parent"] for e in lineage if e["relation"] == "base_checkpoint"), None)
    teachers: dict[str, list] = {}
    for e in lineage:
        if e["relation"] == "distilled_from":
            teachers.setdefault(e["child"], []).append(
                {"teacher": e["parent"], "kind": e["parent_kind"], "content_hash": e["data_version"]}
            )
    metrics: dict[int, dict[str, float]] = {}
    for m in read_rows(paths, "metrics", run):
        metrics.setdefault(m["rollout_id"], {})[m["name"]] = m["value"]
    cfg = saved_run_config(paths, run, rows)
    if eval_config is None:
        eval_config = eval_config_for_run(cfg) if cfg is not None else {}
    extra = dict(REPORTED_BY if extra is None else extra)
    if cfg is not None and cfg.eval_prompt_data and cfg.eval_interval:
        extra["evaluated_in_loop"] = "true"  # the run's own evals are in `evals`: the sensor skips it
    from miles_platform.diffusion.loop import DIFFUSION_CONFIG

    if Path(paths.run_dir(run), DIFFUSION_CONFIG).is_file():  # a diffusion run evaluates itself
        extra.update(task="diffusion", evaluated_in_loop="true")
    return {"base": base, "teachers": teachers, "metrics": metrics, "cfg": cfg, "eval_config": eval_config,
            "extra": extra}  # fmt: skip


def _events(row: dict, run: str, ctx: dict[str, Any]) -> list[dg.AssetMaterialization]:
    cfg = ctx["cfg"]
    info = {
        **row,
        "run": run,
        "parent_partition_key": partition_key(run, row["parent_version"]),
        "base_checkpoint": ctx["base"],
        "prompt_data": cfg.prompt_data if cfg else None,
        "eval_interval": cfg.eval_interval if cfg else None,
        "final": cfg is not None and is_final_version(cfg, row["rollout_id"]),
        "distilled_from": ctx["teachers"].get(row["partition_key"], []),
    }
    metrics = ctx["metrics"].get(row["rollout_id"], {})
    events = [rollout_shard_event(info, ctx["extra"])]
    if info.get("adapter_path") and Path(info["adapter_path"]).is_dir() and ctx["base"]:
        events.append(lora_adapter_event(info, ctx["extra"]))
    return [*events, policy_version_event(info, metrics, ctx["eval_config"], ctx["extra"])]


def plan_catalog_reports(
    instance: dg.DagsterInstance, paths: StoragePaths, cursor: str | None, limit: int = MAX_VERSIONS_PER_TICK
) -> tuple[list[dg.AssetMaterialization], list[str], str, list[str]]:
    """(events, new partition keys, new cursor, runs left for later because Dagster trains them)."""
    done: dict[str, str] = json.loads(cursor) if cursor else {}
    fs, root = fsspec.core.url_to_fs(paths.table_dir("policy_versions"))
    if not fs.exists(root):
        return [], [], json.dumps(done), []
    busy = runs_trained_by_dagster_now(instance)
    reported = set(instance.get_materialized_partitions(POLICY_VERSIONS))
    events, keys, waiting = [], [], []
    for run_dir in sorted(fs.glob(f"{root}/run=*")):
        run = run_dir.rsplit("/run=", 1)[1]
        if run in busy:
            waiting.append(run)
            continue
        files = sorted(
            p for p in fs.glob(f"{run_dir}/part-*.parquet") if p.rsplit("/", 1)[1] > done.get(run, "")
        )
        rows_by_file = []
        for p in files:
            with fs.open(p, "rb") as f:
                rows_by_file.append(
                    (p, pq.read_table(f, schema=TABLE_SCHEMAS["policy_versions"]).to_pylist())
                )
        resumes = resume_events(paths, run)  # versions a resume abandoned are never reported
        rows_by_file = [(p, [r for r in rows if not is_abandoned("policy_versions", r, resumes)])
                        for p, rows in rows_by_file]  # fmt: skip
        todo = [r for _, rows in rows_by_file for r in rows if r["partition_key"] not in reported]
        ctx = _run_context(paths, run, todo) if todo else None
        for p, rows in rows_by_file:
            if len(keys) >= limit:
                break
            for row in rows:
                if row["partition_key"] in reported or row["partition_key"] in keys:
                    continue
                events += _events(row, run, ctx)
                keys.append(row["partition_key"])
            done[run] = p.rsplit("/", 1)[1]
    return events, keys, json.dumps(done, sort_keys=True), waiting


def run_version_reports(
    instance: dg.DagsterInstance,
    paths: StoragePaths,
    run: str,
    *,
    eval_config: dict[str, Any],
    extra: dict[str, str],
    complete: bool,
) -> tuple[list[dg.AssetMaterialization], list[str]]:
    """The events and new partition keys of one run's versions that have no `policy_versions`
    materialization yet: how the `rl_training` op reports a run it launched as a Ray job. Until
    the run is `complete`, a version waits for its rollout's metrics (written just after it)."""
    reported = set(instance.get_materialized_partitions(POLICY_VERSIONS))
    committed = committed_rows(paths, "policy_versions", run)  # a resume abandons versions: never reported
    latest = {r["partition_key"]: r for r in committed}  # a resume's row wins
    rows = [r for k, r in latest.items() if k not in reported]
    if not rows:
        return [], []
    ctx = _run_context(paths, run, rows, eval_config, extra)
    if not complete:
        rows = [r for r in rows if r["rollout_id"] in ctx["metrics"]]
    rows.sort(key=lambda r: r["version"])
    return [e for r in rows for e in _events(r, run, ctx)], [r["partition_key"] for r in rows]


@dg.sensor(
    name="runs_from_catalog",
    minimum_interval_seconds=30,
    jobs=[run_health_job],
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Report the policy versions of runs trained outside Dagster (`miles-platform train`, Ray "
    "jobs) as rollout_shards / policy_versions partitions, read from the catalog; never twice.",
)
def runs_from_catalog(context: dg.SensorEvaluationContext, storage: StorageRootResource) -> dg.SensorResult:
    events, keys, cursor, waiting = plan_catalog_reports(context.instance, storage.paths, context.cursor)
    if not keys:
        why = f"; waiting for the Dagster run(s) training {', '.join(waiting)}" if waiting else ""
        return dg.SensorResult(skip_reason=f"no versions trained outside Dagster{why}", cursor=cursor)
    context.log.info(f"reporting {len(keys)} version(s): {keys[0]} .. {keys[-1]}")
    return dg.SensorResult(
        asset_events=events,
        dynamic_partitions_requests=[policy_version_partitions.build_add_request(keys)],
        run_requests=health_requests(storage.paths, keys),
        cursor=cursor,
    )


def health_requests(paths: StoragePaths, keys: list[str]) -> list[dg.RunRequest]:
    """A `check_run_health` run for each run whose reported versions end it (its --num-rollout-th
    rollout is recorded): what `run_health_after_training` does for Dagster-launched runs. One per
    (run, last version): a resumed run that trains on is checked again when it ends."""
    last: dict[str, str] = {}
    for k in keys:
        run, _ = parse_partition_key(k)
        last[run] = max(last.get(run, k), k)  # zero-padded: the newest version sorts last
    return [
        dg.RunRequest(
            run_key=f"health:{key}",
            job_name="check_run_health",
            tags={"miles/trigger": "catalog_run_ended", "miles/run": run},
        )  # fmt: skip
        for run, key in sorted(last.items())
        if run_finished(paths, run)
    ]
