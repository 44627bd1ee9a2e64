"""Dagster weights domain in-process: sensor -> weight_publications, quantized_weights + checks."""

import shutil

import dagster as dg
import torch
from safetensors.torch import load_file, save_file

from assets.weights import quantized_weights, weight_publications
from miles_platform.store.paths import StoragePaths
from miles_platform.weights import disk_delta as dd
from resources.storage import StorageRootResource
from sensors.publications import publish_on_new_policy, publish_weights_job


def _export(tiny, dest, seed):
    shutil.copytree(tiny, dest)
    s = load_file(f"{dest}/model.safetensors")
    if seed:
        g = torch.Generator().manual_seed(seed)
        s = {k: v + 1e-3 * (torch.rand(v.shape, generator=g) < 0.1) for k, v in s.items()}
        save_file(s, f"{dest}/model.safetensors", metadata={"format": "pt"})
    return s


def _md(result, key):
    mats = result.asset_materializations_for_node(result.all_node_events[0].node_name)
    return mats[0].metadata[key].value


def test_sensor_publishes_each_version_once_and_quantizes(tiny_hf_checkpoint, tmp_path):
    root = str(tmp_path / "root")
    paths, run = StoragePaths(root), "r1"
    instance = dg.DagsterInstance.ephemeral()
    resources = {"storage": StorageRootResource(root=root)}
    keys = [f"{run}.v{v:06d}" for v in range(2)]
    instance.add_dynamic_partitions("policy_versions", keys)
    states = []
    for v, key in enumerate(keys):
        states.append(_export(tiny_hf_checkpoint, paths.hf_export(run, v), seed=v))
        hf_path = paths.hf_export(run, v) if v == 0 else ""  # v1 resolves by the path convention
        instance.report_runless_asset_event(
            dg.AssetMaterialization("policy_versions", partition=key, metadata={"hf_path": hf_path})
        )

    assert publish_weights_job.name == "publish_weights"
    res = publish_on_new_policy(dg.build_sensor_context(instance=instance))
    assert [r.partition_key for r in res.run_requests] == keys[-1:]  # the newest pending version of the run
    kinds = []
    for key in keys:
        cfg = {"ops": {"weight_publications": {"config": {"disk_delta_encode_workers": 2}}}}
        r = dg.materialize([weight_publications], instance=instance, partition_key=key, resources=resources,
                           run_config=cfg)  # fmt: skip
        assert r.success
        kinds.append(_md(r, "kind"))
        checks = r.get_asset_check_evaluations()
        assert checks and all(c.passed for c in checks)
    assert kinds == ["snapshot", "delta"]
    assert 0 < _md(r, "density") < 0.2 and _md(r, "wire_bytes") < _md(r, "full_bytes") / 2
    # already published versions are not requested again; re-materializing reports the existing one
    res2 = publish_on_new_policy(dg.build_sensor_context(instance=instance, cursor=res.cursor))
    assert not res2.run_requests
    res3 = publish_on_new_policy(dg.build_sensor_context(instance=instance))
    assert not res3.run_requests
    r = dg.materialize([weight_publications], instance=instance, partition_key=keys[1], resources=resources)
    assert _md(r, "reused_existing") is True
    replica = tmp_path / "replica"
    shutil.copytree(tiny_hf_checkpoint, replica)
    assert dd.apply_publication(paths.publications(run), replica) == 1
    got = load_file(str(replica / "model.safetensors"))
    assert all(torch.equal(got[k], states[1][k]) for k in got)

    for fmt in ("fp8", "int4"):
        pk = dg.MultiPartitionKey({"policy_version": keys[1], "format": fmt})
        r = dg.materialize([quantized_weights], instance=instance, partition_key=pk, resources=resources)
        assert r.success
        assert all(c.passed for c in r.get_asset_check_evaluations())
        assert _md(r, "compression_ratio") > 1 and 0 < _md(r, "max_rel_error") < 0.08
        assert "materialize eval_dataset" in _md(r, "eval_skipped")  # no eval data yet: said, not faked

    # with an eval dataset: greedy pass@1 of the quantized weights next to the version's own, the
    # latter exactly what evaluating the export gives
    from miles_platform.rollout.evaluate import evaluate

    data = tmp_path / "eval.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+{i}=", "label": "{2 * i}"}}\n' for i in range(6)))
    instance.report_runless_asset_event(dg.AssetMaterialization("eval_dataset", metadata={"path": str(data)}))
    pk = dg.MultiPartitionKey({"policy_version": keys[1], "format": "int4"})
    cfg = {"ops": {"quantized_weights": {"config": {"eval_max_prompts": 4}}}}
    r = dg.materialize(
        [quantized_weights], instance=instance, partition_key=pk, resources=resources, run_config=cfg
    )
    want = evaluate(
        paths.hf_export(run, 1), [("eval", str(data))], temperature=0.0, max_new_tokens=16, max_prompts=4
    )
    assert _md(r, "eval/pass@1_full_precision") == want["eval"]["pass@1"]  # `<dataset>/<metric>`
    q = _md(r, "eval/pass@1")
    assert 0 <= q <= 1 and _md(r, "eval/pass@1_delta") == q - want["eval"]["pass@1"]
    assert not [
        k for k in r.asset_materializations_for_node("quantized_weights")[0].metadata if "eval/eval/" in k
    ]
    assert "| eval |" in _md(r, "eval") and "| 4 |" in _md(r, "eval")


def test_a_version_served_quantized_materializes_quantized_weights(tiny_hf_checkpoint, tmp_path):
    """A run from a quantized --hf-checkpoint writes each served version beside its export: the training
    op's reporter (made_events) records it as `quantized_weights[<version>|<fmt>]`; a dense run's versions make none."""
    from miles_platform.store.paths import served_path
    from miles_platform.store.versions import PolicyVersion
    from miles_platform.weights.quantize import quantize_checkpoint
    from ops.version_events import made_events

    export = str(tmp_path / "hf" / "v000001")
    shutil.copytree(tiny_hf_checkpoint, export)
    pv = PolicyVersion(run="t", version=1, partition_key="t.v000001", parent_version=0, parent_partition_key="t.v000000",
                       rollout_id=0, checkpoint_path=None, hf_path=export, content_hash="h", config_hash="c",
                       base_data_version="b", dataset_data_version="d", shard_path=str(tmp_path / "shard"),
                       shard_rows=4, mean_reward=0.5, base_checkpoint=tiny_hf_checkpoint, prompt_data=None,
                       eval_interval=None)  # fmt: skip

    def materialized() -> list:
        return [e for e in made_events(pv) if e.asset_key.path == ["quantized_weights"]]

    assert materialized() == []
    quantize_checkpoint(tiny_hf_checkpoint, served_path(export, "fp8"), "fp8")
    (event,) = materialized()
    assert event.partition == dg.MultiPartitionKey({"policy_version": "t.v000001", "format": "fp8"})
    assert event.metadata["path"].value == f"{export}-fp8" and event.metadata["served_by_run"].value is True
    assert event.metadata["bytes"].value > 0 and event.metadata["version"].value == "1"
