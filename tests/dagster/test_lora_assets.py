"""A LoRA version under Dagster: the training op's reporter materializes `lora_adapters` (adapter
dir, base by content hash, rollout shard) and a `policy_versions` event pointing at adapter + base;
the assets that need an HF dir (eval_results, weight_publications) get one merged on demand."""

import dagster as dg
from safetensors.torch import load_file

from assets.evals import resolve_hf_path
from miles_platform.models.checkpoint import content_hash
from miles_platform.store.paths import StoragePaths
from miles_platform.store.versions import PolicyVersion
from miles_platform.training.lora import write_adapter_dir
from ops.version_events import DagsterReporter


def _info(tmp_path, ckpt, adapter_dir):
    return PolicyVersion(run="t", version=1, partition_key="t.v000001", parent_version=0, parent_partition_key="t.v000000",
                rollout_id=0, checkpoint_path=None, hf_path=None, content_hash=content_hash(adapter_dir),
                config_hash="c", base_data_version=content_hash(ckpt), dataset_data_version="d",
                shard_path=str(tmp_path / "shard"), shard_rows=4, mean_reward=0.5, base_checkpoint=ckpt,
                prompt_data=None, eval_interval=None, adapter_path=adapter_dir)  # fmt: skip


def test_lora_version_materializes_lora_adapters_and_points_policy_versions_at_it(
    tiny_hf_checkpoint, tmp_path
):
    import torch

    from assets import all_assets

    spec = next(a for a in all_assets() if isinstance(a, dg.AssetSpec) and a.key.path == ["lora_adapters"])
    assert {d.asset_key.path[0] for d in spec.deps} == {"rollout_shards", "base_checkpoint"}
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    a, b = torch.randn(2, 32, generator=torch.Generator().manual_seed(0)), torch.full((32, 2), 0.5)
    state = {f"{q}.lora_A.weight": a, f"{q}.lora_B.weight": b}
    ad = write_adapter_dir(str(tmp_path / "ad"), state, {"r": 2, "lora_alpha": 4}, tiny_hf_checkpoint,
                           content_hash(tiny_hf_checkpoint))  # fmt: skip
    info = _info(tmp_path, tiny_hf_checkpoint, ad)

    @dg.op
    def report(context: dg.OpExecutionContext):
        rep = DagsterReporter(context)
        rep.on_policy_version(info)
        rep.on_rollout(0, {"rollout/raw_reward": 0.5})

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("policy_versions", [])
        out = dg.GraphDefinition(name="g", node_defs=[report]).to_job().execute_in_process(instance=instance)
        assert out.success
        events = {e.asset_key.path[0]: e for e in out.asset_materializations_for_node("report")}
        # eval_results / weight_publications read a LoRA version through a merged dir made on demand
        paths = StoragePaths(str(tmp_path / "root"))
        merged = resolve_hf_path(instance, paths, "t.v000001")
        assert merged == paths.hf_export("t", 1) and resolve_hf_path(instance, paths, "t.v000001") == merged
    want, have = (
        load_file(f"{tiny_hf_checkpoint}/model.safetensors"),
        load_file(f"{merged}/model.safetensors"),
    )
    name = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(have[name], want[name] + (4 / 2) * b @ a)  # W + (alpha / r) B A
    assert all(torch.equal(have[k], want[k]) for k in want if k != name)
    lora, pv = events["lora_adapters"], events["policy_versions"]
    assert lora.partition == pv.partition == "t.v000001"
    assert lora.metadata["path"].value == ad and lora.metadata["base_checkpoint"].value == tiny_hf_checkpoint
    assert lora.metadata["base_data_version"].value == content_hash(tiny_hf_checkpoint)
    assert lora.metadata["size_bytes"].value > 0 and lora.metadata["shard_path"].value.endswith("shard")
    assert pv.metadata["adapter_path"].value == ad and pv.metadata["hf_path"].value == ""
