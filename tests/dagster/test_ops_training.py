"""The `rl_training` job run in process: where it writes, what the Launchpad shows, how fast a bad
config fails, and what each policy_versions materialization carries for the UI's plots."""

import time

import dagster as dg
import pytest
from loop_helpers import small_run_kwargs

from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths
from miles_platform.store.tables import read_rows
from ops.training import RLTrainingConfig, rl_training
from resources.storage import StorageRootResource


def _execute(kwargs: dict, root, instance=None, raise_on_error=True):
    return rl_training.execute_in_process(
        run_config={"ops": {"rl_training_op": {"config": kwargs}}},
        instance=instance or dg.DagsterInstance.ephemeral(),
        resources={"storage": StorageRootResource(root=str(root))},
        raise_on_error=raise_on_error,
    )


def _job_kwargs(ckpt: str, tmp_path, **overrides) -> dict:
    kw = small_run_kwargs(ckpt, tmp_path, **overrides)
    kw.pop("storage_root")  # the resource's, not the run config's
    return kw


@pytest.fixture(scope="module")
def short_run(tiny_hf_checkpoint, tmp_path_factory):
    """Two rollouts of the small run, with eval every version, launched from a working dir that is
    not the storage root."""
    tmp = tmp_path_factory.mktemp("job")
    root, elsewhere = tmp / "root", tmp / "elsewhere"
    elsewhere.mkdir()
    kw = _job_kwargs(tiny_hf_checkpoint, tmp, eval_interval=1, rollout_temperature=0.8)
    kw["eval_prompt_data"] = ["heldout", kw["prompt_data"]]
    instance = dg.DagsterInstance.ephemeral()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(elsewhere)
        result = _execute(kw, root, instance)
    return result, instance, root, elsewhere


def test_job_writes_under_the_storage_resource_root_from_any_working_dir(short_run):
    result, _, root, elsewhere = short_run
    assert result.success
    paths = StoragePaths(str(root))
    versions = read_rows(paths, "policy_versions", "t")
    assert [r["version"] for r in versions] == [1, 2]
    assert all(r["hf_path"].startswith(str(root)) for r in versions)
    assert {r["rollout_id"] for r in read_rows(paths, "metrics", "t")} == {0, 1}
    assert list(elsewhere.iterdir()) == []  # nothing under the working dir's .miles
    assert result.output_for_node("rl_training_op")["final_hf_path"].startswith(str(root))


def test_every_launchpad_field_has_the_flags_help_text():
    fields = rl_training.nodes[0].definition.config_schema.config_type.fields
    assert "storage_root" not in fields  # one root for every op, asset and sensor: the resource's
    missing = sorted(name for name, f in fields.items() if not f.description)
    assert missing == []
    assert fields["rm_type"].description.startswith("--rm-type: built-in reward")
    assert "(one of: embedded, sglang)" in fields["rollout_engine"].description
    assert set(fields) == set(RLTrainingConfig.model_fields)


def test_config_without_a_reward_fails_fast_naming_the_key(tiny_hf_checkpoint, tmp_path):
    """Model and prompts but `rm_type: none` and no custom_rm_path: refused before Ray starts,
    in the Launchpad's words (`rm_type`, not `--rm-type`)."""
    kw = {**_job_kwargs(tiny_hf_checkpoint, tmp_path), "rm_type": "none"}
    t0 = time.monotonic()
    result = _execute(kw, tmp_path / "root", raise_on_error=False)
    elapsed = time.monotonic() - t0
    assert not result.success
    failure = result.failure_data_for_node("rl_training_op")
    message = failure.user_failure_data.description if failure.user_failure_data else failure.error.message
    assert "rm_type" in message and "custom_rm_path" in message and "--rm-type" not in message
    assert elapsed < 10, f"took {elapsed:.1f} s: validation must run before Ray and the engines start"
    assert not (tmp_path / "root" / "rollouts").exists()


@pytest.mark.parametrize(
    "generate,flags,needle",
    [
        ("generate_fns.scripted_multi_turn", ["--not-its-flag", "1"], "--not-its-flag 1 not registered"),
        ("generate_fns.scripted_multi_turn", ["--my-turn-bonus", "lots"], "refuses"),
        (None, ["--my-episode-tag", "x"], "not registered"),
    ],
)
def test_function_flags_the_function_does_not_take_fail_fast(
    tiny_hf_checkpoint, tmp_path, generate, flags, needle
):
    kw = _job_kwargs(tiny_hf_checkpoint, tmp_path, custom_generate_function_path=generate)
    result = _execute({**kw, "custom_function_flags": flags}, tmp_path / "root", raise_on_error=False)
    assert not result.success
    failure = result.failure_data_for_node("rl_training_op")
    assert needle in failure.user_failure_data.description
    assert not (tmp_path / "root").exists()


