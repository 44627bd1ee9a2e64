"""Evals on new policy versions (`eval_on_new_policy` sensor) and every night (`nightly_eval`).

Both request `evaluate_policy` (`eval_job`), which materializes `eval_results` for one
policy-version partition with the training run's eval settings (the `eval_config` metadata the
`rl_training` op puts on each `policy_versions` materialization; without it, EvalConfig's
defaults; eval datasets = the run's `eval_prompt_data`, else the latest `eval_dataset`). Under
Dagster the loop does not evaluate, so this is the one evaluator of record of a run.

Which versions (`EvalPolicy`, from the environment when the code location loads): a version v is
due when v % interval == 0 or it is its run's final version (metadata `final`, set when its
rollout is the last of --num-rollout that updates weights). The interval is the run's
--eval-interval (metadata `eval_interval`) when it has one, else MILES_EVAL_INTERVAL (default 10).
At most MILES_EVAL_MAX_PER_RUN requests per run (default 20; 0 = no cap; the final version comes
anyway) and MILES_EVAL_MAX_PER_TICK per tick (default 2; the rest on the next ticks, every 30 s):
each eval is a subprocess of tens of seconds. Versions that `runs_from_catalog` reported with
`evaluated_in_loop` (a `miles-platform train` run with --eval-interval and --eval-prompt-data, a
diffusion run) are left to the run's own evals.

The cursor (JSON) holds the storage id of the last `policy_versions` materialization looked at,
so after downtime the sensor resumes where it stopped, and how many requests each run got. A
version is evaluated at most once: run_key = partition key (Dagster drops a repeated run key) and
partitions that already have an `eval_results` materialization are skipped.

Default status: the sensor starts RUNNING (a user who trains from the UI expects eval numbers
to appear without touching anything); the nightly schedule starts STOPPED (it spends compute
every night, so it is opt-in). Both can be toggled on the Automation page.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import dagster as dg

from assets.evals import eval_run_config, run_config_for_version
from assets.metadata import metadata_text
from assets.partitions import policy_version_partitions
from miles_platform.store.paths import parse_partition_key
from sensors.policy_events import new_policy_versions
from sensors.settings import env_int

EVAL_RESULTS = dg.AssetKey("eval_results")

eval_job = dg.define_asset_job(
    "evaluate_policy",
    selection=["eval_results"],
    partitions_def=policy_version_partitions,
    description="Evaluate one policy version (greedy pass@1, sampled pass@k and mean reward per eval dataset).",
)


@dataclass(frozen=True)
class EvalPolicy:
    """Which new versions the sensor evaluates, and how many at once."""

    interval: int = 10  # every interval-th version of a run without --eval-interval
    max_per_tick: int = 2  # run requests per tick (one tick every 30 s)
    max_per_run: int = 20  # run requests per run, its final version excepted; 0 = no cap

    @classmethod
    def from_env(cls) -> EvalPolicy:
        """The defaults, overridden by MILES_EVAL_INTERVAL, MILES_EVAL_MAX_PER_TICK (integers >= 1)
        and MILES_EVAL_MAX_PER_RUN (>= 0)."""
        d = cls()
        return cls(
            interval=env_int("MILES_EVAL_INTERVAL", d.interval, 1,
                             "evaluate every N-th version of a run without --eval-interval"),
            max_per_tick=env_int("MILES_EVAL_MAX_PER_TICK", d.max_per_tick, 1,
                                 "eval runs the sensor requests per tick"),
            max_per_run=env_int("MILES_EVAL_MAX_PER_RUN", d.max_per_run, 0,
                                "eval runs requested per training run, its final version excepted; 0 = no cap"),
        )  # fmt: skip


@dataclass
class EvalCursor:
    """The sensor's cursor: the last materialization looked at, the requests made per run."""

    after: str | None = None
    requested: Counter = field(default_factory=Counter)

    @classmethod
    def parse(cls, cursor: str | None) -> EvalCursor:
        if not cursor:
            return cls()
        if cursor.isdigit():  # before 2026-12-05: the storage id alone
            return cls(after=cursor)
        data = json.loads(cursor)
        return cls(after=data.get("after"), requested=Counter(data.get("requested", {})))

    def dump(self) -> str:
        return json.dumps({"after": self.after, "requested": dict(sorted(self.requested.items()))})


