"""A text-to-image task small enough for CPU RL: one coloured square on black, 16x16 RGB.

Prompts name two attributes, "a red square in the top left": a colour (red, green, blue, yellow)
and a quadrant of a 2x2 grid. `attribute_reward` checks both programmatically.

Splits, all from the 16 colour x quadrant combinations:
  train  12 combinations (RL prompts)
  eval   the 4 held out on a Latin-square diagonal, so every colour and every quadrant still
         appears in training; the eval measures compositional generalisation
  sft    train combinations with images. `error_rate` of them are wrong in one systematic way,
         like the dropped carry of the arithmetic task (data/tasks.py), so the SFT base makes
         that error about that often; the reward sees it and RL fixes it:
           dim     (the default) the square is drawn dark, its colour channels at DIM_LEVEL
                   instead of full intensity. The fix is one prompt-independent direction, so
                   it carries over to the held-out combinations.
           mirror  the image is mirrored left-right (wrong column). RL fixes it on the train
                   combinations, but the tiny DiT learns it per combination: held-out
                   combinations get worse (measured, docs/diffusion.md).
"""

from __future__ import annotations

import io
import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from miles_platform.errors import DataError
from miles_platform.store.atomic import write_atomic

IMAGE_SIZE = 16
SQUARE = 5  # side in pixels
# the square's corner jitters by 0/1 px inside a 1-px margin of its 8x8 quadrant: a wider jitter
# (0..3 px) makes the SFT base blurry within the CPU budget, while this one keeps samples crisp
MARGIN = 1
BACKGROUND = -1.0
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, -1.0, -1.0),
    "green": (-1.0, 1.0, -1.0),
    "blue": (-1.0, -1.0, 1.0),
    "yellow": (1.0, 1.0, -1.0),
}
ROWS = ("top", "bottom")
COLUMNS = ("left", "right")
POSITIONS = tuple(f"{r} {c}" for r in ROWS for c in COLUMNS)
# held out: one combination per colour and per quadrant (a Latin-square diagonal)
EVAL_COMBINATIONS = (
    ("red", "top left"),
    ("green", "top right"),
    ("blue", "bottom left"),
    ("yellow", "bottom right"),
)
DEFAULT_ERROR_RATE = 0.65
ERROR_KINDS = ("dim", "mirror")
DEFAULT_ERROR = "dim"
DIM_LEVEL = float(
    np.float32(96 / 127.5) - np.float32(1.0)
)  # ~-0.247, exact in a PNG; the reward counts a dim square ~a quarter
DEFAULT_N_SFT = 2048
TASK_NAME = "coloured_square"


def prompt_text(colour: str, position: str) -> str:
    return f"a {colour} square in the {position}"


def parse_prompt(text: str) -> dict[str, str]:
    """{"colour": ..., "position": "top left"}; filler words are ignored, attributes must be unique."""
    words = re.findall(r"[a-z]+", text.lower())
    found = {
        "colour": [w for w in words if w in COLOURS],
        "row": [w for w in words if w in ROWS],
        "column": [w for w in words if w in COLUMNS],
    }
    bad = [k for k, v in found.items() if len(v) != 1]
    if bad:
        raise DataError(
            f"cannot parse prompt {text!r}: needs exactly one {' and one '.join(bad)} word "
            f"(colours {sorted(COLOURS)}, rows {list(ROWS)}, columns {list(COLUMNS)})"
        )
    return {"colour": found["colour"][0], "position": f"{found['row'][0]} {found['column'][0]}"}


def train_prompts() -> list[str]:
    return [prompt_text(c, p) for c in COLOURS for p in POSITIONS if (c, p) not in EVAL_COMBINATIONS]


def eval_prompts() -> list[str]:
    """Held-out combinations: never in train or SFT data."""
    return [prompt_text(c, p) for c, p in EVAL_COMBINATIONS]


def _quadrant(position: str) -> tuple[int, int]:
    row, column = position.split()
    return ROWS.index(row), COLUMNS.index(column)


def render(attrs: dict[str, str], rng: np.random.Generator) -> np.ndarray:
    """[3, 16, 16] float32 in [-1, 1]: the square at a random offset inside its quadrant."""
    half = IMAGE_SIZE // 2
    qr, qc = _quadrant(attrs["position"])
    y, x = (int(v) for v in rng.integers(MARGIN, half - SQUARE - MARGIN + 1, size=2))
    img = np.full((3, IMAGE_SIZE, IMAGE_SIZE), BACKGROUND, dtype=np.float32)
    y0, x0 = qr * half + y, qc * half + x
    img[:, y0 : y0 + SQUARE, x0 : x0 + SQUARE] = np.asarray(COLOURS[attrs["colour"]], np.float32)[
        :, None, None
    ]
    return img


