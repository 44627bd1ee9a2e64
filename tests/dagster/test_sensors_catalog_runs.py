"""runs_from_catalog: versions of runs trained outside Dagster become partitions and
materializations with the op's lineage metadata, once, and never for versions the op reported."""

import dagster as dg
import pytest
from store_builders import apply_sensor_tick, build_run

from miles_platform.store.paths import StoragePaths
from ops.version_events import policy_version_event
from resources.storage import StorageRootResource
from sensors.catalog_runs import runs_from_catalog
from sensors.evals import eval_on_new_policy


def tick(instance, root, cursor, sensor=runs_from_catalog):
    return apply_sensor_tick(sensor, instance, root, cursor)


def _records(instance, key):
    return instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(key)), limit=100, ascending=True
    ).records


@pytest.fixture
def store(tmp_path, tiny_hf_checkpoint):
    paths = StoragePaths(str(tmp_path / "root"))
    infos = build_run(paths, "cli", tiny_hf_checkpoint, 3, rewards=[0.25, 0.5, 0.75], eval_interval=2)
    return paths, infos


def test_cli_run_versions_become_partitions_with_the_ops_metadata_once(store):
    paths, infos = store
    instance = dg.DagsterInstance.ephemeral()
    data = tick(instance, paths.root, None)
    keys = ["cli.v000001", "cli.v000002", "cli.v000003"]
    assert sorted(instance.get_dynamic_partitions("policy_versions")) == keys
    pv = _records(instance, "policy_versions")
    assert [r.asset_materialization.partition for r in pv] == keys
    assert [r.asset_materialization.partition for r in _records(instance, "rollout_shards")] == keys
    # what DagsterReporter logs for the same version (+ who reported it)
    md = pv[1].asset_materialization.metadata
    want = policy_version_event(infos[1], {"rollout/raw_reward": 0.5, "train/loss": 0.5}, {}).metadata
    assert set(md) - set(want) == {"reported_by"}
    for key in ("run", "version", "rollout_id", "parent_version", "config_hash", "content_hash", "hf_path",
                "shard_path", "base_data_version", "dataset_data_version", "eval_interval", "mean_reward",
                "train/loss", "rollout/raw_reward"):  # fmt: skip
        assert md[key] == want[key], key
    assert md["parent_version"].value == "cli.v000001" and md["eval_interval"].value == "2"
    assert md["eval_config"].value["rm_type"] == "math"  # the run's eval settings, from run_config.json
    assert pv[1].asset_materialization.tags["dagster/data_version"] == infos[1].content_hash

    # next tick: nothing new; a reset cursor: nothing twice
    assert tick(instance, paths.root, data.cursor).asset_events == []
    assert tick(instance, paths.root, None).asset_events == []
    assert len(_records(instance, "policy_versions")) == 3


def test_versions_the_op_reported_and_runs_dagster_is_training_are_left_alone(store, tiny_hf_checkpoint):
    paths, infos = store
    instance = dg.DagsterInstance.ephemeral()
    for info in infos[:2]:  # the op reported v1 and v2 (it died before reporting v3)
        instance.add_dynamic_partitions("policy_versions", [info.partition_key])
        instance.report_runless_asset_event(policy_version_event(info, {}, {}))
    build_run(paths, "live", tiny_hf_checkpoint, 1)
    live = instance.add_run(
        dg.DagsterRun(job_name="rl_training", run_id="live-run", status=dg.DagsterRunStatus.STARTED,
                      run_config={"ops": {"rl_training_op": {"config": {"run_name": "live"}}}})
    )  # fmt: skip
    data = tick(instance, paths.root, None)
    assert [e.partition for e in data.asset_events if e.asset_key.path == ["policy_versions"]] == [
        "cli.v000003"
    ]
    assert len(_records(instance, "policy_versions")) == 3  # v1, v2 from the op, v3 from the sensor

    instance.report_run_failed(live)  # the Dagster run ended without reporting: now the sensor does
    data = tick(instance, paths.root, data.cursor)
    assert [e.partition for e in data.asset_events if e.asset_key.path == ["policy_versions"]] == [
        "live.v000001"
    ]


