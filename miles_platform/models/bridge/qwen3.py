"""Qwen3 (dense) <-> megatron-core GPTModel: per-head q/k RMSNorm (megatron `qk_layernorm`), no
biases. The name map is models/bridge/dense.py's."""

from __future__ import annotations

from miles_platform.models.bridge.base import register_bridge
from miles_platform.models.bridge.dense import DenseBridge


@register_bridge("Qwen3ForCausalLM")
class Qwen3Bridge(DenseBridge):
    family = "Qwen3"
    qk_norm = True