def sft_examples(
    n: int, seed: int, error_rate: float = DEFAULT_ERROR_RATE, error: str = DEFAULT_ERROR
) -> tuple[list[str], np.ndarray]:
    """`n` (prompt, image) pairs over the train prompts; `error_rate` of the images wrong by `error`."""
    if not 0.0 <= error_rate <= 1.0:
        raise DataError(f"error_rate must be in [0, 1], got {error_rate}")
    if error not in ERROR_KINDS:
        raise DataError(f"error {error!r}: one of {', '.join(ERROR_KINDS)}")
    rng = np.random.default_rng(seed)
    pool = train_prompts()
    prompts = [pool[i] for i in rng.integers(0, len(pool), size=n)]
    images = (
        np.stack([render(parse_prompt(p), rng) for p in prompts])
        if n
        else np.zeros((0, 3, 16, 16), np.float32)
    )
    # mirroring the whole image keeps the jitter distribution and the colour; only the column is wrong
    wrong = rng.random(n) < error_rate
    if error == "mirror":
        images[wrong] = images[wrong][..., ::-1]
    else:  # dim: every "on" channel of the square (value 1) drawn at DIM_LEVEL
        images[wrong] = np.where(images[wrong] > 0, np.float32(DIM_LEVEL), images[wrong])
    return prompts, images


# ---- reward ------------------------------------------------------------------------------------


