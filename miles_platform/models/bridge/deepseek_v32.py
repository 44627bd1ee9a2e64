"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) <-> megatron-core GPTModel: DeepSeek-V3's mapping plus the
DSA indexer, on megatron-core's DSAttention (training/megatron_dsa.py says how it runs).

transformers' V3.2 is V3's MLA and MoE (models/bridge/deepseek_v3.py: names, routing, refusals) with a
query latent always (`q_a_proj`), DeepSeek's interleaved rope in the attention whatever
`rope_interleave` says, dense layers named by `mlp_layer_types`, and a lightning indexer per layer:

HF (module names)                          megatron
model.layers.i.self_attn.indexer.wq_b      decoder.layers.i.self_attention.core_attention.indexer.linear_wq_b
model.layers.i.self_attn.indexer.wk        ...core_attention.indexer.linear_wk
model.layers.i.self_attn.indexer.k_norm    ...core_attention.indexer.k_norm (weight and bias: a LayerNorm)
model.layers.i.self_attn.indexer.weights_proj  ...core_attention.indexer.linear_weights_proj

Row order of an indexer head (wq_b per head, wk, k_norm): HF puts the rope dims first and rotates them
as halves (pairs j, j + r/2: transformers' indexer, unlike its attention, is not interleaved);
megatron's indexer puts them last and, being MLA, reads them as interleaved pairs (2j, 2j + 1). Megatron
row j of a head is HF row `indexer_row_order(...)[j]`: the non-rope rows, then the rope rows as
[0, r/2, 1, r/2 + 1, ...]. The q . k products, the LayerNorm and the top-k are then the same.
`q_a_layernorm` is `q_layernorm` on both specs (the indexer reads the normed latent:
training/megatron_dsa.py).

Refused by name: a config without `q_lora_rank`, `index_head_dim` not above the rope dim or with an odd
rope dim, context parallelism (megatron-core's DSAttention asserts it) and what V3's mapping refuses.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_platform.models.bridge.base import hf_config_dict, register_bridge
from miles_platform.models.bridge.deepseek_v3 import DeepseekDims, DeepseekV3Bridge, permute_head_rows
from miles_platform.models.bridge.dense import take


class DeepseekV32Dims(DeepseekDims):
    def __init__(self, hf_config: Any, family: str = "DeepSeek-V3.2"):
        c = dict(hf_config_dict(hf_config))
        c["rope_interleave"] = True  # transformers' V3.2 attention always interleaves (no such field)
        super().__init__(c, family)
        if self.q_lora is None:
            raise self.refuse("q_lora_rank null (the indexer reads the query latent)")
        self.index_heads, self.index_dim = int(c["index_n_heads"]), int(c["index_head_dim"])
        self.index_topk = int(c["index_topk"])
        if self.index_dim <= self.rope or self.rope % 2:
            raise self.refuse(f"index_head_dim {self.index_dim} with qk_rope_head_dim {self.rope}")


def indexer_row_order(d: DeepseekV32Dims) -> torch.Tensor:
    """Megatron row j of an indexer head is HF row order[j] (the module docstring)."""
    half = torch.arange(d.rope // 2)
    rope = torch.stack([half, half + d.rope // 2], dim=1).reshape(-1)
    return torch.cat([torch.arange(d.rope, d.index_dim), rope])


@register_bridge("DeepseekV32ForCausalLM")
class DeepseekV32Bridge(DeepseekV3Bridge):
    family = "DeepSeek-V3.2"
    te_fuses_q_norm = False  # the indexer reads the normed query latent: the norm stays apart on TE too

    def dims(self, hf_config: Any) -> DeepseekV32Dims:
        return DeepseekV32Dims(hf_config, self.family)

    def transformer_config(self, hf_config: Any) -> dict[str, Any]:
        d = self.dims(hf_config)
        return dict(
            super().transformer_config(hf_config), experimental_attention_variant="dsa",
            dsa_indexer_n_heads=d.index_heads, dsa_indexer_head_dim=d.index_dim, dsa_indexer_topk=d.index_topk,
            dsa_indexer_loss_coeff=0.0,
        )  # fmt: skip

    def layout_refusal(self, hf_config: dict[str, Any], layout: Any, *, step: bool = True) -> str | None:
        if layout.cp > 1:
            return (
                f"--context-parallel-size {layout.cp} with DeepSeek sparse attention: megatron-core's DSAttention "
                "takes no context parallelism"
            )
        return super().layout_refusal(hf_config, layout, step=step)

    def adapt_layer_spec(self, spec: Any, use_te: bool) -> Any:
        from miles_platform.training.megatron_dsa import dsa_layer_spec

        return dsa_layer_spec(super().adapt_layer_spec(spec, use_te), use_te)

    def _layer_to_megatron(self, hf_sd, get, d, i: int, fused: bool) -> dict[str, torch.Tensor]:
        out = super()._layer_to_megatron(hf_sd, get, d, i, fused)
        sa = f"decoder.layers.{i}.self_attention."
        a, ix = f"model.layers.{i}.self_attn.indexer.", sa + "core_attention.indexer."
        order, H, D = indexer_row_order(d), d.hidden, d.index_dim
        out[ix + "linear_wq_b.weight"] = permute_head_rows(
            get(a + "wq_b.weight", (d.index_heads * D, d.q_lora)), order, d.index_heads
        )
        out[ix + "linear_wk.weight"] = permute_head_rows(get(a + "wk.weight", (D, H)), order, 1)
        out[ix + "k_norm.weight"] = permute_head_rows(get(a + "k_norm.weight", (D,)), order, 1)
        out[ix + "k_norm.bias"] = permute_head_rows(get(a + "k_norm.bias", (D,)), order, 1)
        out[ix + "linear_weights_proj.weight"] = get(a + "weights_proj.weight", (d.index_heads, H))
        return out

    def _layer_to_hf(self, mcore_sd, get, d, i: int) -> dict[str, torch.Tensor]:
        out = super()._layer_to_hf(mcore_sd, get, d, i)
        a, ix = (
            f"model.layers.{i}.self_attn.indexer.",
            f"decoder.layers.{i}.self_attention.core_attention.indexer.",
        )
        inverse, H, D = torch.argsort(indexer_row_order(d)), d.hidden, d.index_dim

        def mc(name, shape):
            return take(mcore_sd, ix + name, shape, "megatron state")

        out[a + "wq_b.weight"] = permute_head_rows(
            mc("linear_wq_b.weight", (d.index_heads * D, d.q_lora)), inverse, d.index_heads
        )
        out[a + "wk.weight"] = permute_head_rows(mc("linear_wk.weight", (D, H)), inverse, 1)
        out[a + "k_norm.weight"] = permute_head_rows(mc("k_norm.weight", (D,)), inverse, 1)
        out[a + "k_norm.bias"] = permute_head_rows(mc("k_norm.bias", (D,)), inverse, 1)
        out[a + "weights_proj.weight"] = mc("linear_weights_proj.weight", (d.index_heads, H))
        return out
