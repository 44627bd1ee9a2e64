"""The counting task (data/image_tasks.py, `make-data --difficulty count_shapes`): the label is what
the image shows, eval layouts are held out, and the dataset loads with --multimodal-keys."""

from __future__ import annotations

import io
import json

import pyarrow.parquet as pq

from miles_platform.data.dataset import load_prompt_dataset
from miles_platform.data.tasks import cli_main


def _squares(png: bytes) -> int:
    """Connected non-white blobs of the image (4-neighbour flood fill)."""
    import numpy as np
    from PIL import Image

    ink = (np.asarray(Image.open(io.BytesIO(png)).convert("L")) < 250).tolist()
    seen, blobs = set(), 0
    for y0, row in enumerate(ink):
        for x0, on in enumerate(row):
            if on and (y0, x0) not in seen:
                blobs += 1
                stack = [(y0, x0)]
                while stack:
                    y, x = stack.pop()
                    if (y, x) in seen or not (0 <= y < 32 and 0 <= x < 32) or not ink[y][x]:
                        continue
                    seen.add((y, x))
                    stack += [(y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)]
    return blobs


def test_make_data_count_shapes(tmp_path, capsys):
    assert cli_main(["--difficulty", "count_shapes", "--out", str(tmp_path), "--train-size", "64"]) == 0
    assert "train.parquet (64 rows)" in capsys.readouterr().out
    train = pq.read_table(tmp_path / "train.parquet").to_pylist()
    evals = pq.read_table(tmp_path / "eval.parquet").to_pylist()
    for r in train[:16] + evals[:16]:
        assert _squares(r["images"][0]) == int(r["label"])  # the reward's label is what the image shows
    layouts = lambda rows: {tuple(json.loads(r["metadata"])["cells"]) for r in rows}  # noqa: E731
    assert not layouts(train) & layouts(evals)
    assert {r["label"] for r in evals} == {"1", "2", "3", "4"}
    recs = load_prompt_dataset(
        str(tmp_path / "eval.parquet"), "prompt", "label", multimodal_keys={"image": "images"}
    )
    assert len(recs) == len(evals) and all(len(r.images) == 1 for r in recs)


def test_thumbnail_grid_tiles_the_images_for_the_asset_preview():
    from PIL import Image

    from miles_platform.data.image_tasks import draw_shapes
    from miles_platform.data.images import thumbnail_grid

    pngs = [draw_shapes((i,), seed=i) for i in range(10)]
    grid = Image.open(io.BytesIO(thumbnail_grid(pngs, ncol=8, scale=3, pad=2)))
    assert grid.size == (8 * (96 + 2) + 2, 2 * (96 + 2) + 2)
    # the first tile is the first image upscaled: its square (cell 0) is at the top left
    assert grid.getpixel((2 + 3 * 3, 2 + 3 * 3)) != (255, 255, 255)
    assert grid.getpixel((2 + 3 * 20, 2 + 3 * 20)) == (255, 255, 255)
