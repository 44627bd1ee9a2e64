"""Each `rollout_shards` / `policy_versions` partition links to its samples in the rollout viewer
($MILES_VIEWER_URL), or says how to start one when no viewer is configured."""

import dagster as dg

from miles_platform.store.versions import PolicyVersion
from ops.version_events import policy_version_event, rollout_shard_event

ROOT = "/data/root"
PV = PolicyVersion(
    run="demo", version=3, partition_key="demo.v000003", parent_version=2, parent_partition_key="demo.v000002",
    rollout_id=2, checkpoint_path=None, hf_path=f"{ROOT}/runs/demo/hf/v000003", content_hash="h", config_hash="c",
    base_data_version=None, dataset_data_version=None, shard_path=f"{ROOT}/rollouts/run=demo/rollout_id=000002/part-0.parquet",
    shard_rows=8, mean_reward=0.5, base_checkpoint=None, prompt_data=None, eval_interval=None,
)  # fmt: skip


def test_partitions_link_to_the_viewer_under_miles_viewer_url(monkeypatch):
    monkeypatch.setenv("MILES_VIEWER_URL", "http://127.0.0.1:8700/")
    shard = rollout_shard_event(PV).metadata["viewer"]
    version = policy_version_event(PV, {}, {}).metadata["viewer"]
    assert isinstance(shard, dg.UrlMetadataValue) and isinstance(version, dg.UrlMetadataValue)
    assert shard.url == "http://127.0.0.1:8700/samples?run=demo&rollout_from=2&rollout_to=2"
    assert version.url == "http://127.0.0.1:8700/samples?run=demo&version=3"


def test_without_a_viewer_url_the_metadata_says_how_to_start_one(monkeypatch):
    monkeypatch.delenv("MILES_VIEWER_URL", raising=False)
    md = policy_version_event(PV, {}, {}).metadata["viewer"]
    assert isinstance(md, dg.TextMetadataValue)
    assert (
        md.text.startswith(f"miles-platform viewer --storage-root {ROOT},") and "MILES_VIEWER_URL=" in md.text
    )
    monkeypatch.setenv("MILES_VIEWER_URL", "127.0.0.1:8700")  # no scheme: no broken link either
    assert "is not an http(s) URL" in rollout_shard_event(PV).metadata["viewer"].text
