"""HF <-> Megatron-core weight bridges, one file per HF architecture.

A bridge maps HF parameter names and layouts to megatron-core's GPTModel (fused QKV grouped
per query group, fused gate/up, layer norms fused into the next linear under the TE spec) and
back, and derives megatron's TransformerConfig from the HF config. Supporting a new
architecture is a new module in this package that decorates its class with
`@register_bridge("<HF architecture>")`; modules are discovered, so nothing else changes.
"""

from miles_platform.models.bridge.base import (
    Bridge,
    get_bridge,
    hf_config_dict,
    register_bridge,
    supported_architectures,
)

__all__ = ["Bridge", "get_bridge", "hf_config_dict", "register_bridge", "supported_architectures"]
