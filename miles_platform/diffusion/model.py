"""The tiny DiT family: diffusers' SD3Transformer2DModel in pixel space (no VAE) on the coloured-square
task (diffusion/task.py), a frozen word-table "text encoder", a flow-matching SFT base.

Flow matching, SD3 convention: x_sigma = (1 - sigma) * x0 + sigma * eps, the model predicts
v = eps - x0 at timestep sigma * 1000, and an Euler step is x <- x + (sigma_next - sigma) * v.

Pipeline dir (diffusers-like):
  model_index.json                     _class_name MilesTinyDiTPipeline, task t2i, family tiny_dit
  transformer/                         SD3Transformer2DModel.save_pretrained (safetensors)
  text_encoder/config.json, model.safetensors
  scheduler/scheduler_config.json      FlowMatchEulerDiscreteScheduler with the pipeline's shift
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from miles_platform.diffusion import task
from miles_platform.errors import CheckpointError
from miles_platform.store.atomic import fsync_tree, replace_dir

PIPELINE_CLASS = "MilesTinyDiTPipeline"
FAMILY = "tiny_dit"
NUM_TRAIN_TIMESTEPS = 1000  # SD3: timestep = sigma * 1000
DEFAULT_FLOW_SHIFT = 1.0
TEXT_DIM = 32
# the files a loadable pipeline dir has, relative to it
PIPELINE_FILES = (
    "model_index.json",
    "transformer/config.json",
    "transformer/diffusion_pytorch_model.safetensors",
    "text_encoder/config.json",
    "text_encoder/model.safetensors",
    "scheduler/scheduler_config.json",
)


class PromptEncoder(nn.Module):
    """Frozen "text encoder": each prompt becomes its attribute words [colour, row, column], looked up
    in a seeded random table. The table is a buffer (never trained) and is saved with the pipeline."""

    def __init__(self, dim: int = TEXT_DIM, seed: int = 0, vocab: list[str] | None = None):
        super().__init__()
        self.vocab = list(vocab or [*task.COLOURS, *task.ROWS, *task.COLUMNS])
        self.index = {w: i for i, w in enumerate(self.vocab)}
        self.dim, self.seed = dim, seed
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("table", torch.randn(len(self.vocab), dim, generator=g))

    @property
    def seq_len(self) -> int:
        return 3

    @property
    def pooled_dim(self) -> int:
        return self.seq_len * self.dim

    def token_ids(self, prompts: list[str]) -> torch.Tensor:
        rows = []
        for p in prompts:
            attrs = task.parse_prompt(p)
            row, column = attrs["position"].split()
            rows.append([self.index[attrs["colour"]], self.index[row], self.index[column]])
        return torch.tensor(rows, dtype=torch.long, device=self.table.device)

    def forward(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(encoder_hidden_states [B, 3, dim], pooled [B, 3 * dim]): pooled is the words concatenated,
        so the adaLN conditioning alone already tells colour and quadrant apart."""
        hidden = self.table[self.token_ids(prompts)]
        return hidden, hidden.flatten(1)

    def config(self) -> dict:
        return {"_class_name": "PromptEncoder", "dim": self.dim, "seed": self.seed, "vocab": self.vocab}


def build_tiny_dit(seed: int, text_encoder: PromptEncoder | None = None):
    """SD3Transformer2DModel sized for CPU: 16x16x3 pixels, patch 2 (64 tokens), 2 joint blocks of
    width 64 (2 heads x 32), 0.29M parameters. Measured on 2 cores: 2 layers learn the task in ~1k
    steps at ~47 ms/step (batch 32); 4 layers take 2.4x per step, patch 4 learns slower per step."""
    from diffusers.models import SD3Transformer2DModel

    enc = text_encoder or PromptEncoder()
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(seed)
        return SD3Transformer2DModel(
            sample_size=task.IMAGE_SIZE,
            patch_size=2,
            in_channels=3,
            out_channels=3,
            num_layers=2,
            attention_head_dim=32,
            num_attention_heads=2,
            joint_attention_dim=enc.dim,
            caption_projection_dim=64,
            pooled_projection_dim=enc.pooled_dim,
            pos_embed_max_size=task.IMAGE_SIZE // 2,
        )


@dataclass
class DiTPipeline:
    transformer: nn.Module  # SD3Transformer2DModel
    text_encoder: PromptEncoder
    flow_shift: float = DEFAULT_FLOW_SHIFT


