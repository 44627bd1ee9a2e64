"""Supervised fine-tuning (`--loss-type sft_loss`): the starting policy for RL.

As in Miles, SFT is the RL trainer with another loss: `run_sft` drives a `TrainerActor` in this
process (fsdp or megatron backend, `--train-backend`), one optimizer step per global batch of
rows. Loss is token-mean cross-entropy over the trained response tokens (answer + EOS; a tool
episode's tool answers are context), AdamW, the trainers' one LR schedule (training/schedule.py),
grad-norm clip, micro-batches with gradient accumulation up to `--global-batch-size`. Same seed,
same data, same threads -> same weights, bit for bit.

Image rows (`multimodal_keys`, Miles' `--multimodal-keys '{"image": KEY}'`, a vision-language
`--hf-checkpoint`): the row's images are read and checked as a prompt dataset's (data/images.py),
each `<image>` of the prompt becomes the vision tokens with its pads expanded by the checkpoint's
image processor (as a rollout's prompt), and the batch carries the images; the loss stays on the
response. The saved dir keeps the checkpoint's `preprocessor_config.json`.

`default_sft_recipe()` is the demo's SFT base: small and short enough for 2 CPU cores, and on the
dropped-carry SFT split it leaves a policy that is right on non-carry sums and systematically
wrong on carries -- room for GRPO to show a large, verifiable gain (docs/sft_base.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles_platform.config import RunConfig
from miles_platform.errors import DataError, MilesError
from miles_platform.models.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from miles_platform.models.qwen3 import build_model, num_parameters, tiny_qwen3_config
from miles_platform.models.tokenizer import TASK_TOKENIZERS
from miles_platform.progress import Progress
from miles_platform.training.actor import TrainBatch, TrainerActor


@dataclass
class SFTRecipe:
    """Every knob of one SFT run. Field names are Miles flag names where Miles has one."""

    model: dict[str, Any] = field(default_factory=dict)  # tiny_qwen3_config overrides (from scratch)
    lr: float = 5e-3
    lr_decay_style: str = "cosine"
    lr_warmup_iters: int = 50
    # where the warmup starts (megatron's --lr-warmup-init; its default 0 trains step 0 at lr 0).
    # None: lr / lr_warmup_iters, one warmup step in, with which the demo base leaves the loss plateau
    # as it did before the schedule became megatron's (61.5% greedy, 2026-12-05; from 0: 8.0%)
    lr_warmup_init: float | None = None
    min_lr: float = 1e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    clip_grad: float = 1.0
    global_batch_size: int = 128
    micro_batch_size: int = 128
    # past the loss plateau, whose exit step depends on the CPU's kernels as much as on the seed
    # (docs/sft_base.md: 250-675 on one VM, 575-950 on an AVX-512 one; 600 until 2026-12-02)
    train_iters: int | None = 1200
    num_epoch: float | None = None  # used when train_iters is None
    seed: int = 1234
    log_interval: int = 25
    # torch intra-op threads during SFT (restored after); None keeps the process setting (torch's
    # default: every core; the test suite pins 1 per worker). Same weights bit for bit at 1 or 2
    # threads; on an idle 2-core box 2 threads are ~1.7x faster, on a busy one several x slower.
    num_threads: int | None = None
    train_backend: str = "fsdp"  # the RL trainer's backend: fsdp | megatron

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def default_sft_recipe() -> SFTRecipe:
    """The demo's SFT base: see docs/sft_base.md for the measured accuracy, time and RL headroom."""
    return SFTRecipe(
        model=dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2),
        # the seed whose loss left the plateau earliest on the 2026-12-06 VM (step 250: 4.8x margin to
        # 1200; 250 on the first VM too, with the SFT loop of that time); Miles' default 1234 left it
        # at ~300-950 on earlier VMs and not within 1200 iterations there (6% greedy), docs/sft_base.md
        seed=5,
    )


