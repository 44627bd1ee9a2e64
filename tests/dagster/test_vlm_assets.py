"""The VLM demo's dataset assets (assets/vlm.py): Parquet with images, thumbnails on the asset page."""

import dagster as dg

from assets.vlm import vlm_datasets
from resources.storage import StorageRootResource


def test_vlm_datasets_materialize_with_thumbnails(tmp_path):
    res = dg.materialize(
        [vlm_datasets],
        resources={"storage": StorageRootResource(root=str(tmp_path))},
        run_config={"ops": {"vlm_datasets": {"config": {"train_size": 24, "eval_size": 8}}}},
    )
    assert res.success
    mats = {m.asset_key.path[0]: m.metadata for m in res.asset_materializations_for_node("vlm_datasets")}
    assert mats["vlm_prompt_dataset"]["rows"].value == 24 and mats["vlm_eval_dataset"]["rows"].value == 8
    for md in mats.values():
        assert str(md["path"].value).startswith(str(tmp_path)) and str(md["path"].value).endswith(".parquet")
        assert "data:image/png;base64," in md["thumbnails"].value and "labels: " in md["thumbnails"].value
