"""Diffusion RL end to end on Ray: the Dagster assets and job, the store, the CLI, resume.

One short campaign in a Dagster instance on disk (datasets -> a briefly SFT'd tiny DiT, both
materialized in the background under pytest-xdist -> six rollouts of Flow-GRPO with --ci-test),
then the CLI resuming that run's checkpoint.
"""

import json
import subprocess
from pathlib import Path

import dagster as dg
import pytest
from background_bases import DIFFUSION_SFT_STEPS, base_dir
from loop_helpers import warm_python

from miles_platform.diffusion.config import DiffusionRunConfig
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths
from miles_platform.store.tables import read_rows
from resources.storage import StorageRootResource

RUN = dict(
    run_name="d", diffusion_task="t2i", rollout_batch_size=8, n_samples_per_prompt=8, rollout_microgroup_size=8,
    num_rollout=6, diffusion_num_steps=10, diffusion_step_strategy_path="sde_window", diffusion_num_sde_steps=3,
    micro_batch_size=128, lr=3e-4, eval_interval=3, n_samples_per_eval_prompt=2, ci_test=True, save_interval=3,
)  # fmt: skip


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    """The datasets and the briefly SFT'd base are materialized in the background under pytest-xdist
    (tests/background_bases.py: the same assets through `dg.materialize`, into a Dagster instance on
    disk), else here; the training job runs in that instance."""
    import definitions

    _, made = base_dir("diffusion", tmp_path_factory)
    root = Path(made["root"])
    resources = {**definitions.defs.resources, "storage": StorageRootResource(root=str(root))}
    with dg.DagsterInstance.local_temp(tempdir=made["dagster"]) as instance:
        cfg = dict(RUN, save=str(StoragePaths(str(root)).checkpoints("d")))
        job = definitions.defs.get_job_def("diffusion_training")
        result = job.execute_in_process(
            run_config={"ops": {"diffusion_training_op": {"config": cfg}}},
            instance=instance,
            resources=resources,
        )
        yield result, instance, root


def _latest(instance, key, partition=None):
    flt = dg.AssetRecordsFilter(
        asset_key=dg.AssetKey(key), asset_partitions=[partition] if partition else None
    )
    recs = instance.fetch_materializations(flt, limit=1).records
    return recs[0].asset_materialization if recs else None


def test_assets_show_data_and_the_base_with_sample_images(campaign):
    _, instance, root = campaign
    sft = _latest(instance, "diffusion_sft_dataset")
    assert sft.metadata["rows"].value > 0 and "data:image/png;base64," in sft.metadata["samples"].value
    base = _latest(instance, "diffusion_base_checkpoint")
    assert (
        base.metadata["steps"].value == DIFFUSION_SFT_STEPS
        and 0 <= base.metadata["base_eval_reward"].value <= 1
    )
    assert str(base.metadata["path"].value).startswith(str(root))


def test_job_reports_versions_shards_and_evals_like_an_llm_run(campaign):
    result, instance, root = campaign
    assert result.success
    out = result.output_for_node("diffusion_training_op")
    assert out["final_version"] == 6
    keys = sorted(k for k in instance.get_dynamic_partitions("policy_versions") if k.startswith("d.v"))
    assert keys == [f"d.v{v:06d}" for v in range(1, 7)]
    for key in keys:
        pv = _latest(instance, "policy_versions", key)
        assert pv.metadata["task"].value == "diffusion" and pv.metadata["evaluated_in_loop"].value == "true"
        assert "train/ratio_abs_minus_1" in pv.metadata  # the step's metrics, plottable
    for key in ("d.v000003", "d.v000006"):
        ev = _latest(instance, "eval_results", key)
        assert "data:image/png;base64," in ev.metadata["samples_heldout"].value
        assert 0 <= ev.metadata["eval/heldout/mean_reward"].value <= 1
    paths = StoragePaths(str(root))
    assert [r["version"] for r in read_rows(paths, "policy_versions", "d")] == list(range(1, 7))
    assert {r["version"] for r in read_rows(paths, "evals", "d")} == {0, 3, 6}  # v0: before training


def test_flow_grpo_lifts_the_held_out_reward(campaign):
    """Six rollouts of Flow-GRPO brighten the dark squares on colour x quadrant combinations no
    SFT or RL prompt had (the bench: 3 seeds x 20 rollouts, +0.40..+0.56)."""
    _, _, root = campaign
    evals = {r["version"]: r["value"] for r in read_rows(StoragePaths(str(root)), "evals", "d")}
    assert evals[6] - evals[0] >= 0.15, evals