@lru_cache(maxsize=1024)
def _reward_masks(prompt: str, h: int, w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(channels that must be on, channels that must be off, target quadrant mask [h, w])."""
    attrs = parse_prompt(prompt)
    rgb = np.asarray(COLOURS[attrs["colour"]])
    qr, qc = _quadrant(attrs["position"])
    region = np.zeros((h, w), np.float32)
    region[qr * h // 2 : (qr + 1) * h // 2, qc * w // 2 : (qc + 1) * w // 2] = 1.0
    return rgb > 0, rgb < 0, region


def _as_batch(images: Any) -> np.ndarray:
    if hasattr(images, "detach"):  # torch tensor, without importing torch here
        images = images.detach().float().cpu().numpy()
    arr = np.asarray(images, dtype=np.float32)
    return arr[None] if arr.ndim == 3 else arr


def _scores(prompts: list[str], images: Any) -> dict[str, np.ndarray]:
    x = _as_batch(images)
    if x.ndim != 4 or x.shape[1] != 3 or len(prompts) != x.shape[0]:
        raise ValueError(f"expected {len(prompts)} images [3, H, W], got shape {x.shape}")
    h, w = x.shape[2:]
    masks = [_reward_masks(p, h, w) for p in prompts]
    on_mask = np.stack([m[0] for m in masks])[:, :, None, None]
    off_mask = np.stack([m[1] for m in masks])[:, :, None, None]
    region = np.stack([m[2] for m in masks])
    # a channel is "on" from 0 (value -0.5) to 1 (value 0.5): small noise on the background is ignored
    on = np.clip(x + 0.5, 0.0, 1.0)
    mass = on.max(axis=1)  # [B, H, W] how much of an object each pixel is
    colour = np.where(on_mask, on, 1.0).min(axis=1) * (1.0 - np.where(off_mask, on, 0.0).max(axis=1))
    # normalise by at least one square, so a blank or faint image scores ~0, a smeared one low
    denom = np.maximum(mass.sum(axis=(1, 2)), float(SQUARE * SQUARE * h * w) / IMAGE_SIZE**2)
    return {
        "reward": np.clip((colour * region).sum(axis=(1, 2)) / denom, 0.0, 1.0),
        "colour_ok": np.clip(colour.sum(axis=(1, 2)) / denom, 0.0, 1.0),
        "position_ok": np.clip((mass * region).sum(axis=(1, 2)) / denom, 0.0, 1.0),
    }


def attribute_rewards(prompts: list[str], images: Any) -> np.ndarray:
    """Batched `attribute_reward`: [B] float32 for images [B, 3, H, W]."""
    return _scores(prompts, images)["reward"].astype(np.float32)


def attribute_reward(prompt: str, image: Any) -> float:
    """In [0, 1]: the share of the image's object mass that has the prompt's colour and lies in its
    quadrant (normalised by at least one square's area). 1 for a correct render, 0 for a blank image,
    a wrong colour or the wrong quadrant; continuous in between."""
    return float(_scores([prompt], image)["reward"][0])


def attribute_checks(prompt: str, image: Any) -> dict[str, float]:
    """Per-attribute parts for logging: colour_ok (right colour anywhere), position_ok (any colour in
    the right quadrant), reward."""
    return {k: float(v[0]) for k, v in _scores([prompt], image).items()}


# ---- images as PNG -----------------------------------------------------------------------------


def _to_uint8_hwc(image: Any) -> np.ndarray:
    x = _as_batch(image)[0]
    return np.round((np.clip(x, -1.0, 1.0) + 1.0) * 127.5).astype(np.uint8).transpose(1, 2, 0)


def to_png(image: Any) -> bytes:
    """[3, H, W] in [-1, 1] -> PNG bytes (uint8 RGB)."""
    from PIL import Image  # pillow comes with diffusers

    buf = io.BytesIO()
    Image.fromarray(_to_uint8_hwc(image), mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


def from_png(data: bytes) -> np.ndarray:
    """PNG bytes -> [3, H, W] float32 in [-1, 1]."""
    from PIL import Image

    arr = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float32)
    return arr.transpose(2, 0, 1) / 127.5 - 1.0


def image_grid(images: Any, nrow: int = 8, scale: int = 4, pad: int = 1) -> bytes:
    """PNG of images [B, 3, H, W] in rows of `nrow`, upscaled `scale`x (nearest) for the UI."""
    x = _as_batch(images)
    b, _, h, w = x.shape
    ncol = min(nrow, b)
    nrows = -(-b // ncol)
    grid = np.full((3, nrows * (h + pad) + pad, ncol * (w + pad) + pad), 0.0, np.float32)  # grey gaps
    for i in range(b):
        r, c = divmod(i, ncol)
        grid[
            :, pad + r * (h + pad) : pad + r * (h + pad) + h, pad + c * (w + pad) : pad + c * (w + pad) + w
        ] = x[i]
    return to_png(grid.repeat(scale, axis=1).repeat(scale, axis=2))


# ---- datasets ----------------------------------------------------------------------------------


def _prompt_row(prompt: str, split: str) -> dict:
    attrs = parse_prompt(prompt)
    return {
        "prompt": prompt,
        "label": json.dumps(attrs, sort_keys=True),
        "metadata": {"task": TASK_NAME, "split": split},
    }


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)


def _repeat_shuffled(prompts: list[str], n: int, rng: np.random.Generator) -> list[str]:
    """`n` rows cycling through every prompt equally often, in shuffled order."""
    reps = -(-n // len(prompts))
    rows = [p for _ in range(reps) for p in prompts][:n]
    return [rows[i] for i in rng.permutation(n)]


def write_diffusion_data(
    out_dir: str | os.PathLike,
    seed: int = 0,
    n_sft: int = DEFAULT_N_SFT,
    n_train: int = 256,
    n_eval: int = 32,
    error_rate: float = DEFAULT_ERROR_RATE,
    error: str = DEFAULT_ERROR,
) -> dict[str, str]:
    """train.jsonl, eval.jsonl ({"prompt", "label": JSON of the attributes, "metadata"}) and
    sft.parquet (prompt: string, image_png: binary 16x16 RGB) under `out_dir`; return {split: path}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed + 1)
    paths = {
        "train": str(out / "train.jsonl"),
        "eval": str(out / "eval.jsonl"),
        "sft": str(out / "sft.parquet"),
    }
    write_atomic(
        paths["train"],
        _jsonl([_prompt_row(p, "train") for p in _repeat_shuffled(train_prompts(), n_train, rng)]),
    )
    write_atomic(
        paths["eval"], _jsonl([_prompt_row(p, "eval") for p in _repeat_shuffled(eval_prompts(), n_eval, rng)])
    )
    prompts, images = sft_examples(n_sft, seed, error_rate, error)
    table = pa.table(
        {
            "prompt": pa.array(prompts, pa.string()),
            "image_png": pa.array([to_png(im) for im in images], pa.binary()),
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    write_atomic(paths["sft"], buf.getvalue())
    return paths


def read_sft_parquet(path: str | os.PathLike) -> tuple[list[str], np.ndarray]:
    """sft.parquet -> (prompts, images [n, 3, 16, 16] in [-1, 1])."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["prompt", "image_png"])
    prompts = table.column("prompt").to_pylist()
    images = [from_png(b) for b in table.column("image_png").to_pylist()]
    return prompts, np.stack(images) if images else np.zeros((0, 3, IMAGE_SIZE, IMAGE_SIZE), np.float32)
