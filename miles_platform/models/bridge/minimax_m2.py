"""MiniMax-M2 (`MiniMaxM2ForCausalLM`) <-> megatron-core GPTModel, at any tensor / expert parallel size.

transformers' `MiniMaxM2Attention` is GQA attention without biases whose q_norm / k_norm are RMSNorms over
the WHOLE projection (num_heads x head_dim for q, num_kv_heads x head_dim for k), applied before the
reshape into heads, then a partial rotary (`partial_rotary_factor`, or published configs' `rotary_dim` /
head_dim) in HF's half-split layout: megatron's `rotary_percent` as in glm4_moe.py. megatron-core's
SelfAttention applies `q_layernorm` / `k_layernorm` to [sq, b, heads, head_dim] (query heads in HF's
order, grouped per query group), built with hidden_size = head_dim; `adapt_layer_spec` puts
`WholeQNorm` / `WholeKNorm` there, which normalize heads x head_dim jointly with a weight of that size.
At TP > 1 each rank holds whole heads (whole query groups and their query heads, in rank order): the sums
of squares are all-reduced over the TP group, their gradient all-reduced back (torch.distributed.nn's autograd
all-reduce: each rank's heads add their part of d loss / d sum), and each rank applies its heads' slice of
the norm's weight, which every rank holds whole: its gradient is nonzero on that slice only, and megatron's
finalize_model_grads sums every `q_layernorm` / `k_layernorm` gradient over TP (for its per-head norms,
whose gradients are partial over the heads), which assembles the whole one. (A weight split over TP would
have each slice summed with the other ranks' slices there.)

HF (module names)                                megatron
model.layers.i.self_attn.{q,k,v}_proj / o_proj   as models/bridge/dense.py (linear_qkv grouped per query group)
model.layers.i.self_attn.q_norm.weight [nh*hd]   decoder.layers.i.self_attention.q_layernorm.weight [nh*hd]
model.layers.i.self_attn.k_norm.weight [ng*hd]   decoder.layers.i.self_attention.k_layernorm.weight [ng*hd]
model.layers.i.mlp.gate.weight [E, H]            decoder.layers.i.mlp.router.weight
model.layers.i.mlp.e_score_correction_bias [E]   decoder.layers.i.mlp.router.expert_bias (a buffer on both sides)
model.layers.i.mlp.experts.gate_up_proj / down_proj  decoder.layers.i.mlp.experts.local_experts.e.linear_fc1 / fc2
On disk (models/checkpoint_layout.py): `block_sparse_moe.` for `mlp.`, experts one tensor each as
w1 / w3 / w2 (gate / up / down); `hf_to_megatron` reads either layout. Every layer is an MoE block of
`num_local_experts` experts of `intermediate_size` hidden units; there is no shared expert.

Routing (HF `MiniMaxM2TopKRouter`): sigmoid scores, the score-correction bias added for the choice only,
the chosen (unbiased) scores renormalized to sum to one, no scaling factor: megatron's sigmoid router with
`moe_router_enable_expert_bias`, the bias loaded and kept (`moe_router_bias_update_rate=0`, HF never
updates it), no group limit; its sigmoid path renormalizes exactly when top-k > 1. deepseek_v3.py's MoE
refuses a model without a shared expert only because its DeepSeek mapping always maps one; megatron's MoE
layer without shared experts is Qwen3-MoE's, so this bridge maps none.

Refused by name (CheckpointError; preflight turns it into a ConfigError before Ray): top-1 routing (HF's
gate is then 1, megatron's the raw sigmoid), router_jitter_noise > 0, rope types other than default,
hidden_act other than silu, attention_bias. LoRA on megatron: training/megatron_lora.py.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from miles_platform.errors import CheckpointError
from miles_platform.models.bridge.base import hf_config_dict, register_bridge
from miles_platform.models.bridge.dense import DenseBridge, Dims, checked_rotary_percent, rope_params
from miles_platform.models.bridge.qwen3_moe import experts_to_hf, experts_to_megatron, softmax_moe_config


class WholeProjectionNorm(torch.nn.Module):
    """HF's MiniMaxM2RMSNorm over heads x head_dim of a [..., heads, head_dim] tensor, built by megatron's
    SelfAttention in place of its per-head q_layernorm / k_layernorm (whose hidden_size is head_dim). At TP > 1
    the tensor holds this rank's heads (see the module docstring)."""

    def __init__(self, config, heads: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.tp = int(config.tensor_model_parallel_size)
        self.width = heads * config.kv_channels  # the whole projection's
        self.weight = torch.nn.Parameter(torch.ones(self.width, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(*x.shape[:-2], -1).float()  # HF: in fp32, cast back, then the weight
        if self.tp == 1:
            flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.eps)
            return (self.weight * flat.to(x.dtype)).reshape(x.shape)
        from megatron.core import parallel_state
        from torch.distributed.nn.functional import all_reduce

        # the sum over every rank's heads; its gradient summed back over them (each rank's heads' part)
        total = all_reduce(
            flat.pow(2).sum(-1, keepdim=True), group=parallel_state.get_tensor_model_parallel_group()
        )
        flat = flat * torch.rsqrt(total / self.width + self.eps)
        n = flat.shape[-1]  # this rank's heads: their slice of the whole weight
        weight = self.weight[parallel_state.get_tensor_model_parallel_rank() * n :][:n]
        return (weight * flat.to(x.dtype)).reshape(x.shape)


class WholeQNorm(WholeProjectionNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__(config, config.num_attention_heads, eps)


class WholeKNorm(WholeProjectionNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__(config, config.num_query_groups, eps)


class MiniMaxM2Dims(Dims):
    """dense.py's attention fields (the q/k norms mapped whole, not per head), the rotary fraction, the MoE."""

    def __init__(self, c: dict[str, Any], family: str):
        super().__init__(c, family, qkv_bias=False, qk_norm=False)
        self.experts = int(c["num_local_experts"])
        self.top_k = int(c["num_experts_per_tok"])
        if not 1 < self.top_k <= self.experts:
            raise self.refuse(
                f"num_experts_per_tok {self.top_k} of {self.experts} experts (HF renormalizes a top-1 gate to 1, "
                "megatron's sigmoid router renormalizes only at top-k > 1)"
            )
        if float(c.get("router_jitter_noise") or 0.0):
            raise self.refuse(f"router_jitter_noise {c['router_jitter_noise']} (no megatron mapping)")
        if c.get("attention_bias"):
            raise self.refuse("attention_bias true")
        rope = rope_params(c)
        if rope["rope_type"] != "default":
            raise self.refuse(f"rope_type {rope['rope_type']!r} (mapped: default, with a partial rotary)")
        partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor"))
        if partial is None and c.get(
            "rotary_dim"
        ):  # published configs: rotary_dim (MiniMaxM2Config reads it)
            partial = int(c["rotary_dim"]) / self.head_dim
        self.rotary_percent = checked_rotary_percent(
            float(1.0 if partial is None else partial), self.head_dim, self.refuse
        )

    def refuse(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"{self.family} config: {what}; the megatron mapping cannot reproduce it: use --train-backend fsdp "
            "for this checkpoint"
        )


@register_bridge("MiniMaxM2ForCausalLM")
class MiniMaxM2Bridge(DenseBridge):
    family = "MiniMax-M2"
    # training/megatron_lora.py: the q/k/v/o adapters add to linear_qkv's rows before the whole-projection
    # norms, as PEFT's add to q_proj / k_proj before HF's; the routed experts are Qwen-style
    lora_refusal = None

    def dims(self, hf_config: Any) -> MiniMaxM2Dims:
        return MiniMaxM2Dims(hf_config_dict(hf_config), self.family)

    def transformer_config(self, hf_config: Any) -> dict[str, Any]:
        d = self.dims(hf_config)
        return dict(
            super().transformer_config(hf_config),
            qk_layernorm=True,  # WholeQNorm / WholeKNorm (adapt_layer_spec)
            # qwen3_moe's router fields with sigmoid scores and the checkpoint's score-correction bias, kept
            **{
                **softmax_moe_config(d.experts, d.top_k, d.ffn, pre_softmax=False),
                "moe_router_score_function": "sigmoid",
                "moe_router_enable_expert_bias": True,
                "moe_router_bias_update_rate": 0.0,
                "moe_router_topk_scaling_factor": 1.0,
            },
        )

    def gpt_model_kwargs(self, hf_config: Any, tensor_model_parallel_size: int = 1) -> dict[str, Any]:
        kw = super().gpt_model_kwargs(hf_config, tensor_model_parallel_size)
        return dict(kw, rotary_percent=self.dims(hf_config).rotary_percent)

    def layer_spec_kwargs(self, hf_config: Any) -> dict[str, Any]:
        return dict(qk_layernorm=True, num_experts=self.dims(hf_config).experts, moe_grouped_gemm=False)

    def adapt_layer_spec(self, spec, use_te: bool):
        spec = copy.deepcopy(spec)
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm, attention.k_layernorm = WholeQNorm, WholeKNorm
        return spec

    def mlp_norm_fuses(self, d: MiniMaxM2Dims, i: int) -> bool:
        return False  # every layer is an MoE block

    def hf_to_megatron(self, hf_sd, config, *, fused_norms=False, padded_vocab_size=None):
        if any(".block_sparse_moe." in k for k in hf_sd):  # the on-disk layout
            from miles_platform.models.checkpoint_layout import fuse_checkpoint_experts

            hf_sd = fuse_checkpoint_experts(hf_sd)
        return super().hf_to_megatron(
            hf_sd, config, fused_norms=fused_norms, padded_vocab_size=padded_vocab_size
        )

    def attention_extras_to_megatron(
        self, get, d: MiniMaxM2Dims, hp: str, mp: str
    ) -> dict[str, torch.Tensor]:
        return {
            mp + "self_attention.q_layernorm.weight": get(
                hp + "self_attn.q_norm.weight", (d.heads * d.head_dim,)
            ),
            mp + "self_attention.k_layernorm.weight": get(
                hp + "self_attn.k_norm.weight", (d.groups * d.head_dim,)
            ),
        }

    def attention_extras_to_hf(self, get, d: MiniMaxM2Dims, hp: str, mp: str) -> dict[str, torch.Tensor]:
        return {
            hp + "self_attn.q_norm.weight": get(
                mp + "self_attention.q_layernorm.weight", (d.heads * d.head_dim,)
            ),
            hp + "self_attn.k_norm.weight": get(
                mp + "self_attention.k_layernorm.weight", (d.groups * d.head_dim,)
            ),
        }

    def mlp_to_megatron(
        self, hf_sd, get, d: MiniMaxM2Dims, hp: str, mp: str, i: int
    ) -> dict[str, torch.Tensor]:
        out = {
            mp + "mlp.router.weight": get(hp + "mlp.gate.weight", (d.experts, d.hidden)),
            mp + "mlp.router.expert_bias": get(hp + "mlp.e_score_correction_bias", (d.experts,)),
        }
        out.update(experts_to_megatron(hf_sd, get, d.experts, d.hidden, d.ffn, hp, mp))
        return out

    def mlp_to_hf(self, get, d: MiniMaxM2Dims, hp: str, mp: str, i: int) -> dict[str, torch.Tensor]:
        out = {
            hp + "mlp.gate.weight": get(mp + "mlp.router.weight", (d.experts, d.hidden)),
            hp + "mlp.e_score_correction_bias": get(mp + "mlp.router.expert_bias", (d.experts,)),
        }
        out.update(experts_to_hf(get, d.experts, d.hidden, d.ffn, hp, mp))
        return out