# ---------------------------------------------------------------- data
def load_sft_rows(
    path: str, input_key: str = "prompt", response_key: str = "response", multimodal_keys: dict | None = None
) -> list[dict]:
    """Rows of prompt + response text, or conversations: a messages list under `input_key` (Miles'
    SFT data, `--input-key messages`; masked as the SFT rollout function masks them). JSONL, or
    Parquet (`.parquet`). With `multimodal_keys` ({"image": KEY}) each row's images are read and
    checked (`_images`, data URIs) and its prompt's `<image>`s become the vision tokens."""
    rows = []
    for where, row in _read_rows(path):
        if isinstance(row.get(input_key), list):  # a conversation: its assistant turns are the target
            if multimodal_keys:
                raise DataError(
                    f"{where}: a messages row with --multimodal-keys: image SFT takes prompt + response rows"
                )
            row["_where"] = where
            rows.append(row)
            continue
        for key, flag in ((input_key, "--input-key"), (response_key, "--response-key")):
            if not isinstance(row.get(key), str):
                raise DataError(
                    f"{where}: missing string key {key!r} (check {flag}), or a messages list under --input-key"
                )
        if multimodal_keys:
            from miles_platform.data.dataset import _images, _vision_prompt

            row["_images"] = _images(row, where, row[input_key], path, multimodal_keys)
            row[input_key] = _vision_prompt(row[input_key])
        rows.append(row)
    if not rows:
        raise DataError(f"{path}: no SFT rows")
    return rows


def _read_rows(path: str):
    """(where, row) of a JSONL file (line numbers) or a Parquet file (row numbers)."""
    import fsspec

    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        with fsspec.open(path, "rb") as f:
            for i, row in enumerate(pq.read_table(f).to_pylist()):
                yield f"{path}: row {i}", row
        return
    with fsspec.open(path, "rt") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: malformed JSON ({e.msg})") from None


def tokenize_sft(
    rows: list[dict], tokenizer, input_key: str = "prompt", response_key: str = "response", vision=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [N, L] right-padded, loss_mask [N, L]) with the loss on response + EOS tokens.

    A multi-turn row (a tool episode) may carry `response_parts`: [[text, trained], ...] whose texts
    join to the response; each part is tokenized on its own, as the multi-turn generator appends
    turns, and parts with trained 0 (tool answers, chat markup) get no loss. A conversation row
    (messages under `input_key`) is the chat template's rendering with the loss on its assistant
    turns, exactly as `train`'s SFT rollout function masks it (rollout/sft_rollout.py). A row with
    `_images` (load_sft_rows with multimodal_keys) has each image's pad expanded by `vision`
    (models/vlm.py PromptVision), as the rollout manager expands a prompt's."""
    from miles_platform.rollout.sft_rollout import conversation_tokens

    seqs, masks = [], []
    for i, row in enumerate(rows):
        if isinstance(row[input_key], list):
            where = row.get("_where", f"SFT row {i}")
            s, m = conversation_tokens(
                tokenizer, row[input_key], where, tools=(row.get("metadata") or {}).get("tools")
            )
            if 1 not in m[1:]:
                raise DataError(f"{where}: no assistant message to train on")
            seqs.append(s)
            masks.append(m)
            continue
        p = tokenizer.encode(row[input_key], add_special_tokens=False)
        if row.get("_images"):
            p = vision.expand(p, row["_images"])
        r, m = [], []
        for text, trained in _response_parts(row, response_key, i):
            ids = tokenizer.encode(text, add_special_tokens=False)
            r += ids
            m += [int(trained)] * len(ids)
        seqs.append(p + r + [tokenizer.eos_token_id])
        masks.append([0] * len(p) + m + [1])
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.float32)
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, mask


def _response_parts(row: dict, response_key: str, i: int) -> list[tuple[str, bool]]:
    parts = row.get("response_parts")
    if parts is None:
        return [(row[response_key], True)]
    ok = isinstance(parts, list) and all(
        isinstance(x, list | tuple) and len(x) == 2 and isinstance(x[0], str) and x[1] in (0, 1)
        for x in parts
    )
    if not ok or "".join(x[0] for x in parts) != row[response_key]:
        raise DataError(
            f"SFT row {i}: response_parts must be [[text, 0 or 1], ...] whose texts join to {response_key!r}"
        )
    return [(t, bool(m)) for t, m in parts]


