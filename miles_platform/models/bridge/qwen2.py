"""Qwen2 / Qwen2.5 <-> megatron-core GPTModel: q/k/v biases (megatron `add_qkv_bias`, the bias
grouped per query group like linear_qkv's rows), no o_proj bias, no q/k norm. The name map is
models/bridge/dense.py's."""

from __future__ import annotations

from typing import Any

from miles_platform.errors import CheckpointError
from miles_platform.models.bridge.base import register_bridge
from miles_platform.models.bridge.dense import DenseBridge


@register_bridge("Qwen2ForCausalLM")
class Qwen2Bridge(DenseBridge):
    family = "Qwen2"

    def qkv_bias(self, c: dict[str, Any]) -> bool:
        if c.get("use_sliding_window"):
            raise CheckpointError(
                "Qwen2 config: use_sliding_window = true has no megatron mapping here (Qwen2.5 ships it "
                "false); use --train-backend fsdp for this checkpoint"
            )
        return True  # Qwen2Attention: q/k/v_proj always have biases