PLOTTED = (
    "rollout/raw_reward",
    "rollout/response_len/mean",
    "train/loss",
    "train/pg_clipfrac",
    "train/ppo_kl",
    "train/grad_norm",
    "perf/rollout_time",
    "perf/actor_train_time",
    "perf/update_weights_time",
    "perf/rollout_total_time",
    "perf/tokens_per_gpu_per_sec",  # Miles' throughput keys
    "perf/longest_sample_tokens_per_sec",
    "perf/actor_train_tok_per_s",
)


def test_policy_versions_carry_the_rollouts_training_metrics_as_floats(short_run):
    _, instance, root, _ = short_run
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("policy_versions")), limit=10, ascending=True
    ).records
    assert [r.asset_materialization.partition for r in records] == ["t.v000001", "t.v000002"]
    rows = read_rows(StoragePaths(str(root)), "metrics", "t")
    for rollout_id, record in enumerate(records):
        md = record.asset_materialization.metadata
        for key in PLOTTED:
            assert isinstance(md[key], dg.FloatMetadataValue), key
        want = {r["name"]: r["value"] for r in rows if r["rollout_id"] == rollout_id}
        assert md["train/loss"].value == pytest.approx(want["train/loss"])
        assert md["rollout/raw_reward"].value == pytest.approx(want["rollout/raw_reward"])
        # one rollout device: its response tokens over the rollout's wall time
        _, [(tokens,)] = Catalog(StoragePaths(str(root))).query(
            f"SELECT sum(response_length) FROM rollouts WHERE run = 't' AND rollout_id = {rollout_id}"
        )
        assert want["perf/tokens_per_gpu_per_sec"] * want["perf/rollout_time"] == pytest.approx(tokens)
        # the code that made the version, as its row records it
        (row,) = [
            r
            for r in read_rows(StoragePaths(str(root)), "policy_versions", "t")
            if r["rollout_id"] == rollout_id
        ]
        assert (
            md["git_commit"].value == (row["git_commit"] or "")
            and md["platform_version"].value == row["platform_version"]
        )
        assert md["git_dirty"].value == ("" if row["git_dirty"] is None else str(row["git_dirty"]).lower())
        # identifiers are text, not lines on the Plots tab
        for key in ("version", "rollout_id", "eval_interval"):
            assert key not in md or isinstance(md[key], dg.TextMetadataValue), key
        assert "shard_rows" not in md


def test_eval_results_is_the_evaluator_of_record_one_row_per_metric(short_run):
    """Under Dagster the loop does not evaluate; the sensor launches eval_results with the run's
    eval settings, so each version has one row per metric, from the asset."""
    from assets.evals import eval_results
    from sensors.evals import EvalPolicy, plan_eval_requests

    _, instance, root, _ = short_run
    paths = StoragePaths(str(root))
    assert read_rows(paths, "evals", "t") == []  # no in-loop eval (nor v0 eval)
    requests = plan_eval_requests(instance, None, EvalPolicy(interval=1)).requests
    assert [r.partition_key for r in requests] == ["t.v000001", "t.v000002"]
    config = requests[0].run_config["ops"]["eval_results"]["config"]
    assert config["eval_prompt_data"][0] == "heldout" and config["rm_type"] == "math"
    assert (config["eval_temperature"], config["eval_max_response_len"]) == (0.8, 4)  # inherited from rollout
    res = dg.materialize(
        [eval_results],
        instance=instance,
        resources={"storage": StorageRootResource(root=str(root))},
        partition_key="t.v000001",
        run_config=requests[0].run_config,
    )
    assert res.success
    rows = read_rows(paths, "evals", "t")
    keys = [(r["version"], r["dataset"], r["metric"]) for r in rows]
    assert len(keys) == len(set(keys)) and (1, "heldout", "pass@1") in keys
    sampled = [r for r in rows if r["metric"] in ("pass@1(T=0.8)", "mean_reward@1(T=0.8)")]
    assert sampled and {
        (r["source"], r["temperature"], r["top_p"], r["top_k"], r["max_new_tokens"]) for r in sampled
    } == {("asset", 0.8, 1.0, -1, 4)}
    greedy = [r for r in rows if r["metric"] == "pass@1" or r["metric"].startswith("pass@1/")]
    assert {(r["temperature"], r["n_samples"], r["max_new_tokens"]) for r in greedy} == {(0.0, 1, 4)}


