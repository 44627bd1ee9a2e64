"""Multi-latent attention (DeepSeek-V3, models/bridge/deepseek_v3.py) on megatron's local layer spec.

megatron-core 0.16's MLA builds its core attention with `k_channels` (nope + rope head dim) and
`v_channels` (v head dim), which transformer-engine's attention takes and the local spec's
`DotProductAttention` does not (TypeError). Its arithmetic already handles keys wider than values
(scores over the key width, context over the value width, `kv_channels` x heads wide: the bridge
sets `kv_channels` to the value head dim), and MLA hands it its softmax scale (1 / sqrt(q head dim),
times yarn's mscale squared); so `MLADotProductAttention` is DotProductAttention taking the two
widths and checking them against that.
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention


class MLADotProductAttention(DotProductAttention):
    """megatron's local DotProductAttention, built by MLA (`k_channels` / `v_channels`)."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None and v_channels != self.config.kv_channels:
            raise ValueError(
                f"MLA core attention: v_channels {v_channels} != kv_channels {self.config.kv_channels} "
                "(the bridge sets kv_channels to v_head_dim: the context is heads x v_head_dim wide)"
            )
        self.k_channels = k_channels
