"""The VLM demo's SFT base (docs/vlm.md): a tiny Qwen3-VL that reads the image but is systematically
wrong on one count, as the text demo's base drops the carry (docs/sft_base.md).

SFT runs through the RL trainer (training/sft.py `train_sft`, a `TrainerActor` with `--loss-type
sft_loss`, fsdp; the rows tokenized by `tokenize_sft`, as `miles-platform sft --multimodal-keys`
does) on the counting task (data/image_tasks.py) with images in the batch. Its labels are
right except for one case: `wrong_frac` of the rows with `wrong_count` squares are labelled
`wrong_as`. The base learns the other counts, answers `wrong_as` on most `wrong_count` images
greedily, and keeps the right answer in its sampling distribution: room for GRPO, whose reward
grades the true count.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles_platform.training.sft import SFTRecipe, tokenize_sft, train_sft


@dataclass
class VLMBaseRecipe:
    """The SFT base's knobs: data (which count is mislabelled, how often) and the trainer's recipe."""

    wrong_count: int = 4
    wrong_as: int = 3
    wrong_frac: float = 0.65
    sft_rows: int = 512
    # the tiny VLM's image size: 64 resizes a 32x32 task image so that one 16-pixel patch is one
    # grid cell (4 merged image tokens); at 32 (a patch = 2x2 cells, one token) SFT stays on the
    # constant-answer plateau for 300 steps
    image_size: int = 64
    sft: SFTRecipe = dataclasses.field(
        default_factory=lambda: SFTRecipe(
            lr=3e-3, lr_warmup_iters=5, min_lr=3e-4, global_batch_size=64, micro_batch_size=64,
            train_iters=250, num_threads=1, log_interval=25,
        )
    )  # fmt: skip
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def biased_sft_rows(rows: list[dict], recipe: VLMBaseRecipe) -> list[dict]:
    """Counting rows as SFT rows (prompt, response, images): the count as the response, except that
    `wrong_frac` of the `wrong_count` rows (drawn by seed) say `wrong_as`."""
    rng = random.Random(recipe.seed)
    out = []
    for r in rows:
        k = int(r["label"])
        said = recipe.wrong_as if k == recipe.wrong_count and rng.random() < recipe.wrong_frac else k
        out.append({"prompt": r["prompt"], "response": f" {said}", "images": r["images"], "count": k})
    return out


def sft_image_rows(rows: list[dict]) -> list[dict]:
    """biased_sft_rows as `tokenize_sft` takes image rows (what `load_sft_rows` makes of a dataset
    with --multimodal-keys): the prompt's `<image>` as the vision tokens, the images as data URIs."""
    from miles_platform.data.dataset import _vision_prompt
    from miles_platform.data.images import to_data_uri

    return [{"prompt": _vision_prompt(r["prompt"]), "response": r["response"],
             "_images": [to_data_uri(b) for b in r["images"]]} for r in rows]  # fmt: skip


def run_vlm_sft(save: str, recipe: VLMBaseRecipe | None = None, progress: bool = False) -> dict[str, Any]:
    """A fresh tiny Qwen3-VL SFT'd on the mislabelled counting rows, saved as an HF dir at `save`.
    Returns the SFT metrics (loss curve, sft_seconds, sft_cpu_seconds, ...) and `save`."""
    from miles_platform.data.image_tasks import count_corpus, count_rows, split_layouts
    from miles_platform.models.checkpoint import load_hf_checkpoint, save_hf_checkpoint
    from miles_platform.models.vlm import PromptVision, build_image_processor, save_tiny_vlm_checkpoint

    recipe = recipe or VLMBaseRecipe()
    train_layouts, _ = split_layouts(16, 0)  # the layouts make-data trains on (eval's are held out)
    rows = biased_sft_rows(count_rows(train_layouts, recipe.sft_rows, recipe.seed + 1), recipe)
    with tempfile.TemporaryDirectory(prefix="miles-vlm-sft-") as tmp:
        init = save_tiny_vlm_checkpoint(
            Path(tmp) / "init", corpus=count_corpus(), seed=recipe.seed, image_size=recipe.image_size
        )
        model, tok = load_hf_checkpoint(init)
        rows = sft_image_rows(rows)
        ids, mask = tokenize_sft(rows, tok, vision=PromptVision(init))
        sft = dataclasses.replace(recipe.sft, seed=recipe.seed)
        images = [r["_images"] for r in rows]
        metrics = train_sft(model, init, ids, mask, sft, sft.train_iters, progress, images)
    metrics["save"] = str(
        save_hf_checkpoint(model, tok, save, extra=build_image_processor(recipe.image_size))
    )
    metrics["recipe"] = recipe.to_dict()
    return metrics


def greedy_count_accuracy(hf_dir: str, eval_path: str, max_new_tokens: int = 3) -> dict[str, Any]:
    """Held-out greedy accuracy of an HF Qwen-VL dir on a counting Parquet (make-data count_shapes),
    graded by `--rm-type math`: {"acc", "per_count": {k: acc}, "answers": {k: {answer: n}},
    "seconds"}. In-process, one stateless forward per token (models/vlm.py vlm_logits)."""
    import pyarrow.parquet as pq

    from miles_platform.data.dataset import _vision_prompt
    from miles_platform.data.images import to_data_uri
    from miles_platform.models.checkpoint import load_hf_checkpoint
    from miles_platform.models.vlm import PromptVision, vlm_logits
    from miles_platform.rollout.rm_hub.math_rm import math_reward

    t0 = time.perf_counter()
    model, tok = load_hf_checkpoint(hf_dir)
    model.eval()
    vision = PromptVision(hf_dir)
    hits: dict[int, list[float]] = {}
    answers: dict[int, dict[str, int]] = {}
    with torch.no_grad():
        for r in pq.read_table(eval_path).to_pylist():
            uris = [to_data_uri(b) for b in r["images"]]
            ids = vision.expand(tok.encode(_vision_prompt(r["prompt"]), add_special_tokens=False), uris)
            px = vision.pixels(uris)
            out: list[int] = []
            for _ in range(max_new_tokens):
                x = torch.tensor([ids + out])
                nxt = int(vlm_logits(model, x, px["pixel_values"], px["image_grid_thw"])[0, -1].argmax())
                if nxt == tok.eos_token_id:
                    break
                out.append(nxt)
            text = tok.decode(out)
            k = int(r["label"])
            hits.setdefault(k, []).append(math_reward(text, r["label"]))
            answers.setdefault(k, {}).setdefault(text.strip(), 0)
            answers[k][text.strip()] += 1
    n = sum(len(v) for v in hits.values())
    return {
        "acc": sum(sum(v) for v in hits.values()) / n,
        "per_count": {k: sum(v) / len(v) for k, v in sorted(hits.items())},
        "answers": {k: answers[k] for k in sorted(answers)},
        "seconds": time.perf_counter() - t0,
    }