def test_versions_publish_as_disk_deltas_that_a_replica_pipeline_applies(campaign, tmp_path):
    """As for LLM runs: the eval sensor leaves the versions to the loop's evals, the publication
    sensor asks for the newest one; each version publishes (its DiT: snapshot, then deltas) with
    the checksum check green, and a copy of the base pipeline patched to the last one holds
    exactly that version's transformer weights."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from assets.weights import weight_publications
    from miles_platform.weights import disk_delta as dd
    from sensors.evals import plan_eval_requests
    from sensors.publications import plan_publish_requests

    _, instance, root = campaign
    paths = StoragePaths(str(root))
    assert plan_eval_requests(instance, None).requests == []
    assert [r.partition_key for r in plan_publish_requests(instance, None)[0]] == ["d.v000006"]
    kinds = []
    for v in range(1, 7):
        r = dg.materialize([weight_publications], instance=instance, partition_key=f"d.v{v:06d}",
                           resources={"storage": StorageRootResource(root=str(root))})  # fmt: skip
        assert r.success and [c.passed for c in r.get_asset_check_evaluations()] == [True]
        kinds.append(_latest(instance, "weight_publications", f"d.v{v:06d}").metadata["kind"].value)
    assert kinds == ["snapshot"] + ["delta"] * 5
    replica = tmp_path / "replica"
    shutil.copytree(paths.model("diffusion_base"), replica)
    assert dd.apply_publication(paths.publications("d"), replica) == 6 and dd.read_local_version(replica) == 6
    got = load_file(str(dd.weights_file(replica)))
    want = load_file(str(dd.weights_file(paths.hf_export("d", 6))))
    base = load_file(str(dd.weights_file(paths.model("diffusion_base"))))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert any(not torch.equal(base[k], want[k]) for k in want)  # it did change the weights


def test_rollouts_are_images_duckdb_queries_and_lineage_traces(campaign):
    from miles_platform.diffusion.task import from_png
    from miles_platform.store.lineage import trace

    _, _, root = campaign
    paths = StoragePaths(str(root))
    cols, rows = Catalog(paths).query(
        "select rollout_id, count(*), min(octet_length(image_png)), max(len(diffusion_log_probs)) "
        "from rollouts where run = 'd' group by 1 order by 1"
    )
    assert [(r[0], r[1], r[3]) for r in rows] == [(i, 64, 3) for i in range(6)] and rows[0][2] > 50
    _, png = Catalog(paths).query("select image_png from rollouts where run = 'd' limit 1")
    assert from_png(png[0][0]).shape == (3, 16, 16)
    up = json.dumps(trace(paths, "d.v000006"), default=str)
    assert "d.v000005" in up and "rollout_id=000005" in up and "diffusion_base" in up


def test_cli_resumes_the_run_from_its_checkpoint(campaign):
    _, _, root = campaign
    paths = StoragePaths(str(root))
    base = str(paths.model("diffusion_base"))
    data = paths.join("datasets", "diffusion")
    args = [*warm_python(), "-m", "miles_platform.cli", "train-diffusion", "--storage-root", str(root),
            "--hf-checkpoint", base, "--prompt-data", f"{data}/train.jsonl", "--save", paths.checkpoints("d"),
            *[f"--{k.replace('_', '-')}={v}" for k, v in RUN.items() if k not in ("ci_test", "eval_interval",
                                                                                   "num_rollout")],
            "--num-rollout", "7"]  # fmt: skip
    # a resume that would train something else is refused before Ray, the flags named
    proc = subprocess.run([*args, "--lr", "1e-4", "--diffusion-clip-range", "0.001"], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]  # a ConfigError: the CLI's exit before Ray
    assert "--diffusion-clip-range 0.0001 -> 0.001; --lr 0.0003 -> 0.0001" in proc.stderr
    assert "--allow-config-change" in proc.stderr and "Ray" not in proc.stdout
    # allowed: the resume goes on, logged, listed in run_events, and the next version's lineage names
    # the saved config
    saved = json.loads((Path(paths.checkpoints("d")) / "run_config.json").read_text())
    old_hash = DiffusionRunConfig.from_dict(saved).config_hash()
    proc = subprocess.run([*args, "--lr", "1e-4", "--allow-config-change"], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[resume] from" in proc.stdout and "rollout 5, v6" in proc.stdout
    assert "[resume] --allow-config-change: --lr 0.0003 -> 0.0001" in proc.stdout
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["final_version"] == 7 and out["last_rollout_id"] == 6
    assert [r["version"] for r in read_rows(paths, "policy_versions", "d")] == list(range(1, 8))
    assert json.loads((Path(paths.checkpoints("d")) / "run_config.json").read_text())["lr"] == 1e-4
    resume = [r for r in read_rows(paths, "run_events", "d") if r["event"] == "resume"][-1]
    assert "--lr 0.0003 -> 0.0001" in json.dumps(resume, default=str)
    edges = [e for e in read_rows(paths, "lineage", "d") if e.get("relation") == "config_changed_from"]
    assert [(e["child"], e["parent"]) for e in edges] == [("d.v000007", f"config:{old_hash}")], edges


def test_a_bad_flag_fails_before_ray_with_the_flag_named(tmp_path):
    proc = subprocess.run(
        [*warm_python(), "-m", "miles_platform.cli", "train-diffusion", "--hf-checkpoint", str(tmp_path),
         "--diffusion-task", "t2i", "--prompt-data", "x.jsonl", "--rollout-batch-size", "2", "--num-rollout", "1",
         "--diffusion-step-strategy-path", "sde_window", "--diffusion-num-sde-steps", "2",
         "--storage-root", str(tmp_path / "root")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "--hf-checkpoint" in proc.stderr and "model_index.json" in proc.stderr
    assert not (tmp_path / "root").exists()  # nothing written
