"""eval_on_new_policy: run requests for the due new policy versions (every --eval-interval-th, else
every 10th, and the final one), cursor-based, capped per tick and per run."""

from datetime import UTC, datetime

import dagster as dg
import pytest

from assets.evals import eval_results
from resources.storage import StorageRootResource
from sensors.evals import EvalPolicy, build_eval_sensor, eval_job, eval_on_new_policy, nightly_eval

EVERY_VERSION = build_eval_sensor("every_version", EvalPolicy(interval=1, max_per_tick=10))


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
    requests, cursor = _tick(EVERY_VERSION, instance, None)
    assert sorted(r.partition_key for r in requests) == keys
    assert {r.run_key for r in requests} == set(keys)
    assert all(r.job_name in (None, "evaluate_policy") for r in requests)

    requests, cursor = _tick(EVERY_VERSION, instance, cursor)
    assert requests == []

    (key4,) = _log_versions(instance, "demo", [4])
    requests, cursor = _tick(EVERY_VERSION, instance, cursor)
    assert [r.partition_key for r in requests] == [key4]


def test_interval_two_evaluates_only_even_versions(instance):
    _log_versions(instance, "demo", [1, 2, 3, 4, 5])
    requests, _ = _tick(build_eval_sensor("evals_every_2", EvalPolicy(interval=2)), instance, None)
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
    requests, _ = _tick(EVERY_VERSION, instance, None)
    configs = {r.partition_key: r.run_config for r in requests}
    assert configs["demo.v000001"] == {
        "ops": {
            "eval_results": {"config": {"eval_temperature": 0.7, "eval_max_response_len": 8, "rm_type": "f1"}}
        }
    }
    assert configs["old.v000001"] == {}


def test_catch_up_is_bounded_per_tick_and_loses_nothing(instance):
    keys = _log_versions(instance, "demo", range(1, 8))
    sensor = build_eval_sensor("bounded", EvalPolicy(interval=1, max_per_tick=3))
    got, cursor = [], None
    for _ in range(4):
        requests, cursor = _tick(sensor, instance, cursor)
        assert len(requests) <= 3
        got += [r.partition_key for r in requests]
    assert got == keys


def test_already_evaluated_version_is_not_requested_again(instance):
    _log_versions(instance, "demo", [1, 2])
    instance.report_runless_asset_event(dg.AssetMaterialization("eval_results", partition="demo.v000001"))
    requests, _ = _tick(EVERY_VERSION, instance, None)
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


# ---------------------------------------------------------------- no eval flood (issue 48)
def _drain(sensor, instance, cursor=None, ticks=30):
    """Tick until the sensor asks for nothing more: the partitions it requests, tick by tick."""
    per_tick = []
    for _ in range(ticks):
        requests, cursor = _tick(sensor, instance, cursor)
        if not requests:
            break
        per_tick.append([r.partition_key for r in requests])
    return per_tick


def test_a_cli_run_without_eval_interval_gets_every_10th_and_its_final_version(tmp_path, tiny_hf_checkpoint):
    """The README's `train ... --run-name mine` (no --eval-interval) beside `make ui`: the versions
    runs_from_catalog reports are evaluated every 10th and at the end, a few per tick; not all."""
    from store_builders import apply_sensor_tick, build_run

    from miles_platform.store.paths import StoragePaths
    from sensors.catalog_runs import runs_from_catalog

    paths = StoragePaths(str(tmp_path / "root"))
    build_run(paths, "mine", tiny_hf_checkpoint, 12)
    instance = dg.DagsterInstance.ephemeral()
    apply_sensor_tick(runs_from_catalog, instance, paths.root)
    per_tick = _drain(eval_on_new_policy, instance)
    assert [k for tick in per_tick for k in tick] == ["mine.v000010", "mine.v000012"]
    assert all(len(tick) <= 2 for tick in per_tick)


def test_the_ops_versions_carry_final_and_the_last_one_is_evaluated(tmp_path, tiny_hf_checkpoint, instance):
    """The Launchpad's smoke preset: 2 rollouts, no --eval-interval: one eval, of the final version."""
    from store_builders import build_run

    from miles_platform.store.paths import StoragePaths
    from ops.version_events import policy_version_event

    infos = build_run(StoragePaths(str(tmp_path / "root")), "smoke", tiny_hf_checkpoint, 2)
    for info in infos:  # what DagsterReporter logs
        instance.add_dynamic_partitions("policy_versions", [info.partition_key])
        instance.report_runless_asset_event(policy_version_event(info, {}, {}))
    assert _drain(eval_on_new_policy, instance) == [["smoke.v000002"]]


def test_the_runs_eval_interval_wins_and_its_final_version_is_evaluated_too(instance):
    every3 = dg.MetadataValue.text("3")
    _log_versions(instance, "demo", range(1, 8), eval_interval=every3)
    _log_versions(instance, "demo", [8], eval_interval=every3, final=dg.MetadataValue.text("true"))
    got = [k for tick in _drain(eval_on_new_policy, instance) for k in tick]
    assert got == ["demo.v000003", "demo.v000006", "demo.v000008"]


def test_requests_per_run_are_capped_but_the_final_version_still_comes(instance):
    every = dg.MetadataValue.text("1")
    _log_versions(instance, "big", range(1, 30), eval_interval=every)
    _log_versions(instance, "big", [30], eval_interval=every, final=dg.MetadataValue.text("true"))
    _log_versions(instance, "small", [1, 2], eval_interval=every)
    sensor = build_eval_sensor("capped", EvalPolicy(max_per_run=4, max_per_tick=3))
    per_tick = _drain(sensor, instance)
    got = [k for tick in per_tick for k in tick]
    assert [k for k in got if k.startswith("big.")] == [f"big.v{v:06d}" for v in (1, 2, 3, 4, 30)]
    assert [k for k in got if k.startswith("small.")] == ["small.v000001", "small.v000002"]
    assert max(map(len, per_tick)) == 3


def test_the_policy_is_set_from_the_environment_and_a_bad_value_names_the_variable(monkeypatch):
    assert EvalPolicy.from_env() == EvalPolicy(interval=10, max_per_tick=2, max_per_run=20)
    monkeypatch.setenv("MILES_EVAL_INTERVAL", "5")
    monkeypatch.setenv("MILES_EVAL_MAX_PER_TICK", "4")
    monkeypatch.setenv("MILES_EVAL_MAX_PER_RUN", "0")
    assert EvalPolicy.from_env() == EvalPolicy(interval=5, max_per_tick=4, max_per_run=0)
    monkeypatch.setenv("MILES_EVAL_INTERVAL", "every")
    with pytest.raises(ValueError, match="MILES_EVAL_INTERVAL='every'"):
        EvalPolicy.from_env()
