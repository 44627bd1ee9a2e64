"""The gloo-rank tests' fork-server preload (last in loop_helpers.SPAWN_PRELOAD): what building a
TrainerActor imports lazily, ~1.3 CPU-seconds in every rank otherwise (transformers' auto classes and
model code, megatron-core's GPT model and layer specs, the HF <-> megatron bridges, FSDP2)."""

# ruff: noqa: F401
import gc

import megatron.core.dist_checkpointing.strategies.filesystem_async
import megatron.core.models.gpt.gpt_layer_specs
import megatron.core.models.gpt.gpt_model
import torch.distributed._composable.fsdp
import transformers.models.qwen3.modeling_qwen3
import transformers.models.qwen3_moe.modeling_qwen3_moe
from transformers import AutoConfig, AutoModelForCausalLM  # resolves the lazy auto classes

import miles_platform.models.bridge.llama
import miles_platform.models.bridge.qwen2
import miles_platform.models.bridge.qwen3
import miles_platform.models.bridge.qwen3_moe
import miles_platform.models.checkpoint
import miles_platform.models.checkpoint_layout
import miles_platform.training.megatron_parallel

# the ranks' first collections do not touch (copy) the preloaded objects (cluster/forkserver.py)
gc.collect()
gc.freeze()
