"""Named asset jobs for the campaign's steps, so each appears under its own name in the UI's Runs
(not `__ephemeral_asset_job__`) and can be re-executed from there. The quickstart launches these;
the eval / publication / health / scoreboard jobs live beside their sensors."""

import dagster as dg

from assets.partitions import quantized_partitions

build_datasets = dg.define_asset_job(
    "build_datasets",
    selection=["prompt_dataset", "eval_dataset"],
    description="The task's prompt and eval datasets (normalized Parquet + content hash).",
)
build_base_checkpoint = dg.define_asset_job(
    "build_base_checkpoint",
    selection=["base_checkpoint"],
    description="The starting policy: the demo's SFT base, or a registered existing HF checkpoint.",
)
convert_checkpoint = dg.define_asset_job(
    "convert_checkpoint",
    selection=["converted_checkpoint"],
    description="HF -> megatron torch_dist of the base checkpoint, with the round-trip check.",
)
quantize_weights = dg.define_asset_job(
    "quantize_weights",
    selection=["quantized_weights"],
    partitions_def=quantized_partitions,
    description="fp8 / int4 weights of a policy version, checked and evaluated against full precision.",
)
build_diffusion_data = dg.define_asset_job(
    "build_diffusion_data",
    selection=["diffusion_prompt_dataset", "diffusion_eval_dataset", "diffusion_sft_dataset"],
    description="The diffusion task's prompt, held-out eval and SFT image datasets.",
)
build_diffusion_base = dg.define_asset_job(
    "build_diffusion_base",
    selection=["diffusion_base_checkpoint"],
    description="The tiny DiT's flow-matching SFT base.",
)

build_vlm_data = dg.define_asset_job(
    "build_vlm_data",
    selection=["vlm_prompt_dataset", "vlm_eval_dataset"],
    description="The image counting task's train and held-out datasets (Parquet with PNG images).",
)
build_vlm_base = dg.define_asset_job(
    "build_vlm_base",
    selection=["vlm_base_checkpoint"],
    description="The tiny Qwen3-VL's SFT base (counts 4 squares as 3).",
)

ASSET_JOBS = [build_datasets, build_base_checkpoint, convert_checkpoint, quantize_weights,
              build_diffusion_data, build_diffusion_base, build_vlm_data, build_vlm_base]  # fmt: skip
