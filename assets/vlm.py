"""Vision-language assets: the image counting task and the tiny Qwen3-VL base (docs/vlm.md).

    vlm_prompt_dataset    train prompts (Parquet: prompt, label, PNG images), thumbnails in its preview
    vlm_eval_dataset      held-out layouts (Parquet, the same columns)
    vlm_base_checkpoint   the tiny Qwen3-VL after SFT that counts 4 squares as 3 (training/vlm_base.py)

RL runs of `rl_training` with `multimodal_keys` then report `rollout_shards` / `policy_versions`
like any LLM run; their shards name each sample's image by content hash.
"""

import dagster as dg

from assets.diffusion import _file_hash
from assets.metadata import image_markdown
from resources.storage import StorageRootResource


class VLMDataConfig(dg.Config):
    seed: int = 0  # task seed: layouts held out, colours
    train_size: int = 512
    eval_size: int = 64


class VLMBaseConfig(dg.Config):
    seed: int = 0  # SFT seed (model init, row order, which 4-square rows are mislabelled)
    train_iters: int | None = None  # SFT optimizer steps (default: the recipe's)


def _preview(path: str) -> dict:
    import pyarrow.parquet as pq

    from miles_platform.data.images import thumbnail_grid

    rows = pq.read_table(path).to_pylist()
    first = rows[:16]
    labels = " ".join(r["label"] for r in first)
    return {"path": dg.MetadataValue.path(path), "rows": len(rows),
            "thumbnails": image_markdown(thumbnail_grid([r["images"][0] for r in first]),
                                         f"first {len(first)} images; labels: {labels}")}  # fmt: skip


@dg.multi_asset(
    specs=[
        dg.AssetSpec(
            "vlm_prompt_dataset", group_name="vlm", description="train prompts with images (Parquet)"
        ),
        dg.AssetSpec("vlm_eval_dataset", group_name="vlm", description="held-out image layouts (Parquet)"),
    ],  # fmt: skip
    description="The built-in image counting task (miles_platform/data/image_tasks.py, make-data count_shapes).",
)
def vlm_datasets(context: dg.AssetExecutionContext, config: VLMDataConfig, storage: StorageRootResource):
    from miles_platform.data.image_tasks import write_count_datasets

    out_dir = storage.paths.join("datasets", "vlm")
    paths = write_count_datasets(
        out_dir, seed=config.seed, eval_size=config.eval_size, train_size=config.train_size
    )
    for key, name in (("vlm_prompt_dataset", "train"), ("vlm_eval_dataset", "eval")):
        yield dg.MaterializeResult(asset_key=key, metadata=_preview(paths[name]),
                                   data_version=dg.DataVersion(_file_hash(paths[name])))  # fmt: skip


@dg.asset(
    group_name="vlm",
    deps=["vlm_eval_dataset"],
    description="Tiny Qwen3-VL after SFT on counting rows where most 4-square images say 3.",
)
def vlm_base_checkpoint(
    context: dg.AssetExecutionContext, config: VLMBaseConfig, storage: StorageRootResource
) -> dg.MaterializeResult:
    import dataclasses
    import os

    from miles_platform.models.checkpoint import content_hash
    from miles_platform.training.vlm_base import VLMBaseRecipe, greedy_count_accuracy, run_vlm_sft

    recipe = VLMBaseRecipe(seed=config.seed)
    if config.train_iters:
        recipe.sft = dataclasses.replace(recipe.sft, train_iters=config.train_iters)
    out = storage.paths.model("vlm_base")
    m = run_vlm_sft(out, recipe)
    acc = greedy_count_accuracy(out, os.path.join(storage.paths.join("datasets", "vlm"), "eval.parquet"))
    context.log.info(f"vlm base: held-out greedy {acc['acc']:.1%}, per count {acc['per_count']}")
    md = {"path": dg.MetadataValue.path(out), "final_loss": float(m["final_loss"]),
          "sft_seconds": float(m["sft_seconds"]), "sft_cpu_seconds": float(m["sft_cpu_seconds"]),
          "eval/pass@1": float(acc["acc"]),
          **{f"eval/pass@1/count={k}": float(v) for k, v in acc["per_count"].items()}}  # fmt: skip
    return dg.MaterializeResult(metadata=md, data_version=dg.DataVersion(content_hash(out)))
