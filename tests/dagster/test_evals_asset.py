"""eval_results: evaluates the policy version's HF export and records evals rows, metadata, lineage."""

import json
import shutil

import dagster as dg
import pytest

from assets.datasets import eval_dataset
from assets.evals import eval_results
from miles_platform.rollout.evaluate import evaluate
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths
from miles_platform.store.tables import read_rows
from resources.storage import StorageRootResource

ROWS = [{"prompt": f"What is {a}+{b}?", "label": str(a + b)} for a, b in [(1, 2), (3, 4), (10, 11), (7, 7)]]
EVAL_CONFIG = {"n_samples_per_eval_prompt": 2, "eval_max_response_len": 4, "eval_temperature": 1.0, "seed": 3}


@pytest.fixture
def setup(tmp_path, tiny_hf_checkpoint):
    paths = StoragePaths(str(tmp_path / "root"))
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    instance = dg.DagsterInstance.ephemeral()
    resources = {"storage": StorageRootResource(root=paths.root)}
    ds_config = {"path": str(data), "input_key": "prompt", "label_key": "label"}
    res = dg.materialize(
        [eval_dataset],
        instance=instance,
        resources=resources,
        run_config={"ops": {"eval_dataset": {"config": ds_config}}},
    )
    assert res.success
    instance.add_dynamic_partitions("policy_versions", ["demo.v000001", "demo.v000002"])
    yield paths, instance, resources, tiny_hf_checkpoint
    instance.dispose()


def _materialize(instance, resources, key, config=EVAL_CONFIG, raise_on_error=True):
    return dg.materialize(
        [eval_results],
        instance=instance,
        resources=resources,
        partition_key=key,
        run_config={"ops": {"eval_results": {"config": config}}},
        raise_on_error=raise_on_error,
    )


def test_eval_results_rows_metadata_and_lineage(setup):
    paths, instance, resources, ckpt = setup
    hf = shutil.copytree(ckpt, paths.join("elsewhere", "v1"))  # not at the convention path
    instance.report_runless_asset_event(
        dg.AssetMaterialization(
            "policy_versions", partition="demo.v000001", metadata={"hf_path": hf, "content_hash": "abc"}
        )
    )
    res = _materialize(instance, resources, "demo.v000001")
    assert res.success

    # the numbers are exactly what the eval library computes for this checkpoint and dataset
    want = evaluate(
        hf,
        [("eval", paths.dataset("eval_dataset"))],
        n_samples_per_eval_prompt=2,
        max_new_tokens=4,
        temperature=1.0,
        seed=3,
    )["eval"]
    rows = read_rows(paths, "evals", "demo")
    got = {r["metric"]: r["value"] for r in rows}
    named = ("pass@1", "pass@2(T=1)", "mean_reward@2(T=1)")  # greedy; 2 samples at temperature 1
    assert set(named) <= set(got) and not {"pass@k", "mean_reward"} & set(got)
    assert all(got[m] == pytest.approx(want[m]) for m in named)
    assert {(r["partition_key"], r["version"], r["dataset"]) for r in rows} == {("demo.v000001", 1, "eval")}
    # every row names its writer and the sampling that made it: the 2 samples at temperature 1 of
    # pass@2(T=1) / mean_reward@2(T=1), the one greedy answer of pass@1 and its breakdowns
    sampling = {r["metric"]: (r["source"], r["n_samples"], r["temperature"], r["top_p"], r["top_k"],
                              r["max_new_tokens"]) for r in rows}  # fmt: skip
    greedy = {m for m in sampling if m == "pass@1" or m.startswith("pass@1/")}
    assert "pass@1" in greedy and set(sampling) - greedy == {"pass@2(T=1)", "mean_reward@2(T=1)"}
    assert {sampling[m] for m in greedy} == {("asset", 1, 0.0, 1.0, -1, 4)}
    assert {sampling["pass@2(T=1)"], sampling["mean_reward@2(T=1)"]} == {("asset", 2, 1.0, 1.0, -1, 4)}

    mat = res.asset_materializations_for_node("eval_results")[0]
    assert mat.partition == "demo.v000001"
    for m in named:  # `<dataset>/<metric>`, the metric named as in the rows
        value = mat.metadata[f"eval/{m}"]
        assert isinstance(value, dg.FloatMetadataValue) and value.value == pytest.approx(want[m])
    summary = mat.metadata["summary"].value
    assert (
        summary.splitlines()[0]
        == "| dataset | pass@1 (greedy) | pass@2(T=1) | mean_reward@2(T=1) | prompts |"
    )
    assert not any(k.startswith("eval/eval/") for k in mat.metadata)
    assert mat.metadata["hf_path"].value == hf
    assert mat.metadata["num_prompts"].value == {"eval": 4}

    lineage = read_rows(paths, "lineage", "demo")
    edges = {(r["child"], r["parent"], r["relation"], r["data_version"]) for r in lineage}
    assert ("eval:demo.v000001", "demo.v000001", "evaluates", "abc") in edges
    assert any(e[0] == "eval:demo.v000001" and e[2] == "evaluated_on" for e in edges)

    # the DuckDB catalog sees the rows
    _, out = Catalog(paths).query("SELECT count(*) FROM evals WHERE partition_key = 'demo.v000001'")
    assert out[0][0] == len(rows)


