"""A LoRA version under Dagster: the training op's reporter materializes `lora_adapters` (adapter
dir, base by content hash, rollout shard) and a `policy_versions` event pointing at adapter + base."""

import dagster as dg

from miles_platform.models.checkpoint import content_hash
from miles_platform.training.lora import write_adapter_dir
from ops.training import DagsterReporter


def _info(tmp_path, ckpt, adapter_dir):
    return dict(run="t", version=1, partition_key="t.v000001", parent_version=0, parent_partition_key="t.v000000",
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
    state = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 32)}
    ad = write_adapter_dir(str(tmp_path / "ad"), state, {"r": 2, "lora_alpha": 4}, tiny_hf_checkpoint, "h")
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
    lora, pv = events["lora_adapters"], events["policy_versions"]
    assert lora.partition == pv.partition == "t.v000001"
    assert lora.metadata["path"].value == ad and lora.metadata["base_checkpoint"].value == tiny_hf_checkpoint
    assert lora.metadata["base_data_version"].value == content_hash(tiny_hf_checkpoint)
    assert lora.metadata["size_bytes"].value > 0 and lora.metadata["shard_path"].value.endswith("shard")
    assert pv.metadata["adapter_path"].value == ad and pv.metadata["hf_path"].value == ""
