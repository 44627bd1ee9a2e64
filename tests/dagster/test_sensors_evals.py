"""eval_on_new_policy: one run request per new policy version, cursor-based, interval-aware."""

from datetime import UTC, datetime

import dagster as dg
import pytest

from assets.evals import eval_results
from resources.storage import StorageRootResource
from sensors.evals import build_eval_sensor, eval_job, eval_on_new_policy, nightly_eval


@pytest.fixture
def instance():
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


def _log_versions(instance, run, versions, **metadata):
    keys = [f"{run}.v{v:06d}" for v in versions]
    instance.add_dynamic_partitions("policy_versions", keys)
    for v, key in zip(versions, keys, strict=True):
        instance.report_runless_asset_event(
            dg.AssetMaterialization("policy_versions", partition=key, metadata={"version": v, **metadata})
        )
    return keys


def _defs(**kwargs):
    return dg.Definitions(
        assets=[eval_results], jobs=[eval_job], resources={"storage": StorageRootResource()}, **kwargs
    )


def _tick(sensor, instance, cursor):
    defs = _defs(sensors=[sensor])
    ctx = dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs)
    with dg.partition_loading_context(dynamic_partitions_store=instance):  # validates partition keys
        data = sensor.evaluate_tick(ctx)
    return data.run_requests, data.cursor


def test_each_new_version_requested_once_and_cursor_resumes(instance):
    keys = _log_versions(instance, "demo", [1, 2, 3])
    requests, cursor = _tick(eval_on_new_policy, instance, None)
    assert sorted(r.partition_key for r in requests) == keys
    assert {r.run_key for r in requests} == set(keys)
    assert all(r.job_name in (None, "evaluate_policy") for r in requests)

    requests, cursor = _tick(eval_on_new_policy, instance, cursor)
    assert requests == []

    (key4,) = _log_versions(instance, "demo", [4])
    requests, cursor = _tick(eval_on_new_policy, instance, cursor)
    assert [r.partition_key for r in requests] == [key4]


def test_interval_two_evaluates_only_even_versions(instance):
    _log_versions(instance, "demo", [1, 2, 3, 4, 5])
    requests, _ = _tick(build_eval_sensor("evals_every_2", default_interval=2), instance, None)
    assert [r.partition_key for r in requests] == ["demo.v000002", "demo.v000004"]


@pytest.mark.parametrize("interval", [3, dg.MetadataValue.text("3")])  # older instances: int; the op: text
def test_interval_from_materialization_metadata_wins(instance, interval):
    _log_versions(instance, "demo", [1, 2, 3, 4, 5, 6], eval_interval=interval)
    requests, _ = _tick(eval_on_new_policy, instance, None)
    assert [r.partition_key for r in requests] == ["demo.v000003", "demo.v000006"]


def test_requests_carry_the_training_runs_eval_settings(instance):
    run_eval = {"eval_temperature": 0.7, "eval_max_response_len": 8, "rm_type": "f1", "unknown_key": 1}
    _log_versions(instance, "demo", [1], eval_config=dg.MetadataValue.json(run_eval))
    _log_versions(instance, "old", [1])  # logged before eval_config existed: EvalConfig defaults
    requests, _ = _tick(eval_on_new_policy, instance, None)
    configs = {r.partition_key: r.run_config for r in requests}
    assert configs["demo.v000001"] == {
        "ops": {
            "eval_results": {"config": {"eval_temperature": 0.7, "eval_max_response_len": 8, "rm_type": "f1"}}
        }
    }
    assert configs["old.v000001"] == {}


def test_catch_up_is_bounded_per_tick_and_loses_nothing(instance):
    keys = _log_versions(instance, "demo", range(1, 8))
    sensor = build_eval_sensor("bounded", default_interval=1, max_runs_per_tick=3)
    got, cursor = [], None
    for _ in range(4):
        requests, cursor = _tick(sensor, instance, cursor)
        assert len(requests) <= 3
        got += [r.partition_key for r in requests]
    assert got == keys


def test_already_evaluated_version_is_not_requested_again(instance):
    _log_versions(instance, "demo", [1, 2])
    instance.report_runless_asset_event(dg.AssetMaterialization("eval_results", partition="demo.v000001"))
    requests, _ = _tick(eval_on_new_policy, instance, None)
    assert [r.partition_key for r in requests] == ["demo.v000002"]


def test_nightly_eval_requests_latest_version_of_each_run(tmp_path):
    instance = dg.DagsterInstance.local_temp(str(tmp_path))  # schedule contexts need an instance ref
    _log_versions(instance, "a", [1, 2, 3], eval_config=dg.MetadataValue.json({"eval_top_k": 5}))
    _log_versions(instance, "b", [1])
    when = datetime(2026, 1, 2, 3, 0, tzinfo=UTC)
    repo = _defs(schedules=[nightly_eval]).get_repository_def()
    ctx = dg.build_schedule_context(instance=instance, scheduled_execution_time=when, repository_def=repo)
    with dg.partition_loading_context(dynamic_partitions_store=instance):
        requests = nightly_eval.evaluate_tick(ctx).run_requests
    assert {r.run_key for r in requests} == {"nightly:2026-01-02:a.v000003", "nightly:2026-01-02:b.v000001"}
    assert sorted(r.partition_key for r in requests) == ["a.v000003", "b.v000001"]
    configs = {r.partition_key: r.run_config for r in requests}  # each run's own eval settings
    assert configs == {"a.v000003": {"ops": {"eval_results": {"config": {"eval_top_k": 5}}}}, "b.v000001": {}}
    assert nightly_eval.cron_schedule == "0 3 * * *"
    assert nightly_eval.default_status == dg.DefaultScheduleStatus.STOPPED
    assert eval_on_new_policy.default_status == dg.DefaultSensorStatus.RUNNING
