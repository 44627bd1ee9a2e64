"""A vision-language run end to end on Ray (docs/vlm.md): image prompts from Parquet bytes, the
embedded engine's image_data, the fsdp trainer's image step with --ci-test on, image hashes in shards."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
from loop_helpers import small_run_config

from miles_platform.data.images import image_hash
from miles_platform.loop import train, validate_before_start
from miles_platform.models.vlm import save_tiny_vlm_checkpoint
from miles_platform.store.paths import StoragePaths
from miles_platform.store.shards import shard_path


def _png(n: int) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (32, 32), "white")
    for i in range(n):
        ImageDraw.Draw(img).rectangle([2 + 8 * i, 10, 7 + 8 * i, 20], fill="black")
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def test_vlm_run_with_ci_test_records_image_hashes(tmp_path):
    ckpt = save_tiny_vlm_checkpoint(tmp_path / "vl")
    rows = [
        {"prompt": "How many shapes are in <image>?", "label": str(n), "images": [_png(n)]}
        for n in (1, 2, 3, 1)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    cfg = small_run_config(ckpt, tmp_path, prompt_data=str(tmp_path / "d.parquet"), ci_test=True,
                           multimodal_keys='{"image": "images"}', freeze_vision_tower=True)  # fmt: skip
    validate_before_start(cfg)
    res = train(cfg)
    assert res.final_version == 2 and res.ci_checks["train_rollout_logprob_abs_diff"] < 1e-3
    rows = pq.read_table(shard_path(StoragePaths(cfg.storage_root), "t", 0)).to_pylist()
    want = {image_hash(_png(n)) for n in (1, 2, 3)}
    assert len(rows) == 4 and all(len(r["image_hashes"]) == 1 and r["image_hashes"][0] in want for r in rows)