@dataclass
class EvalPlan:
    requests: list[dg.RunRequest]
    cursor: str
    seen: int  # policy_versions materializations looked at
    capped: list[str]  # runs whose versions were skipped because they reached max_per_run


def _interval(mat: dg.AssetMaterialization, default: int) -> int:
    try:
        value = int(metadata_text(mat, "eval_interval") or default)
    except ValueError:
        value = default
    return value if value > 0 else default


def _version(mat: dg.AssetMaterialization) -> int:
    md = mat.metadata.get("version")
    if md is not None and isinstance(md.value, int):
        return md.value
    return parse_partition_key(mat.partition)[1]


def plan_eval_requests(
    instance: dg.DagsterInstance, cursor: str | None, policy: EvalPolicy = EvalPolicy()
) -> EvalPlan:
    """Run requests for the due versions among policy_versions materializations after `cursor`.

    The cursor stops right after the last event handled, so a tick that hits
    `policy.max_per_tick` leaves the rest for the next tick."""
    state = EvalCursor.parse(cursor)
    evaluated = set(instance.get_materialized_partitions(EVAL_RESULTS))
    run_configs: dict[str, dict] = {}
    capped: set[str] = set()

    def due(key: str, mat: dg.AssetMaterialization) -> bool:
        if metadata_text(mat, "evaluated_in_loop") == "true":  # a run whose own loop evaluates it
            return False
        run, final = parse_partition_key(key)[0], metadata_text(mat, "final") == "true"
        if not final and _version(mat) % _interval(mat, policy.interval):
            return False
        if not final and policy.max_per_run and state.requested[run] >= policy.max_per_run:
            capped.add(run)
            return False
        state.requested[run] += 1
        run_configs[key] = eval_run_config(mat)  # the training run's eval settings
        return True

    keys, state.after, seen = new_policy_versions(instance, state.after, evaluated, policy.max_per_tick, due)
    requests = [
        dg.RunRequest(
            run_key=k, partition_key=k, run_config=run_configs[k], tags={"miles/trigger": "new_policy"}
        )
        for k in keys
    ]
    return EvalPlan(requests, state.dump(), seen, sorted(capped))


def build_eval_sensor(
    name: str = "eval_on_new_policy",
    policy: EvalPolicy | None = None,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
) -> dg.SensorDefinition:
    """The eval-on-new-policy sensor; `policy` None = EvalPolicy.from_env()."""
    policy = policy or EvalPolicy.from_env()

    @dg.sensor(
        name=name,
        job=eval_job,
        minimum_interval_seconds=30,
        default_status=default_status,
        description=f"Evaluate new policy versions: every --eval-interval-th of a run (without one every "
        f"{policy.interval}th) and its final version; at most {policy.max_per_tick} per tick and "
        f"{policy.max_per_run or 'unlimited'} per run (env MILES_EVAL_INTERVAL / _MAX_PER_TICK / _MAX_PER_RUN).",
    )
    def _sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        plan = plan_eval_requests(context.instance, context.cursor, policy)
        if plan.capped:
            context.log.info(
                f"run(s) {', '.join(plan.capped)} got {policy.max_per_run} eval requests "
                "(MILES_EVAL_MAX_PER_RUN): only their final version will be evaluated now"
            )
        if plan.requests:
            return dg.SensorResult(run_requests=plan.requests, cursor=plan.cursor)
        reason = (
            f"looked at {plan.seen} new policy version(s); none due for eval"
            if plan.seen
            else "no new policy versions"
        )
        return dg.SensorResult(skip_reason=reason, cursor=plan.cursor)

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
