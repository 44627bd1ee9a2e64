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
    # the generic prompt_dataset reads the same Parquet with --multimodal-keys: images kept, thumbnails
    # on its page, its blocking checks pass on the normalized file with its images column
    from assets.datasets import _check_results, prompt_dataset

    src = str(mats["vlm_prompt_dataset"]["path"].value)
    cfg = {"path": src, "input_key": "prompt", "label_key": "label", "multimodal_keys": '{"image": "images"}'}
    res = dg.materialize([prompt_dataset], resources={"storage": StorageRootResource(root=str(tmp_path))},
                         run_config={"ops": {"prompt_dataset": {"config": cfg}}})  # fmt: skip
    md = res.asset_materializations_for_node("prompt_dataset")[0].metadata
    assert "data:image/png;base64," in md["thumbnails"].value and 1 < md["images"].value <= 24
    assert all(c.passed for c in _check_results(prompt_dataset.key, str(md["path"].value)))
    from miles_platform.data.dataset import load_prompt_dataset

    again = load_prompt_dataset(str(md["path"].value), "prompt", "label", multimodal_keys={"image": "images"})
    assert len(again) == 24 and all(len(r.images) == 1 for r in again)  # a run reads it back with its images
