"""Llama 3.x <-> megatron-core GPTModel: no biases, no q/k norm; rope_type llama3 (3.1-3.3) maps to
GPTModel's `rope_scaling` / `rope_scaling_factor` (models/bridge/dense.py checks the fixed
factors). attention_bias / mlp_bias checkpoints are refused by name."""

from __future__ import annotations

from miles_platform.models.bridge.base import register_bridge
from miles_platform.models.bridge.dense import DenseBridge


@register_bridge("LlamaForCausalLM")
class LlamaBridge(DenseBridge):
    family = "Llama"