def _scheduler(shift: float):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=NUM_TRAIN_TIMESTEPS, shift=shift)


def save_pipeline(pipe: DiTPipeline, path: str | os.PathLike) -> str:
    """Write the pipeline dir atomically: built in a temp dir beside `path`, fsynced, renamed."""
    from safetensors.torch import save_file

    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        pipe.transformer.save_pretrained(tmp / "transformer", safe_serialization=True)
        (tmp / "text_encoder").mkdir()
        (tmp / "text_encoder" / "config.json").write_text(json.dumps(pipe.text_encoder.config(), indent=2))
        tensors = {k: v.detach().cpu().contiguous() for k, v in pipe.text_encoder.state_dict().items()}
        save_file(tensors, str(tmp / "text_encoder" / "model.safetensors"))
        _scheduler(pipe.flow_shift).save_config(tmp / "scheduler")
        index = {
            "_class_name": PIPELINE_CLASS,
            "_diffusers_version": _diffusers_version(),
            "task": "t2i",
            "family": FAMILY,
            "image_size": task.IMAGE_SIZE,
            "flow_shift": pipe.flow_shift,
            "transformer": ["diffusers", "SD3Transformer2DModel"],
            "text_encoder": ["miles_platform.diffusion.model", "PromptEncoder"],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        }
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2))  # last: the marker
        fsync_tree(tmp)
        replace_dir(tmp, dest)
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