def test_eval_sensor_leaves_versions_evaluated_in_their_own_loop(tmp_path, tiny_hf_checkpoint):
    paths = StoragePaths(str(tmp_path / "root"))
    build_run(paths, "looped", tiny_hf_checkpoint, 2, eval_interval=1, eval_prompt_data=["eval", "e.jsonl"])
    build_run(paths, "plain", tiny_hf_checkpoint, 2)
    instance = dg.DagsterInstance.ephemeral()
    tick(instance, paths.root, None)
    from assets.evals import eval_results
    from sensors.evals import eval_job

    defs = dg.Definitions(
        assets=[eval_results], jobs=[eval_job], resources={"storage": StorageRootResource()}
    )
    ctx = dg.build_sensor_context(instance=instance, definitions=defs)
    with dg.partition_loading_context(dynamic_partitions_store=instance):
        requests = eval_on_new_policy.evaluate_tick(ctx).run_requests
    assert [r.partition_key for r in requests] == ["plain.v000002"]  # its final version (no --eval-interval)


def test_a_cli_run_that_ends_is_health_checked_once_and_an_unfinished_one_is_not(store, tiny_hf_checkpoint):
    """The versions that end a CLI run come with a `check_run_health` request (run key per run and
    last version); a run still short of its --num-rollout gets none; the request's job checks."""
    import json
    from pathlib import Path

    paths, _ = store
    build_run(paths, "going", tiny_hf_checkpoint, 2)
    f = Path(paths.checkpoints("going")) / "run_config.json"
    f.write_text(json.dumps(json.loads(f.read_text()) | {"num_rollout": 5}))  # 2 of 5 rollouts so far
    instance = dg.DagsterInstance.ephemeral()
    data = tick(instance, paths.root, None)
    assert [(r.run_key, r.job_name, r.tags["miles/run"]) for r in data.run_requests] == [
        ("health:cli.v000003", "check_run_health", "cli")
    ]
    assert tick(instance, paths.root, data.cursor).run_requests in (None, [])  # nothing new reported

    import definitions

    job = definitions.defs.get_repository_def().get_job(data.run_requests[0].job_name)
    res = job.execute_in_process(
        instance=instance, resources={"storage": StorageRootResource(root=paths.root)}
    )
    assert res.success and {e.check_name for e in res.get_asset_check_evaluations()} >= {
        "contiguous_rollout_ids",
        "expected_version_count",
        "prompt_coverage",
    }


def test_run_health_sensors_request_a_check_when_an_rl_training_run_ends():
    """run_health_after_training / ..._failed_training: one `check_run_health` run per ended
    rl_training run, keyed by its run id."""
    from sensors.run_health import run_health_after_failed_training, run_health_after_training

    instance = dg.DagsterInstance.ephemeral()
    for sensor, status in ((run_health_after_training, dg.DagsterRunStatus.SUCCESS),
                           (run_health_after_failed_training, dg.DagsterRunStatus.FAILURE)):  # fmt: skip
        run = instance.add_run(
            dg.DagsterRun(job_name="rl_training", run_id=f"r-{status.value}", status=status)
        )
        ctx = dg.build_run_status_sensor_context(
            sensor_name=sensor.name, dagster_instance=instance, dagster_run=run,
            dagster_event=dg.DagsterEvent(
                event_type_value=("PIPELINE_SUCCESS" if status == dg.DagsterRunStatus.SUCCESS else "PIPELINE_FAILURE"),
                job_name="rl_training"),
        )  # fmt: skip
        ctx = ctx.for_run_failure() if status == dg.DagsterRunStatus.FAILURE else ctx
        req = sensor(ctx)
        assert req.run_key == f"health:r-{status.value}" and req.tags["miles/trigger"] == "training_ended"
        assert sensor.job_name == "check_run_health"
