"""Every run in Dagster: `runs_from_catalog` reports the versions of runs trained outside it.

A run launched with `miles-platform train` (or as a Ray job on a cluster) writes the same
`policy_versions` rows and lineage as the `rl_training` op, but no Dagster events. This sensor
reads new rows from the catalog's tables and reports, per version, the dynamic partition and the
`rollout_shards` / `policy_versions` (and for LoRA `lora_adapters`) materializations the op would
have logged: the same lineage metadata (ops/version_events.py builds both), the rollout's training
metrics from the `metrics` table, the run's eval settings from its `run_config.json`, plus
`reported_by: runs_from_catalog`. When the versions it reports end a run (its --num-rollout-th
rollout is recorded), it requests `check_run_health` for it, as `run_health_after_training` does
for runs Dagster launched.

No duplicates: a partition that already has a `policy_versions` materialization (the op reported
it) is skipped, and runs that an unfinished `rl_training` Dagster run is training are left alone
until it ends (the op reports a version a rollout after writing its row). The cursor is, per run,
the newest part handled (`part-<time_ns>-...`: one writer per run, so names grow; a compaction
keeps the part names in its file, store/tables.py `read_parts`); a run
being trained by Dagster keeps its cursor and is read again once that run ends.
"""

import json

import dagster as dg
import fsspec

from assets.partitions import policy_version_partitions
from miles_platform.config import RunConfig
from miles_platform.diffusion.config import DiffusionRunConfig
from miles_platform.store.paths import StoragePaths, parse_partition_key
from miles_platform.store.run_events import is_abandoned, resume_events
from miles_platform.store.run_health import run_finished
from miles_platform.store.tables import read_parts
from ops.presets import presets, run_name_for
from ops.version_events import POLICY_VERSIONS, CatalogVersions
from resources.storage import StorageRootResource
from sensors.run_health import run_health_job

TRAINING_JOB = "rl_training"
UNFINISHED = [
    dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING,
]  # fmt: skip
MAX_VERSIONS_PER_TICK = 500


def _training_jobs() -> list[tuple[str, str, str]]:
    """(job, op, run_name when the run config has none) of every job that trains a run."""

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
        # the parts appended after the cursor, each once (a compacted file holds parts it merged)
        rows_by_file = read_parts(paths, "policy_versions", run, after=done.get(run, ""))
        resumes = resume_events(paths, run)  # versions a resume abandoned are never reported
        rows_by_file = [(p, [r for r in rows if not is_abandoned("policy_versions", r, resumes)])
                        for p, rows in rows_by_file]  # fmt: skip
        todo = [r for _, rows in rows_by_file for r in rows if r["partition_key"] not in reported]
        stored = CatalogVersions.read(paths, run, todo) if todo else None
        for p, rows in rows_by_file:
            if len(keys) >= limit:
                break
            for row in rows:
                if row["partition_key"] in reported or row["partition_key"] in keys:
                    continue
                events += stored.events(row["partition_key"])
                keys.append(row["partition_key"])
            done[run] = p
    return events, keys, json.dumps(done, sort_keys=True), waiting


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