def test_eval_results_uses_path_convention_and_explicit_datasets(setup, tmp_path):
    paths, instance, resources, ckpt = setup
    shutil.copytree(ckpt, paths.hf_export("demo", 2))  # no policy_versions materialization: convention
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    config = {**EVAL_CONFIG, "eval_prompt_data": ["small", str(other)], "max_prompts": 1}
    assert _materialize(instance, resources, "demo.v000002", config).success
    rows = read_rows(paths, "evals", "demo")
    assert {r["dataset"] for r in rows} == {"small"}
    assert {r["version"] for r in rows} == {2}


def test_missing_hf_export_fails_with_a_clear_message(setup):
    _, instance, resources, _ = setup
    res = _materialize(instance, resources, "demo.v000002", raise_on_error=False)
    assert not res.success
    failure = next(e for e in res.all_events if e.event_type_value == "STEP_FAILURE")
    assert "no HF export" in str(failure.event_specific_data.error)


def test_a_training_runs_eval_config_carries_its_eval_reward_and_dataset_flags():
    from assets.evals import EvalConfig, eval_config_for_run
    from miles_platform.config import RunConfig

    cfg = RunConfig(rollout_batch_size=1, rollout_temperature=0.6, rollout_max_response_len=12, rm_type="dapo",
                    reward_key="score", eval_top_k=5, input_key="question", seed=9)  # fmt: skip
    got = eval_config_for_run(cfg)
    assert got == {
        "n_samples_per_eval_prompt": 1, "eval_max_response_len": 12, "eval_temperature": 0.6,
        "eval_top_p": 1.0, "eval_top_k": 5, "rm_type": "dapo", "group_rm": False, "reward_key": "score",
        "seed": 9,
    }  # fmt: skip
    # the run's own eval datasets are read with the run's dataset keys; EvalConfig takes it all
    cfg.eval_prompt_data = ["mine", "/data/eval.jsonl"]
    got = eval_config_for_run(cfg)
    assert got["eval_prompt_data"] == ["mine", "/data/eval.jsonl"] and got["input_key"] == "question"
    assert EvalConfig(**got).label_key == "label"
    cfg.multimodal_keys = '{"image": "images"}'  # an image run's eval datasets keep their images
    assert EvalConfig(**eval_config_for_run(cfg)).multimodal_keys == '{"image": "images"}'


def test_the_quickstart_summary_reads_the_numbers_the_asset_recorded(setup):
    """One source: the summary's base / final numbers are the `evals` rows eval_results (and the
    scoreboard, for the base) wrote, under the same names as the asset's metadata."""
    from ops.quickstart import eval_summary

    paths, instance, resources, ckpt = setup
    shutil.copytree(ckpt, paths.hf_export("demo", 1))
    res = _materialize(instance, resources, "demo.v000001")
    md = res.asset_materializations_for_node("eval_results")[0].metadata
    from_asset = {
        k.removeprefix("eval/"): v.value for k, v in md.items() if isinstance(v, dg.FloatMetadataValue)
    }
    summary = eval_summary(paths, "demo", 1)
    assert summary["final_eval"] == from_asset
    assert summary["final_eval_accuracy"] == from_asset["pass@1"]
    assert summary["eval_per_version"] == {"demo.v000001": from_asset["pass@1"]}
    assert summary["base_eval"] == {} and summary["base_eval_accuracy"] is None  # no v0 row yet
