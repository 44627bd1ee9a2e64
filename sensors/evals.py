"""Evals on new policy versions (`eval_on_new_policy` sensor) and every night (`nightly_eval`).

Both request `evaluate_policy` (`eval_job`), which materializes `eval_results` for one
policy-version partition with the training run's eval settings (the `eval_config` metadata the
`rl_training` op puts on each `policy_versions` materialization; without it, EvalConfig's
defaults; eval datasets = the run's `eval_prompt_data`, else the latest `eval_dataset`). Under
Dagster the loop does not evaluate, so this is the one evaluator of record of a run.

The sensor is cursor-based: the cursor is the storage id of the last `policy_versions`
materialization it has looked at, so after downtime it resumes where it stopped and catches
up (at most `max_runs_per_tick` run requests per tick; the rest on the next ticks). A version
is evaluated at most once: run_key = partition key (Dagster drops a repeated run key) and
partitions that already have an `eval_results` materialization are skipped.

Eval interval (Miles `--eval-interval`): version v is evaluated when v % interval == 0. The
interval comes from the materialization metadata `eval_interval` when the training op logs
it, else the sensor default (env MILES_EVAL_INTERVAL, default 1). Versions that
`runs_from_catalog` reported with `evaluated_in_loop` (a `miles-platform train` run with
--eval-interval and --eval-prompt-data) are left to the run's own evals.

Default status: the sensor starts RUNNING (a user who trains from the UI expects eval numbers
to appear without touching anything); the nightly schedule starts STOPPED (it spends compute
every night, so it is opt-in). Both can be toggled on the Automation page.
"""

import os

import dagster as dg

from assets.evals import eval_run_config, run_config_for_version
from assets.partitions import policy_version_partitions
from miles_platform.store.paths import parse_partition_key
from sensors.policy_events import new_policy_versions

EVAL_RESULTS = dg.AssetKey("eval_results")
MAX_RUNS_PER_TICK = 10

eval_job = dg.define_asset_job(
    "evaluate_policy",
    selection=["eval_results"],
    partitions_def=policy_version_partitions,
    description="Evaluate one policy version (pass@1 / pass@k / mean reward per eval dataset).",
)


def _interval(mat: dg.AssetMaterialization, default: int) -> int:
    md = mat.metadata.get("eval_interval")
    try:
        value = int(md.value) if md is not None and md.value not in (None, "") else default
    except (TypeError, ValueError):
        value = default
    return value if value > 0 else default


def _evaluated_in_loop(mat: dg.AssetMaterialization) -> bool:
    md = mat.metadata.get("evaluated_in_loop")
    return md is not None and str(md.value) == "true"


def _version(mat: dg.AssetMaterialization) -> int:
    md = mat.metadata.get("version")
    if md is not None and isinstance(md.value, int):
        return md.value
    return parse_partition_key(mat.partition)[1]


def plan_eval_requests(
    instance: dg.DagsterInstance,
    cursor: str | None,
    default_interval: int = 1,
    max_runs_per_tick: int = MAX_RUNS_PER_TICK,
) -> tuple[list[dg.RunRequest], str | None, int]:
    """Run requests for policy_versions materializations after `cursor` (a storage id).

    Returns (run requests, new cursor, number of events looked at). The cursor stops right
    after the last event handled, so a tick that hits `max_runs_per_tick` leaves the rest for
    the next tick.
    """
    evaluated = set(instance.get_materialized_partitions(EVAL_RESULTS))
    run_configs: dict[str, dict] = {}

    def due(key: str, mat: dg.AssetMaterialization) -> bool:
        if _evaluated_in_loop(mat):  # a run trained outside Dagster whose own loop evaluates it
            return False
        run_configs[key] = eval_run_config(mat)  # the training run's eval settings
        return _version(mat) % _interval(mat, default_interval) == 0

    keys, new_cursor, seen = new_policy_versions(instance, cursor, evaluated, max_runs_per_tick, due)
    requests = [
        dg.RunRequest(
            run_key=k, partition_key=k, run_config=run_configs[k], tags={"miles/trigger": "new_policy"}
        )
        for k in keys
    ]
    return requests, new_cursor, seen


def build_eval_sensor(
    name: str = "eval_on_new_policy",
    default_interval: int | None = None,
    max_runs_per_tick: int = MAX_RUNS_PER_TICK,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
) -> dg.SensorDefinition:
    """The eval-on-new-policy sensor; `default_interval` None = env MILES_EVAL_INTERVAL or 1."""
    interval = default_interval or int(os.environ.get("MILES_EVAL_INTERVAL", "1") or 1)

    @dg.sensor(
        name=name,
        job=eval_job,
        minimum_interval_seconds=30,
        default_status=default_status,
        description=f"Evaluate each new policy version v with v % eval_interval == 0 (default interval {interval}).",
    )
    def _sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        requests, cursor, seen = plan_eval_requests(
            context.instance, context.cursor, interval, max_runs_per_tick
        )
        if requests:
            return dg.SensorResult(run_requests=requests, cursor=cursor)
        reason = (
            f"looked at {seen} new policy version(s); none due for eval" if seen else "no new policy versions"
        )
        return dg.SensorResult(skip_reason=reason, cursor=cursor)

    return _sensor


eval_on_new_policy = build_eval_sensor()


@dg.schedule(
    cron_schedule="0 3 * * *",
    job=eval_job,
    name="nightly_eval",
    default_status=dg.DefaultScheduleStatus.STOPPED,
    description="Every night at 03:00, evaluate the latest policy version of each run on the eval datasets.",
)
def nightly_eval(context: dg.ScheduleEvaluationContext):
    latest: dict[str, tuple[int, str]] = {}
    for key in context.instance.get_dynamic_partitions(policy_version_partitions.name):
        try:
            run, version = parse_partition_key(key)
        except ValueError:
            continue
        if version > latest.get(run, (-1, ""))[0]:
            latest[run] = (version, key)
    if not latest:
        return dg.SkipReason("no policy versions yet")
    day = context.scheduled_execution_time.strftime("%Y-%m-%d") if context.scheduled_execution_time else "now"
    return [
        dg.RunRequest(
            run_key=f"nightly:{day}:{key}",
            partition_key=key,
            run_config=run_config_for_version(context.instance, key),
            tags={"miles/trigger": "nightly"},
        )
        for _, key in sorted(latest.values(), key=lambda vk: vk[1])
    ]
