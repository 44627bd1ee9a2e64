"""Sensors and schedules: eval and publication on new policy versions, nightly eval."""

import importlib

import dagster as dg

MODULES = ("evals", "publications", "scoreboard", "catalog_runs", "run_health")


def _collect(kind):
    out = []
    for name in MODULES:
        try:
            mod = importlib.import_module(f"sensors.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"sensors.{name}":
                raise
            continue
        out += [v for v in vars(mod).values() if isinstance(v, kind)]
    return out


def all_sensors():
    return _collect(dg.SensorDefinition)


def all_schedules():
    return _collect(dg.ScheduleDefinition)
