"""What a gloo rank imports to build a TrainerActor or convert a checkpoint, for a fork server to
import once before it forks ranks (`multiprocessing.set_forkserver_preload([__name__])`): torch,
transformers' auto classes and model code, megatron-core's GPT model and layer specs, the
HF <-> megatron bridges, FSDP2 (~1.3 CPU-seconds a rank otherwise, most of it lazy imports in the
actor build). weights/conversion.py forks its ranks 1.. from such a server; the gloo-rank tests do too.
A module of the package because the server is a fresh interpreter that does not get its parent's
sys.path (Python 3.11) and skips, without a word, a preload it cannot import."""

# ruff: noqa: F401
import gc

import megatron.core.dist_checkpointing.strategies.filesystem_async
import megatron.core.models.gpt.gpt_layer_specs
import megatron.core.models.gpt.gpt_model
import torch.distributed._composable.fsdp
import transformers.models.qwen3.modeling_qwen3
import transformers.models.qwen3_moe.modeling_qwen3_moe
from transformers import AutoConfig, AutoModelForCausalLM  # resolves the lazy auto classes

import miles_platform.models.bridge.deepseek_v3
import miles_platform.models.bridge.llama
import miles_platform.models.bridge.qwen2
import miles_platform.models.bridge.qwen3
import miles_platform.models.bridge.qwen3_moe
import miles_platform.models.checkpoint
import miles_platform.models.checkpoint_layout
import miles_platform.training.actor
import miles_platform.training.fsdp_backend
import miles_platform.training.megatron_backend
import miles_platform.training.megatron_parallel
from miles_platform.cluster.forkserver import warm_caches

warm_caches()  # the caches each rank's first `from_pretrained` fills (transformers' key conversions)

# the ranks' first collections do not touch (copy) the preloaded objects (cluster/forkserver.py)
gc.collect()
gc.freeze()
