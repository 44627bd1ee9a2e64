"""Sensors and schedules: eval and publication on new policy versions, nightly eval."""

import importlib

import dagster as dg

MODULES = ("evals", "publications", "scoreboard", "catalog_runs", "run_health")


def _collect(kind):
    mods = [importlib.import_module(f"sensors.{name}") for name in MODULES]
    return [v for mod in mods for v in vars(mod).values() if isinstance(v, kind)]


def all_sensors():
    return _collect(dg.SensorDefinition)


def all_schedules():
    return _collect(dg.ScheduleDefinition)