# ---------------------------------------------------------------- training
def run_sft(
    prompt_data: str,
    save: str | None = None,
    hf_checkpoint: str | None = None,
    recipe: SFTRecipe | None = None,
    input_key: str = "prompt",
    response_key: str = "response",
    progress: bool = True,
    tokenizer: str = "arithmetic",
    multimodal_keys: dict[str, str] | None = None,
) -> dict[str, Any]:
    """SFT from scratch (the `tokenizer` task's tokenizer, models.tokenizer.TASK_TOKENIZERS, + tiny
    Qwen3 of recipe.model) or from an HF dir (its own tokenizer), trained by the RL trainer itself
    (TrainerActor with `--loss-type sft_loss`, in this process) on `recipe.train_backend`.

    Returns metrics: loss_curve [(step, loss)], final_loss, sft_seconds, sft_cpu_seconds, train_iters,
    num_parameters, num_samples, save (path or None), and the trained HF `model` + `tokenizer`.
    Saves an HF checkpoint when `save` is set. `progress`: a line on stderr every interval (step,
    loss, lr, ETA; miles_platform/progress.py). `multimodal_keys`: image rows (module docstring),
    on a vision-language `hf_checkpoint`.
    """
    recipe = recipe or default_sft_recipe()
    if recipe.global_batch_size % recipe.micro_batch_size:
        raise MilesError(
            f"--global-batch-size {recipe.global_batch_size} must be a multiple of "
            f"--micro-batch-size {recipe.micro_batch_size}"
        )
    if recipe.train_backend not in ("fsdp", "megatron"):
        raise MilesError(f"--train-backend {recipe.train_backend!r}: choose fsdp or megatron")
    if not hf_checkpoint and tokenizer not in TASK_TOKENIZERS:
        raise MilesError(f"--tokenizer {tokenizer!r}: choose one of {sorted(TASK_TOKENIZERS)}")
    if multimodal_keys and not hf_checkpoint:
        raise MilesError(
            "--multimodal-keys: SFT on images starts from a vision-language --hf-checkpoint, not --from-scratch"
        )
    vision = None
    if multimodal_keys:  # a text model is refused here, by name (no preprocessor_config.json)
        from miles_platform.models.vlm import PromptVision

        vision = PromptVision(str(hf_checkpoint))
    rows = load_sft_rows(prompt_data, input_key, response_key, multimodal_keys)
    iters = recipe.train_iters
    if iters is None:
        epochs = recipe.num_epoch or 1.0
        iters = max(1, math.ceil(epochs * len(rows) / recipe.global_batch_size))

    with tempfile.TemporaryDirectory(prefix="miles-sft-init-") as tmp:
        if hf_checkpoint:
            init = str(hf_checkpoint)
            model, tok = load_hf_checkpoint(init)
        else:  # the trainer starts from an HF dir: write the fresh model to one
            tok = TASK_TOKENIZERS[tokenizer]()
            model = build_model(tiny_qwen3_config(len(tok), **recipe.model), seed=recipe.seed)
            init = str(save_hf_checkpoint(model, tok, Path(tmp) / "init"))
        ids, mask = tokenize_sft(rows, tok, input_key, response_key, vision)
        images = [r.get("_images") or None for r in rows] if vision is not None else None
        metrics = train_sft(model, init, ids, mask, recipe, iters, progress, images)
    metrics.update(
        num_parameters=num_parameters(model), num_samples=len(rows), recipe=recipe.to_dict(), save=None
    )
    if save:
        extra = None if vision is None else vision.processor  # the VLM's preprocessor_config.json
        metrics["save"] = str(save_hf_checkpoint(model, tok, save, extra=extra))
    metrics["model"], metrics["tokenizer"] = model, tok
    return metrics


def sft_run_config(recipe: SFTRecipe, hf_checkpoint: str, iters: int) -> RunConfig:
    """The trainer's RunConfig for an SFT recipe: one optimizer step per "rollout" of
    global_batch_size rows, token-mean NLL over the global batch (`--calculate-per-token-loss`)."""
    gbs = recipe.global_batch_size
    return RunConfig(
        hf_checkpoint=hf_checkpoint,
        train_backend=recipe.train_backend,
        loss_type="sft_loss",
        calculate_per_token_loss=True,
        rollout_batch_size=gbs,
        n_samples_per_prompt=1,
        global_batch_size=gbs,
        micro_batch_size=recipe.micro_batch_size,
        num_rollout=iters,
        lr=recipe.lr,
        min_lr=recipe.min_lr,
        lr_warmup_iters=_warmup_iters(recipe, iters),
        lr_warmup_init=_warmup_init(recipe, iters),
        lr_decay_style=recipe.lr_decay_style,
        weight_decay=recipe.weight_decay,
        adam_beta1=recipe.adam_beta1,
        adam_beta2=recipe.adam_beta2,
        clip_grad=recipe.clip_grad,
        seed=recipe.seed,
    ).validate()


def _warmup_iters(recipe: SFTRecipe, iters: int) -> int:
    """The recipe's warmup, cut to end before a shorter run's last step (megatron's schedule
    requires warmup < decay steps; the default 50 would refuse a 6-iteration smoke run)."""
    return min(recipe.lr_warmup_iters, max(iters - 1, 0))