def _instance_with_inputs(tiny_hf_checkpoint, tmp_path) -> dg.DagsterInstance:
    """An instance whose latest prompt_dataset / base_checkpoint are a prompt file and a checkpoint."""
    from loop_helpers import write_prompts

    instance = dg.DagsterInstance.ephemeral()
    for key, path in (("prompt_dataset", write_prompts(tmp_path)), ("base_checkpoint", tiny_hf_checkpoint)):
        instance.report_runless_asset_event(
            dg.AssetMaterialization(key, metadata={"path": dg.MetadataValue.path(path)})
        )
    return instance


def test_launchpad_presets_are_the_demo_recipe_and_a_smoke_run(tiny_hf_checkpoint, tmp_path):
    from miles_platform.recipes import DEMO_RL
    from ops.training import PRESET_JOBS, run_config_from

    instance = _instance_with_inputs(tiny_hf_checkpoint, tmp_path)
    configs = {}
    for name, job in PRESET_JOBS.items():
        op_config = dg.validate_run_config(job, {})["ops"]["rl_training_op"][
            "config"
        ]  # what its Launchpad shows
        run = dg.DagsterRun(job_name=name, run_id="1234abcd-0000-4000-8000-000000000000")
        cfg, _ = run_config_from(RLTrainingConfig(**op_config), instance, str(tmp_path / "root"), run)
        preset = name.removeprefix("rl_training_")
        assert cfg.run_name == f"{preset}-1234abcd"  # a fresh run per launch
        configs[preset] = (op_config, cfg)
    demo, cfg = configs["demo"]
    assert {k: v for k, v in demo.items() if k in DEMO_RL and k != "run_name"} == {
        k: v for k, v in DEMO_RL.items() if k != "run_name"
    }
    assert (cfg.num_rollout, cfg.eval_interval, cfg.prompt_data) == (100, 10, instance_path(instance))
    smoke = configs["smoke"][1]
    assert smoke.num_rollout * smoke.rollout_batch_size * smoke.n_samples_per_prompt <= 8


def instance_path(instance) -> str:
    ev = instance.get_latest_materialization_event(dg.AssetKey("prompt_dataset"))
    return ev.asset_materialization.metadata["path"].value


def _materializations(instance, key: str) -> list[str]:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(key)), limit=100, ascending=True
    ).records
    return [r.asset_materialization.partition for r in records]


def test_the_smoke_preset_trains_from_the_latest_assets(tiny_hf_checkpoint, tmp_path):
    from ops.training import PRESET_JOBS

    instance = _instance_with_inputs(tiny_hf_checkpoint, tmp_path)
    t0 = time.monotonic()
    result = PRESET_JOBS["rl_training_smoke"].execute_in_process(
        instance=instance,
        resources={"storage": StorageRootResource(root=str(tmp_path / "root"))},
    )
    assert result.success
    run = result.output_for_node("rl_training_op")["run"]
    assert run == f"smoke-{result.run_id[:8]}"
    assert _materializations(instance, "policy_versions") == [f"{run}.v000001", f"{run}.v000002"]
    print(f"smoke preset: {time.monotonic() - t0:.1f} s")


