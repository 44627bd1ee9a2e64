"""Diffusion assets: the text-to-image task's prompts, its SFT images, and the tiny DiT base.

    diffusion_prompt_dataset   train prompts (JSONL: prompt + attribute label)
    diffusion_eval_dataset     held-out prompts (attribute combinations the train split never shows)
    diffusion_sft_dataset      SFT images (Parquet: prompt + PNG), wrong in a systematic way
    diffusion_base_checkpoint  the tiny DiT pipeline after flow-matching SFT on them

RL runs of `diffusion_training` then report `rollout_shards` / `policy_versions` / `eval_results`
partitions like LLM runs. Every materialization carries the numbers and, where there are images,
a sample grid the asset page shows inline.
"""

import os

import dagster as dg

from assets.metadata import image_markdown
from resources.storage import StorageRootResource


class DiffusionDataConfig(dg.Config):
    seed: int = 0  # task seed: which images the SFT split draws (prompt splits are fixed)


class DiffusionBaseConfig(dg.Config):
    seed: int = 0  # SFT seed (DiT init, noise)
    steps: int | None = None  # SFT optimizer steps (default: the recipe's)


def _file_hash(path: str) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _count_lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for line in f if line.strip())


@dg.multi_asset(
    specs=[
        dg.AssetSpec("diffusion_prompt_dataset", group_name="diffusion", description="train prompts (JSONL)"),
        dg.AssetSpec(
            "diffusion_eval_dataset", group_name="diffusion", description="held-out prompts (JSONL)"
        ),
        dg.AssetSpec(
            "diffusion_sft_dataset",
            group_name="diffusion",
            description="SFT images (Parquet: prompt + PNG), systematically wrong in part",
        ),
    ],  # fmt: skip
    description="The built-in text-to-image attribute task (miles_platform/diffusion/task.py).",
)
def diffusion_datasets(
    context: dg.AssetExecutionContext, config: DiffusionDataConfig, storage: StorageRootResource
):
    from miles_platform.diffusion.task import write_diffusion_data

    out_dir = storage.paths.join("datasets", "diffusion")
    paths = write_diffusion_data(out_dir, seed=config.seed)
    for key, name in (("diffusion_prompt_dataset", "train"), ("diffusion_eval_dataset", "eval")):
        p = paths[name]
        yield dg.MaterializeResult(asset_key=key, metadata={"path": dg.MetadataValue.path(p), "rows": _count_lines(p)},
                                   data_version=dg.DataVersion(_file_hash(p)))  # fmt: skip
    yield _sft_result(paths["sft"])


def _sft_result(path: str) -> dg.MaterializeResult:
    import numpy as np
    import pyarrow.parquet as pq

    from miles_platform.diffusion.task import from_png, image_grid

    table = pq.read_table(path)
    images = np.stack([from_png(b) for b in table.column("image_png").to_pylist()[:32]])
    return dg.MaterializeResult(
        asset_key="diffusion_sft_dataset",
        metadata={"path": dg.MetadataValue.path(path), "rows": table.num_rows,
                  "samples": image_markdown(image_grid(images, nrow=8), "first 32 SFT images")},
        data_version=dg.DataVersion(_file_hash(path)),
    )  # fmt: skip


@dg.asset(
    group_name="diffusion",
    deps=["diffusion_sft_dataset", "diffusion_eval_dataset"],
    description="Tiny DiT (diffusers SD3Transformer2DModel, pixel space) after flow-matching SFT.",
)
def diffusion_base_checkpoint(
    context: dg.AssetExecutionContext, config: DiffusionBaseConfig, storage: StorageRootResource
) -> dg.MaterializeResult:
    from miles_platform.diffusion.model import train_sft_base
    from miles_platform.models.checkpoint import content_hash

    data_dir = storage.paths.join("datasets", "diffusion")
    out = storage.paths.model("diffusion_base")
    kwargs = {"steps": config.steps} if config.steps else {}
    info = train_sft_base(out, seed=config.seed, sft_data=os.path.join(data_dir, "sft.parquet"),
                          eval_data=os.path.join(data_dir, "eval.jsonl"), log=context.log.info, **kwargs)  # fmt: skip
    md = {"path": dg.MetadataValue.path(out), **{k: v for k, v in info.items() if isinstance(v, int | float)}}
    if info.get("samples_png"):
        md["samples"] = image_markdown(
            info["samples_png"], "base samples on held-out prompts (ODE, fixed seeds)"
        )
    return dg.MaterializeResult(metadata=md, data_version=dg.DataVersion(content_hash(out)))
