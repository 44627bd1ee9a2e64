"""GLM-4.5 / GLM-4.5-Air (`Glm4MoeForCausalLM`) <-> megatron-core GPTModel: GQA attention as dense.py
and DeepSeek's MoE as deepseek_v3.py; tensor / sequence / expert parallel as Qwen3-MoE (its names split
by base.tp_shard; one step at TP2 + SP and TP2 + SP + EP2 equals the 1-rank step:
tests/unit/training/test_megatron_layouts.py).

transformers' `Glm4MoeAttention` is Qwen2's / Qwen3's GQA attention: q/k/v projections with biases
when `attention_bias` (o_proj never has one: megatron `add_qkv_bias`), per-head q/k RMSNorm before the
rotary when `use_qk_norm` (megatron `qk_layernorm`), and a partial rotary: the first
`int(head_dim * partial_rotary_factor)` dims of each head are rotated, in HF's half-split layout
(`rotate_half` pairs j with j + rotary_dim / 2), the rest pass through. megatron's `rotary_percent`
(a GPTModel argument) does exactly that: RotaryEmbedding's dim is int(kv_channels * rotary_percent)
with the same inverse frequencies, and `_apply_rotary_pos_emb_bshd` rotates t[..., :dim] with the
same rotate_half (rotary_interleaved off) and concatenates the rest, so q/k rows map as they are.
Glm4MoeConfig defaults `partial_rotary_factor` to 0.5 when config.json leaves it out; so does the bridge.

Names: models/bridge/dense.py for attention, norms and embeddings (linear_qkv grouped per query
group); layers i < first_k_dense_replace have dense.py's MLP; the others deepseek_v3.py's MoE block
(router, `e_score_correction_bias` -> `router.expert_bias`, routed experts, shared experts) with its
routing fields (sigmoid, expert bias kept, group limit, renormalized gates x routed_scaling_factor).
The TE spec fuses a dense layer's post_attention_layernorm into linear_fc1 and keeps an MoE layer's.
The MTP layer of a published checkpoint (`model.layers.<num_hidden_layers>.*`) is dropped, as
transformers drops it.

Refused by name (CheckpointError; preflight turns it into a ConfigError before Ray): rope types other
than default (no yarn / llama3 mapping is checked for a partial rotary), deepseek_v3.py's routing
refusals (norm_topk_prob false, top-1, a group limit megatron ranks otherwise, no shared expert),
hidden_act other than silu. LoRA on megatron: training/megatron_lora.py (attention, dense MLPs, shared
and routed experts).
"""

from __future__ import annotations

from typing import Any

import torch

from miles_platform.models.bridge.base import hf_config_dict, register_bridge
from miles_platform.models.bridge.deepseek_v3 import DeepseekMoe, moe_to_hf, moe_to_megatron, mtp_layer
from miles_platform.models.bridge.dense import DenseBridge, Dims, checked_rotary_percent, rope_params

GLM_DEFAULT_PARTIAL_ROTARY = 0.5  # Glm4MoeConfig.__post_init__'s default


class Glm4MoeDims(Dims):
    """dense.py's attention fields, the rotary fraction and deepseek_v3.py's MoE fields (`moe`)."""

    def __init__(self, c: dict[str, Any], family: str):
        # Glm4MoeAttention: attention_bias puts biases on q/k/v only
        super().__init__(
            c, family, qkv_bias=bool(c.get("attention_bias")), qk_norm=bool(c.get("use_qk_norm"))
        )
        self.moe = DeepseekMoe(c, family)
        rope = rope_params(c)
        if rope["rope_type"] != "default":
            raise self.moe.refuse(f"rope_type {rope['rope_type']!r} (mapped: default, with a partial rotary)")
        partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor"))
        self.rotary_percent = checked_rotary_percent(
            float(GLM_DEFAULT_PARTIAL_ROTARY if partial is None else partial), self.head_dim, self.moe.refuse
        )


@register_bridge("Glm4MoeForCausalLM")
class Glm4MoeBridge(DenseBridge):
    family = "GLM-4.5"

    def dims(self, hf_config: Any) -> Glm4MoeDims:
        return Glm4MoeDims(hf_config_dict(hf_config), self.family)

    def transformer_config(self, hf_config: Any) -> dict[str, Any]:
        return dict(super().transformer_config(hf_config), **self.dims(hf_config).moe.moe_config())

    def gpt_model_kwargs(self, hf_config: Any, tensor_model_parallel_size: int = 1) -> dict[str, Any]:
        kw = super().gpt_model_kwargs(hf_config, tensor_model_parallel_size)
        return dict(kw, rotary_percent=self.dims(hf_config).rotary_percent)

    def layer_spec_kwargs(self, hf_config: Any) -> dict[str, Any]:
        """The MoE layers' spec; megatron_parallel builds the dense layers' without `num_experts`."""
        d = self.dims(hf_config)
        return dict(qk_layernorm=d.qk_norm, num_experts=d.moe.experts, moe_grouped_gemm=False)

    def mlp_norm_fuses(self, d: Glm4MoeDims, i: int) -> bool:
        return not d.moe.moe_layer(i)

    def unmapped_hf(self, name: str, d: Glm4MoeDims) -> bool:
        return mtp_layer(name, d.layers)

    def mlp_to_megatron(
        self, hf_sd, get, d: Glm4MoeDims, hp: str, mp: str, i: int
    ) -> dict[str, torch.Tensor]:
        if not d.moe.moe_layer(i):
            return super().mlp_to_megatron(hf_sd, get, d, hp, mp, i)
        return moe_to_megatron(hf_sd, get, d.moe, d.hidden, hp, mp)

    def mlp_to_hf(self, get, d: Glm4MoeDims, hp: str, mp: str, i: int) -> dict[str, torch.Tensor]:
        if not d.moe.moe_layer(i):
            return super().mlp_to_hf(get, d, hp, mp, i)
        return moe_to_hf(get, d.moe, d.hidden, hp, mp)