def test_a_failed_step_is_retried_and_resumes_without_duplicate_partitions(tiny_hf_checkpoint, tmp_path):
    """Rollout 3 fails once. The retry resumes from the rollout-1 checkpoint: v1-v3 keep their keys,
    rollouts 2-3 make v4-v5; each partition is reported exactly once."""
    root = tmp_path / "root"
    kw = _job_kwargs(
        tiny_hf_checkpoint, tmp_path, num_rollout=4, save_interval=2,
        custom_rollout_log_function_path="loop_helpers.crash_once_at_rollout_3",
    )  # fmt: skip
    instance = dg.DagsterInstance.ephemeral()
    result = _execute(kw, root, instance)
    assert result.success
    assert (root / "crashed_once").exists()
    steps = [e for e in result.all_events if e.event_type_value in ("STEP_UP_FOR_RETRY", "STEP_RESTARTED")]
    assert [e.event_type_value for e in steps] == ["STEP_UP_FOR_RETRY", "STEP_RESTARTED"]
    keys = [f"t.v{v:06d}" for v in range(1, 6)]
    assert _materializations(instance, "policy_versions") == keys
    assert _materializations(instance, "rollout_shards") == keys
    assert sorted(instance.get_dynamic_partitions("policy_versions")) == keys
    rows = read_rows(StoragePaths(str(root)), "policy_versions", "t")
    assert [(r["version"], r["rollout_id"]) for r in rows] == [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3)]
    # v3 was made after the rollout-1 checkpoint: the retry abandoned it, and its partition says so
    obs = instance.fetch_observations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("policy_versions")), limit=10
    ).records
    assert [(o.partition_key, o.asset_observation.metadata["status"].value) for o in obs] == [
        ("t.v000003", "abandoned")
    ]
    _, st = Catalog(StoragePaths(str(root))).query("select version, status from policy_versions order by 1")
    assert [v for v, s in st if s == "abandoned"] == [3]