def _warmup_init(recipe: SFTRecipe, iters: int) -> float:
    if recipe.lr_warmup_init is not None:
        return recipe.lr_warmup_init
    warmup = _warmup_iters(recipe, iters)
    return recipe.lr / warmup if warmup else 0.0


def sft_train_batch(ids: torch.Tensor, mask: torch.Tensor, images: list | None = None) -> TrainBatch:
    """Right-padded (ids, loss mask per token) -> the trainer's TrainBatch: the response starts at
    the first trained token (never token 0: it has no prediction); untrained tokens inside it (tool
    answers) get mask 0; the padding after the last trained token (EOS) is dropped. `images`: per
    row its images as data URIs (a vision-language model; ids carry the expanded image pads)."""
    trained = mask.bool()
    trained[:, 0] = False
    if not bool(trained.any(1).all()):
        raise MilesError("an SFT row has no trained token after its first")
    width = trained.shape[1]
    firsts = trained.int().argmax(1).tolist()
    lasts = (width - 1 - trained.flip(1).int().argmax(1)).tolist()
    rows, row_masks = ids.tolist(), mask.int().tolist()
    tokens = [r[: last + 1] for r, last in zip(rows, lasts, strict=True)]
    lengths = [last + 1 - first for first, last in zip(firsts, lasts, strict=True)]
    masks = [m[first : last + 1] for m, first, last in zip(row_masks, firsts, lasts, strict=True)]
    n = len(tokens)
    return TrainBatch(tokens=tokens, response_lengths=lengths, loss_masks=masks, images=images,
                      rewards=[0.0] * n, rollout_log_probs=[[] for _ in range(n)])  # fmt: skip


def train_sft(
    model, init: str, ids: torch.Tensor, mask: torch.Tensor, recipe: SFTRecipe, iters: int,
    progress: bool = False, images: list | None = None,
) -> dict:  # fmt: skip
    """SFT through the RL trainer: a `TrainerActor` on the HF dir `init` (`sft_run_config`), `iters`
    optimizer steps over the rows (`train_loop`), at `recipe.num_threads`; the trained weights are
    loaded into `model` (the HF model of `init`), left in eval mode. Returns train_loop's metrics."""
    prev_threads = torch.get_num_threads()
    try:
        actor = TrainerActor(sft_run_config(recipe, init, iters))
        torch.set_num_threads(recipe.num_threads or prev_threads)  # the actor pins its own
        metrics = train_loop(actor, ids, mask, recipe, iters, progress, images)
    finally:
        torch.set_num_threads(prev_threads)
    load_trained(model, actor.get_hf_weights())
    model.eval()
    return metrics


def load_trained(model, state: dict[str, torch.Tensor]) -> None:
    """The trainer's HF-named weights into the HF model; every parameter must come back (a tied
    lm_head is the embedding)."""
    missing, unexpected = model.load_state_dict(
        {k: v.to(torch.float32) for k, v in state.items()}, strict=False
    )
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise MilesError(
            f"SFT trainer weights do not match the model: missing {missing}, unexpected {unexpected}"
        )


def train_loop(
    actor: TrainerActor, ids: torch.Tensor, mask: torch.Tensor, recipe: SFTRecipe, iters: int, progress: bool,
    images: list | None = None,
) -> dict:  # fmt: skip
    """`iters` steps of `recipe.global_batch_size` rows drawn without replacement (reshuffled each
    epoch, seeded); `images`: per row its data URIs (or None). Returns the loss curve and timings."""
    gen = torch.Generator().manual_seed(recipe.seed)
    curve: list[tuple[int, float]] = []
    t0, cpu0 = time.perf_counter(), time.process_time()
    n_rows = ids.size(0)
    perm, pos = torch.randperm(n_rows, generator=gen), 0
    window: list[float] = []
    with Progress("sft", iters, enabled=progress) as bar:  # a line per interval: step, loss, ETA
        for step in range(iters):
            if pos + recipe.global_batch_size > n_rows:  # new epoch: reshuffle
                perm, pos = torch.randperm(n_rows, generator=gen), 0
            rows = perm[pos : pos + recipe.global_batch_size]
            pos += recipe.global_batch_size
            imgs = None if images is None else [images[i] for i in rows.tolist()]
            m = actor.train(step, sft_train_batch(ids[rows], mask[rows], imgs))
            window.append(m["train/loss"])
            if (step + 1) % recipe.log_interval == 0 or step == iters - 1:
                curve.append((step + 1, sum(window) / len(window)))
                window = []
            bar.update(loss=float(m["train/loss"]), lr=float(m["train/lr"]))
    return {
        "loss_curve": curve,
        "final_loss": curve[-1][1],
        "sft_seconds": time.perf_counter() - t0,
        "sft_cpu_seconds": time.process_time() - cpu0,  # load-independent: the machine is shared
        "train_iters": iters,
    }


