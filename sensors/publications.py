"""Publish each new policy version as disk-delta (`publish_on_new_policy` -> `publish_weights` job).

Cursor-based over `policy_versions` materializations (the cursor is the storage id of the last
event looked at), so after downtime the sensor resumes and catches up to the newest version of
each run (publications are append-only: older pending versions are skipped, not replayed). A
partition is requested at most once: run_key = `publish:<partition>` (Dagster drops a repeated
run key) and partitions that already have a `weight_publications` materialization are skipped.
Runs of one pub dir serialize on the publisher lock (`lock_wait_s`); give the
`disk_delta_publish` pool a limit of 1 to keep them strictly in order.
"""

import dagster as dg

from assets.partitions import policy_version_partitions
from miles_platform.store.paths import parse_partition_key
from sensors.policy_events import new_policy_versions

WEIGHT_PUBLICATIONS = dg.AssetKey("weight_publications")
MAX_RUNS_PER_TICK = 20

publish_weights_job = dg.define_asset_job(
    "publish_weights",
    selection=["weight_publications"],
    partitions_def=policy_version_partitions,
    description="Publish one policy version as a disk-delta weight publication.",
)


def plan_publish_requests(
    instance: dg.DagsterInstance, cursor: str | None, max_runs_per_tick: int = MAX_RUNS_PER_TICK
) -> tuple[list[dg.RunRequest], str | None]:
    """Run requests for policy_versions materializations after `cursor`: the newest pending version per run.

    Publications are append-only, so a version older than the newest already published can never
    be published; and when several versions of a run are pending at once (the trainer outran the
    sensor, or the UI just started on a finished run) a fleet wants the newest, not a replay of
    the chain. Each tick therefore requests at most one version per run, newer than its published ones.
    """
    done = set(instance.get_materialized_partitions(WEIGHT_PUBLICATIONS))
    newest: dict[str, int] = {}
    for key in done:
        run, v = parse_partition_key(key)
        newest[run] = max(v, newest.get(run, -1))

    def publishable(key: str, mat: dg.AssetMaterialization) -> bool:
        run, v = parse_partition_key(key)
        return v > newest.get(run, -1)

    keys, new_cursor, _ = new_policy_versions(instance, cursor, done, 10_000, publishable)
    pending: dict[str, str] = {}
    for key in keys:
        run, v = parse_partition_key(key)
        if run not in pending or v > parse_partition_key(pending[run])[1]:
            pending[run] = key
    requests = [
        dg.RunRequest(run_key=f"publish:{k}", partition_key=k, tags={"miles/trigger": "new_policy"})
        for k in list(pending.values())[:max_runs_per_tick]
    ]
    return requests, new_cursor


@dg.sensor(
    name="publish_on_new_policy",
    job=publish_weights_job,
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Publish every new policy version as a disk-delta weight publication.",
)
def publish_on_new_policy(context: dg.SensorEvaluationContext) -> dg.SensorResult:
    requests, cursor = plan_publish_requests(context.instance, context.cursor)
    if requests:
        return dg.SensorResult(run_requests=requests, cursor=cursor)
    return dg.SensorResult(skip_reason="no new policy versions to publish", cursor=cursor)
