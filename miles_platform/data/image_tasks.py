"""An image task with a verifiable answer (docs/vlm.md): count the squares drawn in a small image.

`miles-platform make-data --difficulty count_shapes --out DIR` writes train.parquet and
eval.parquet: {"prompt": "How many shapes are in <image>?", "label": "3", "images": [PNG bytes],
"metadata": {...}}, for `--multimodal-keys '{"image": "images"}' --input-key prompt --label-key label
--rm-type math`. Each image is 32x32 (the tiny Qwen3-VL's size): 1 to 4 filled squares of 6 pixels
in distinct cells of a 4x4 grid, colours drawn per square, on white. Deterministic from the seed;
the eval split holds out whole layouts (a layout is never in both splits; 4 of the 16 one-square
layouts at most, so eval has 4 one-square rows at the default size).
"""

from __future__ import annotations

import io
import itertools
import json
import os
import random
from pathlib import Path

from miles_platform.data.images import IMAGE_PLACEHOLDER

COUNT_TASK = "count_shapes"
PROMPT = f"How many shapes are in {IMAGE_PLACEHOLDER}?"
MAX_SHAPES = 4
_CELL, _SIDE, _SIZE = 8, 6, 32  # a 4x4 grid of 8-pixel cells, 6-pixel squares, 32x32 images


def draw_shapes(cells: tuple[int, ...], seed: int) -> bytes:
    """PNG bytes of squares in `cells` (indices of the 4x4 grid), colours from `seed`."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    img = Image.new("RGB", (_SIZE, _SIZE), "white")
    d = ImageDraw.Draw(img)
    for c in cells:
        x, y = (c % 4) * _CELL + 1, (c // 4) * _CELL + 1
        colour = tuple(rng.randrange(0, 160) for _ in range(3))
        d.rectangle([x, y, x + _SIDE - 1, y + _SIDE - 1], fill=colour)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _layouts(k: int) -> list[tuple[int, ...]]:
    return list(itertools.combinations(range(16), k))


def split_layouts(eval_per_count: int, seed: int) -> tuple[dict, dict]:
    """Per count, (train layouts, eval layouts): `eval_per_count` layouts of each count held out (a
    quarter of the 16 one-square layouts at most), so eval images are layouts training never drew."""
    rng = random.Random(seed)
    train, evals = {}, {}
    for k in range(1, MAX_SHAPES + 1):
        lay = _layouts(k)
        rng.shuffle(lay)
        n = min(eval_per_count, len(lay) // 4)
        evals[k], train[k] = lay[:n], lay[n:]
    return train, evals


def _row(cells: tuple[int, ...], seed: int) -> dict:
    k = len(cells)
    return {"prompt": PROMPT, "label": str(k), "images": [draw_shapes(cells, seed)],
            "metadata": {"task": COUNT_TASK, "count": k, "cells": list(cells)}}  # fmt: skip


def count_rows(layouts: dict, n: int, seed: int) -> list[dict]:
    """`n` rows, counts uniform in 1..MAX_SHAPES, each a layout of that count and fresh colours."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        k = rng.randint(1, MAX_SHAPES)
        rows.append(_row(rng.choice(layouts[k]), seed * 100003 + i))
    return rows


def write_parquet(rows: list[dict], path: str | os.PathLike) -> str:
    import pyarrow as pa

    from miles_platform.store.shards import write_parquet_atomic

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([{**r, "metadata": json.dumps(r["metadata"])} for r in rows])
    write_parquet_atomic(table, str(path))
    return str(path)


def write_count_datasets(out_dir: str | os.PathLike, seed: int = 0, eval_size: int = 64,
                         train_size: int = 512) -> dict[str, str]:  # fmt: skip
    """train.parquet (`train_size` rows) and eval.parquet (`eval_size` / 4 held-out layouts per count,
    one row each; 4 for one square) of the counting task under `out_dir`; {split: path}."""
    per = max(1, eval_size // MAX_SHAPES)
    train, evals = split_layouts(per, seed)
    eval_rows = [_row(c, seed + 7 + i) for k in sorted(evals) for i, c in enumerate(evals[k])]
    out = Path(out_dir)
    return {"train": write_parquet(count_rows(train, train_size, seed), out / "train.parquet"),
            "eval": write_parquet(eval_rows, out / "eval.parquet")}  # fmt: skip


def count_corpus() -> list[str]:
    """The task's text (prompts and answers): the tiny VLM's tokenizer corpus."""
    return [f"{PROMPT} {k}" for k, _ in itertools.product(range(MAX_SHAPES + 1), range(2))]