def load_pipeline(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> DiTPipeline:
    """Load a pipeline dir written by `save_pipeline`; CheckpointError names the path and what is wrong."""
    from diffusers.models import SD3Transformer2DModel
    from safetensors.torch import load_file

    root = Path(path)
    missing = [f for f in PIPELINE_FILES if not (root / f).is_file()]
    if missing:
        raise CheckpointError(
            f"{root}: not a complete {PIPELINE_CLASS} dir, missing {', '.join(missing)} (write it with save_pipeline)"
        )
    try:
        index = json.loads((root / "model_index.json").read_text())
        enc_cfg = json.loads((root / "text_encoder" / "config.json").read_text())
        sched_cfg = json.loads((root / "scheduler" / "scheduler_config.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{root}: malformed JSON in the pipeline dir ({e.msg})") from None
    if index.get("_class_name") != PIPELINE_CLASS:
        raise CheckpointError(
            f"{root / 'model_index.json'}: _class_name {index.get('_class_name')!r}, expected {PIPELINE_CLASS!r}"
        )
    enc = PromptEncoder(dim=int(enc_cfg["dim"]), seed=int(enc_cfg["seed"]), vocab=list(enc_cfg["vocab"]))
    try:
        enc.load_state_dict(load_file(str(root / "text_encoder" / "model.safetensors")))
        transformer = SD3Transformer2DModel.from_pretrained(str(root / "transformer"), torch_dtype=dtype)
    except Exception as e:  # safetensors/diffusers raise many types; the user needs the path
        raise CheckpointError(f"{root}: cannot load the pipeline weights: {type(e).__name__}: {e}") from None
    transformer.eval()
    return DiTPipeline(transformer, enc.to(dtype), float(sched_cfg.get("shift", DEFAULT_FLOW_SHIFT)))


def velocity(
    transformer: nn.Module,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    cond: torch.Tensor,
    pooled: torch.Tensor,
) -> torch.Tensor:
    """v = eps - x0 predicted at noise level `sigma` [B] (SD3: timestep = sigma * 1000)."""
    timestep = sigma.to(latents.dtype).expand(latents.shape[0]) * NUM_TRAIN_TIMESTEPS
    return transformer(
        hidden_states=latents,
        encoder_hidden_states=cond.to(latents.dtype),
        pooled_projections=pooled.to(latents.dtype),
        timestep=timestep,
        return_dict=False,
    )[0]


def sigma_schedule(num_steps: int, shift: float) -> torch.Tensor:
    """[num_steps + 1] float32 from 1 down to 0: diffusers' FlowMatchEulerDiscreteScheduler sigmas."""
    sched = _scheduler(shift)
    sched.set_timesteps(num_steps)
    return sched.sigmas.to(torch.float32).cpu()


@torch.no_grad()
def sample_ode(
    pipe: DiTPipeline, prompts: list[str], seed: int, num_steps: int = 10, noise: torch.Tensor | None = None
) -> torch.Tensor:
    """Deterministic Euler ODE samples [B, 3, 16, 16] in [-1, 1]; row i's noise comes from `seed`."""
    param = next(pipe.transformer.parameters())
    if noise is None:
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn(len(prompts), 3, task.IMAGE_SIZE, task.IMAGE_SIZE, generator=g)
    x = noise.to(param.device, param.dtype)
    cond, pooled = pipe.text_encoder(prompts)
    sigmas = sigma_schedule(num_steps, pipe.flow_shift).to(param.device)
    for i in range(num_steps):
        v = velocity(pipe.transformer, x, sigmas[i], cond, pooled)
        x = x + (sigmas[i + 1] - sigmas[i]).to(x.dtype) * v
    return x.clamp(-1.0, 1.0).float()


def _train_sigmas(n: int, shift: float, g: torch.Generator) -> torch.Tensor:
    """Logit-normal sigma (SD3's training density), shifted like the sampling schedule."""
    s = torch.sigmoid(torch.randn(n, generator=g))
    return shift * s / (1 + (shift - 1) * s)


def train_sft_base(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    steps: int = 1200,
    batch_size: int = 32,
    lr: float = 2e-3,
    n_sft: int = task.DEFAULT_N_SFT,
    error_rate: float = task.DEFAULT_ERROR_RATE,
    flow_shift: float = DEFAULT_FLOW_SHIFT,
    eval_samples_per_prompt: int = 16,
    log: Callable[[str], None] = print,
    sft_data: str | os.PathLike | None = None,
    eval_data: str | os.PathLike | None = None,
    error: str = task.DEFAULT_ERROR,
) -> dict:
    """Flow-matching SFT of a fresh tiny DiT on `sft_examples(n_sft, seed, error_rate)`; save the
    pipeline to `out_dir`; return steps, seconds, final_loss and base_eval_reward (ODE, 10 steps,
    the held-out prompts x `eval_samples_per_prompt` noises, fixed seed)."""
    t0 = time.perf_counter()
    enc = PromptEncoder(seed=seed)
    transformer = build_tiny_dit(seed, enc)
    if sft_data is not None:  # the diffusion_sft_dataset asset's file (its lineage), else generated
        prompts, images = task.read_sft_parquet(sft_data)
    else:
        prompts, images = task.sft_examples(n_sft, seed, error_rate, error)
    x_all = torch.from_numpy(np.ascontiguousarray(images))
    with torch.no_grad():
        cond_all, pooled_all = enc(prompts)
    opt = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    # short warmup, then cosine to 10%: the tiny model converges in ~1k steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda i: min(1.0, (i + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(i, steps) / steps))),
    )
    g = torch.Generator().manual_seed(seed + 17)
    transformer.train()
    ema_loss = None
    for step in range(steps):
        idx = torch.randint(0, len(prompts), (batch_size,), generator=g)
        x0 = x_all[idx]
        eps = torch.randn(x0.shape, generator=g)
        sigma = _train_sigmas(batch_size, flow_shift, g)
        s = sigma[:, None, None, None]
        v = velocity(transformer, (1 - s) * x0 + s * eps, sigma, cond_all[idx], pooled_all[idx])
        loss = torch.nn.functional.mse_loss(v, eps - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        sched.step()
        ema_loss = loss.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * loss.item()
        if step % 200 == 0 or step == steps - 1:
            log(f"sft step {step}/{steps} loss {ema_loss:.4f} ({time.perf_counter() - t0:.0f}s)")
    transformer.eval()
    pipe = DiTPipeline(transformer, enc, flow_shift)
    held_out = task.eval_prompts() if eval_data is None else _jsonl_prompts(eval_data)
    eval_prompts = [p for p in dict.fromkeys(held_out) for _ in range(eval_samples_per_prompt)]
    samples = sample_ode(pipe, eval_prompts, seed + 1000)
    base_eval = float(task.attribute_rewards(eval_prompts, samples).mean())
    seconds = time.perf_counter() - t0
    save_pipeline(pipe, out_dir)
    log(
        f"sft base: {steps} steps in {seconds:.0f}s, loss {ema_loss:.4f}, held-out ODE reward {base_eval:.3f}"
    )
    grid = task.image_grid(samples[:: max(1, len(samples) // 32)][:32], nrow=8)
    return {"steps": steps, "seconds": seconds, "final_loss": ema_loss, "base_eval_reward": base_eval,
            "samples_png": grid}  # fmt: skip


def _jsonl_prompts(path: str | os.PathLike) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]
