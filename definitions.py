"""The Dagster code location: assembles assets, checks, jobs, sensors and resources. Nothing else."""

import dagster as dg

import assets
import ops
import sensors
from resources import default_resources

defs = dg.Definitions(
    assets=assets.all_assets(),
    asset_checks=assets.all_checks(),
    jobs=ops.all_jobs(),
    sensors=sensors.all_sensors(),
    schedules=sensors.all_schedules(),
    resources=default_resources(),
)
