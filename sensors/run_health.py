"""Run the run-health asset checks (assets/run_health.py) when an `rl_training` run (or a preset's) ends.

`check_run_health` executes the five checks on `rollout_shards` / `policy_versions` over the whole
storage root; `run_health_after_training` requests it once per finished run (success or failure:
run_key `health:<run id>`). Runs trained outside Dagster (`miles-platform train`, Ray jobs) are
checked when `runs_from_catalog` reports the versions that end them (sensors/catalog_runs.py);
one that crashed is checked from the asset pages' **Checks** tab (or by launching `check_run_health`).
"""

import dagster as dg

from ops.training import PRESET_JOBS, rl_training

run_health_job = dg.define_asset_job(
    "check_run_health",
    selection=dg.AssetSelection.checks_for_assets("rollout_shards", "policy_versions"),
    description="Run-health checks of every run in the store: contiguous rollout ids, expected version "
    "count, async staleness, HF export sanity, prompt coverage per epoch.",
)


def _request(context: dg.RunStatusSensorContext) -> dg.RunRequest:
    run_id = context.dagster_run.run_id
    return dg.RunRequest(
        run_key=f"health:{run_id}", tags={"miles/trigger": "training_ended", "miles/run_id": run_id}
    )


@dg.run_status_sensor(
    name="run_health_after_training",
    run_status=dg.DagsterRunStatus.SUCCESS,
    monitored_jobs=[rl_training, *PRESET_JOBS.values()],
    request_job=run_health_job,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Check run health after each successful rl_training run.",
)
def run_health_after_training(context: dg.RunStatusSensorContext):
    return _request(context)


@dg.run_failure_sensor(
    name="run_health_after_failed_training",
    monitored_jobs=[rl_training, *PRESET_JOBS.values()],
    request_job=run_health_job,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Check run health after each failed rl_training run (what did it leave behind?).",
)
def run_health_after_failed_training(context: dg.RunFailureSensorContext):
    return _request(context)
