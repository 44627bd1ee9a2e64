"""GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`) <-> megatron-core GPTModel: DeepSeek-V3's mapping as it is.

transformers' GLM-4.7-Flash attention (MLA with `rope_interleave`), top-k router (sigmoid, the
score-correction bias, group-limited top-2 group scores, `routed_scaling_factor`), MoE block (routed
plus shared experts) and model are DeepSeek-V3's classes renamed, line for line (transformers 5.24);
its config has the same fields, but names each layer "dense" or "sparse" in `mlp_layer_types`
instead of `first_k_dense_replace`, which `DeepseekDims` reads into megatron's `moe_layer_freq`. The
name map, the rope layout, the routing fields and the refusals: models/bridge/deepseek_v3.py. (Its
default rope takes a `partial_rotary_factor`, DeepSeek's does not: refused there, below 1.)
"""

from __future__ import annotations

from miles_platform.models.bridge.base import register_bridge
from miles_platform.models.bridge.deepseek_v3 import DeepseekV3Bridge


@register_bridge("Glm4MoeLiteForCausalLM")
class Glm4MoeLiteBridge(DeepseekV3Bridge):
    family = "GLM-4.7-Flash"