def test_rollout_shards_show_reward_spread_truncation_and_a_preview(short_run):
    import pyarrow.parquet as pq

    _, instance, root, _ = short_run
    (record, *_) = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("rollout_shards")), limit=10, ascending=True
    ).records
    meta = record.asset_materialization.metadata
    rows = pq.read_table(meta["path"].value).to_pylist()
    rewards = [r["raw_reward"] for r in rows]
    mean = sum(rewards) / len(rewards)
    assert meta["reward_std"].value == pytest.approx(
        (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5
    )
    assert meta["truncated"].value == pytest.approx(sum(r["status"] == "truncated" for r in rows) / len(rows))
    assert meta["response_len_max"].value == max(r["response_length"] for r in rows)
    preview = meta["preview"].value.splitlines()
    assert preview[0] == "| prompt | response | reward | status |" and len(preview) == 2 + min(3, len(rows))
    assert rows[0]["prompt"] in preview[2]


# ---------------------------------------------------------------- the Launchpad (issue 48)
def _op_fields(job):
    return job.nodes[0].definition.config_schema.config_type.fields


def test_the_launchpad_marks_the_fields_a_run_needs_as_required():
    """The Launchpad's "missing config" comes from the schema: an empty config is missing the
    batch size and the reward, not "No missing config"."""
    fields = _op_fields(rl_training)
    assert fields["rollout_batch_size"].is_required and fields["rm_type"].is_required
    assert "required" in fields["rm_type"].description and "none" in fields["rm_type"].description
    assert sorted(name for name, f in fields.items() if f.is_required) == ["rm_type", "rollout_batch_size"]
    with pytest.raises(dg.DagsterInvalidConfigError) as e:
        dg.validate_run_config(rl_training, {"ops": {"rl_training_op": {"config": {"run_name": "x"}}}})
    assert "rollout_batch_size" in str(e.value) and "rm_type" in str(e.value)


def test_a_config_error_from_the_launchpad_names_the_yaml_key(tiny_hf_checkpoint, tmp_path):
    """The batch invariant's message names the four keys as the Launchpad spells them."""
    kw = {**_job_kwargs(tiny_hf_checkpoint, tmp_path), "rollout_batch_size": 3, "global_batch_size": 4}
    message = (
        _execute(kw, tmp_path / "root", raise_on_error=False)
        .failure_data_for_node("rl_training_op")
        .user_failure_data.description
    )
    assert "rollout_batch_size=3" in message and "--" not in message, message
    assert not (tmp_path / "root").exists()
    # the in-loop eval hooks: the sensor evaluates a Dagster run, so they would never run (refused)
    kw = {**_job_kwargs(tiny_hf_checkpoint, tmp_path), "ci_test": True, "ci_metric_checker_key": "eval/d/pass@1",
          "ci_metric_checker_threshold": 0.5, "eval_prompt_data": ["d", kw["prompt_data"]], "eval_interval": 1}  # fmt: skip
    failure = _execute(kw, tmp_path / "root", raise_on_error=False).failure_data_for_node("rl_training_op")
    assert "ci_metric_checker_key: act on the run's own evals" in failure.user_failure_data.description


def test_presets_are_named_jobs_and_no_tag_of_theirs_sticks_to_a_hand_written_run():
    """Each preset is a job of its own (named and described in the jobs list, its config filled in
    its Launchpad); rl_training has no "Partition" box, so a hand-written run carries no preset."""
    import definitions
    from ops.training import PRESET_JOBS

    assert rl_training.partitions_def is None and rl_training.partitioned_config is None
    jobs = {j.name: j for j in definitions.defs.resolve_all_job_defs()}
    assert set(PRESET_JOBS) == {"rl_training_demo", "rl_training_smoke"} <= set(jobs)
    for name in PRESET_JOBS:
        job = jobs[name]
        assert job.description and "preset" in job.description.lower()
        config = dg.validate_run_config(job, {})["ops"]["rl_training_op"]["config"]  # nothing missing
        assert config["rm_type"] == "math" and config["rollout_batch_size"] >= 2
        assert config["run_name"] == f"{name.removeprefix('rl_training_')}-{{run_id}}"
    assert "rl_training_smoke" in rl_training.description and "rl_training_demo" in rl_training.description


def test_a_run_name_with_run_id_names_a_fresh_run_that_a_re_execution_resumes():
    from ops.training import run_name_for
    from sensors.catalog_runs import runs_trained_by_dagster_now

    first = dg.DagsterRun(job_name="rl_training_smoke", run_id="0a1b2c3d-0000-4000-8000-000000000000")
    again = dg.DagsterRun(job_name="rl_training_smoke", run_id="ffffffff-0000-4000-8000-000000000000",
                          root_run_id=first.run_id, parent_run_id=first.run_id)  # fmt: skip
    assert run_name_for("smoke-{run_id}", first) == run_name_for("smoke-{run_id}", again) == "smoke-0a1b2c3d"
    assert run_name_for("mine", again) == "mine"
    instance = dg.DagsterInstance.ephemeral()
    config = {"ops": {"rl_training_op": {"config": {"run_name": "smoke-{run_id}"}}}}
    instance.add_run(
        dg.DagsterRun(job_name="rl_training_smoke", run_id=first.run_id, status=dg.DagsterRunStatus.STARTED,
                      run_config=config)
    )  # fmt: skip
    assert runs_trained_by_dagster_now(instance) == {"smoke-0a1b2c3d"}


@pytest.mark.parametrize(
    "overrides, why",
    [
        (dict(prompt_data="/nonexistent/prompts.jsonl"), "dataset file not found (check --prompt-data)"),
        (dict(custom_rm_path="loop_helpers.broken_reward", rm_type="none"),
         "--custom-rm-path loop_helpers.broken_reward raised KeyError: 'score'"),
    ],
    ids=["missing-dataset", "broken-reward"],
)  # fmt: skip
def test_a_missing_dataset_or_a_broken_reward_fails_once_with_its_reason(
    tiny_hf_checkpoint, tmp_path, overrides, why
):
    """Both were retried twice (10 s of delays, two more Ray starts) and shown as "Exceeded
    max_retries of 2" (issue #49, item 12): a retry cannot fix either. Now the step fails at once,
    not retried, and its failure says why."""
    kw = _job_kwargs(tiny_hf_checkpoint, tmp_path, **overrides)
    result = _execute(kw, tmp_path / "root", raise_on_error=False)
    assert not result.success
    kinds = [e.event_type_value for e in result.all_events]
    assert "STEP_UP_FOR_RETRY" not in kinds and kinds.count("STEP_FAILURE") == 1
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    text = str(failure.step_failure_data.error)
    assert why in text and "max_retries" not in text, text


def test_an_api_key_typed_in_the_launchpad_is_refused_and_never_stored_in_a_row(tiny_hf_checkpoint, tmp_path):
    """Dagster keeps a run's config as typed, in plain text (issue #49, item 12): a key typed in
    the Launchpad is refused before anything starts, naming the safe ways (api_key_file,
    $MILES_API_KEY)."""
    kw = {**_job_kwargs(tiny_hf_checkpoint, tmp_path), "api_key": "typed-secret"}
    result = _execute(kw, tmp_path / "root", raise_on_error=False)
    message = result.failure_data_for_node("rl_training_op").user_failure_data.description
    assert "api_key typed in the Launchpad is stored in plain text" in message and "api_key_file" in message
    assert "STEP_UP_FOR_RETRY" not in [e.event_type_value for e in result.all_events]
    assert not (tmp_path / "root").exists()
