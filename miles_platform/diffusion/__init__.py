"""Diffusion RL (Miles-diffusion): a tiny DiT text-to-image task, an engine that records denoising
trajectories, Flow-GRPO and DiffusionNFT on the same store, loop shape and Dagster assets as LLM runs."""