# ---------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    d = default_sft_recipe()
    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="miles-platform sft", description="SFT (--loss-type sft_loss)."
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-checkpoint", help="start from this HF checkpoint dir")
    src.add_argument(
        "--from-scratch", action="store_true", help="task tokenizer + tiny Qwen3 of the default recipe"
    )
    ap.add_argument("--prompt-data", required=True,
                    help="SFT JSONL: prompt + response per row, or a messages list under --input-key (chat)")  # fmt: skip
    ap.add_argument("--tokenizer", default="arithmetic", choices=("arithmetic", "tool_use"),
                    help="--from-scratch: the task whose tokenizer the new model gets (default: %(default)s)")  # fmt: skip
    ap.add_argument("--save", required=True, help="HF checkpoint output dir")
    ap.add_argument("--loss-type", default="sft_loss", choices=("sft_loss",))
    ap.add_argument("--train-backend", default=d.train_backend, choices=("fsdp", "megatron"))
    ap.add_argument("--input-key", default="prompt")
    ap.add_argument("--response-key", default="response", help="key of the target response text")
    ap.add_argument("--multimodal-keys", default=None,
                    help='JSON {"image": KEY} (Miles\'): each row\'s images, one <image> each in the prompt; '
                         "a vision-language --hf-checkpoint")  # fmt: skip
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--lr-decay-style", default=d.lr_decay_style, choices=("constant", "linear", "cosine"))
    ap.add_argument("--lr-warmup-iters", type=int, default=d.lr_warmup_iters)
    ap.add_argument(
        "--lr-warmup-init",
        type=float,
        default=d.lr_warmup_init,
        help="the lr of step 0, rising to --lr over --lr-warmup-iters (default: lr / lr-warmup-iters)",
    )
    ap.add_argument("--min-lr", type=float, default=d.min_lr)
    ap.add_argument("--weight-decay", type=float, default=d.weight_decay)
    ap.add_argument("--clip-grad", type=float, default=d.clip_grad)
    ap.add_argument("--global-batch-size", type=int, default=d.global_batch_size)
    ap.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size)
    it = ap.add_mutually_exclusive_group()
    it.add_argument(
        "--train-iters", type=int, default=None, help=f"optimizer steps (default {d.train_iters})"
    )
    it.add_argument("--num-epoch", type=float, default=None, help="epochs over --prompt-data")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--json", action="store_true", help="print metrics as JSON")
    return ap


def cli_main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if "://" not in a.prompt_data and not os.path.exists(a.prompt_data):
        raise DataError(f"--prompt-data {a.prompt_data}: file not found")
    recipe = dataclasses.replace(
        default_sft_recipe(),
        lr=a.lr,
        lr_decay_style=a.lr_decay_style,
        lr_warmup_iters=a.lr_warmup_iters,
        lr_warmup_init=a.lr_warmup_init,
        min_lr=a.min_lr,
        weight_decay=a.weight_decay,
        clip_grad=a.clip_grad,
        global_batch_size=a.global_batch_size,
        micro_batch_size=a.micro_batch_size,
        seed=a.seed,
        train_backend=a.train_backend,
    )
    if a.num_epoch is not None:
        recipe.train_iters, recipe.num_epoch = None, a.num_epoch
    elif a.train_iters is not None:
        recipe.train_iters = a.train_iters
    from miles_platform.data.images import parse_multimodal_keys

    m = run_sft(
        a.prompt_data, a.save, a.hf_checkpoint, recipe, a.input_key, a.response_key, tokenizer=a.tokenizer,
        multimodal_keys=parse_multimodal_keys(a.multimodal_keys),
    )  # fmt: skip
    summary = {k: v for k, v in m.items() if k not in ("model", "tokenizer")}
    if a.json:
        print(json.dumps(summary))
    else:
        print(
            f"sft: {m['train_iters']} iters, {m['num_parameters']} params, final loss {m['final_loss']:.4f}, "
            f"{m['sft_seconds']:.1f}s -> {m['save']}"
        )
    return 0
