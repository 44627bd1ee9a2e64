"""GPT-OSS (`GptOssForCausalLM`) <-> megatron-core GPTModel: GQA attention with biases, attention sinks and
sliding-window layers; every layer a top-k MoE block of biased experts with a clamped SwiGLU.

HF (module names; on disk the same: `checkpoint_layout` keeps GPT-OSS's experts fused, as HF saves them)
                                                   megatron (local spec)
model.layers.i.self_attn.{q,k,v}_proj.{weight,bias} decoder.layers.i.self_attention.linear_qkv.{weight,bias} (dense.py)
model.layers.i.self_attn.o_proj.{weight,bias}      decoder.layers.i.self_attention.linear_proj.{weight,bias}
model.layers.i.self_attn.sinks [heads]             decoder.layers.i.self_attention.core_attention.softmax_offset
model.layers.i.mlp.router.{weight,bias}            decoder.layers.i.mlp.router.{weight,bias}
model.layers.i.mlp.experts.gate_up_proj [E, H, 2I] decoder.layers.i.mlp.experts.local_experts.e.linear_fc1.weight
  + gate_up_proj_bias [E, 2I]                        + .bias: [gate; up] rows; HF's columns interleave them
                                                     (gate = [..., ::2], up = [..., 1::2]) and are transposed
model.layers.i.mlp.experts.down_proj [E, I, H]     ...local_experts.e.linear_fc2.weight (transposed)
  + down_proj_bias [E, H]                            + .bias
Norms, embeddings and lm_head as dense.py; the TE spec keeps pre_mlp_layernorm apart (the router reads it).

What makes megatron's layer HF's (tests/unit/models/test_gpt_oss_bridge.py checks each against HF in fp32,
with a control that drops it):
- sinks: HF appends a per-head sink logit to each query's scores, softmaxes, drops it; megatron's
  `softmax_type="learnable"` (fused_softmax.SoftmaxOne) does exactly that with `softmax_offset`.
- sliding window: HF's `sliding_attention` layers see keys j with i - W < j <= i (W = sliding_window);
  megatron's `window_size=(W - 1, 0)` keeps i - (W - 1) <= j <= i on the layers `window_attn_skip_freq`
  marks 1 (from layer_types). (Miles' gpt-oss script passes `--window-size 128,0`: one key more than HF.)
- clamped SwiGLU: HF clamps gate above and up both ways at swiglu_limit, then (up + 1) * gate *
  sigmoid(gate * swiglu_alpha): megatron's unfused glu with `activation_func_clamp_value`,
  `glu_linear_offset=1` and `sigmoid_gate` (megatron's quick_gelu is it at alpha 1.702, torch.compiled).
- biases: `add_bias_linear` puts them on linear_qkv, linear_proj, the router and the experts' fc1 / fc2:
  GPT-OSS with attention_bias (o_proj's too); GPTModel's output layer has none either way.
- router: HF's logits are the router's linear with its bias, top-k of them, softmax over those k:
  `moe_router_pre_softmax=False` (qwen3_moe.softmax_moe_config).
- rope: default, or yarn as GPT-OSS publishes it (factor 32, original 4096, beta 32 / 1, truncate false):
  GPTModel's `position_embedding_type="yarn"` builds transformers' frequencies, `truncate` is
  `yarn_correction_range_round_to_int`, and the attention factor scales cos and sin as HF's
  `attention_scaling` (megatron reads the `yarn_*` config attributes, set by megatron_parallel).

Refused by name (CheckpointError; preflight turns it into a ConfigError before Ray): attention_bias false
(megatron's add_bias_linear biases attention and experts together), layer types other than sliding / full,
sliding layers without a sliding_window, top-1 routing (megatron's softmax-after-top-k router refuses k = 1),
rope types other than default / yarn, a partial rotary, yarn with an explicit attention_factor; expert TP > 1
(`layout_refusal`: megatron-core builds biased experts at expert TP 1 only). TP / SP / EP train
as Qwen3-MoE's (the sinks split with the heads; megatron_parallel.fix_sinks_and_biased_experts has the three
megatron-core spots this needed). The published mxfp4 experts are refused at validation (bring bf16).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from miles_platform.errors import CheckpointError
from miles_platform.models.bridge.base import hf_config_dict, register_bridge
from miles_platform.models.bridge.dense import DenseBridge, Dims, yarn_fields
from miles_platform.models.bridge.qwen3_moe import softmax_moe_config

_LAYER_TYPES = ("sliding_attention", "full_attention")


def sigmoid_gate(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """GPT-OSS's gate activation, HF's arithmetic: x * sigmoid(x * alpha)."""
    return x * torch.sigmoid(x * alpha)


class GptOssDims(Dims):
    """dense.py's attention fields (q/k/v biases), the window, the experts and the clamped SwiGLU."""

    def __init__(self, c: dict[str, Any], family: str):
        self.yarn: dict[str, Any] | None = None
        super().__init__(c, family, qkv_bias=True)
        if not c.get("attention_bias", True):
            raise self.refuse(
                "attention_bias false (megatron's add_bias_linear biases attention and experts together)"
            )
        self.experts = int(c["num_local_experts"])
        self.top_k = int(c["num_experts_per_tok"])
        if not 1 < self.top_k <= self.experts:
            raise self.refuse(
                f"num_experts_per_tok {self.top_k} of {self.experts} experts (megatron's softmax over the top-k "
                "logits takes 2..num_local_experts: at 1 it refuses, HF's gate is 1)"
            )
        kinds = list(c.get("layer_types") or ["full_attention"] * self.layers)
        if len(kinds) != self.layers or set(kinds) - set(_LAYER_TYPES):
            raise self.refuse(f"layer_types {kinds} (one of {_LAYER_TYPES} per layer)")
        self.sliding = [k == "sliding_attention" for k in kinds]
        self.window = c.get("sliding_window")
        if any(self.sliding) and not self.window:
            raise self.refuse(f"sliding_attention layers with sliding_window {self.window}")
        self.alpha = float(c.get("swiglu_alpha", 1.702))
        self.limit = float(c.get("swiglu_limit", 7.0))

    def refuse(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"{self.family} config: {what}; the megatron mapping cannot reproduce it: use --train-backend fsdp "
            "for this checkpoint"
        )

    def rope_scaling(self, rope: dict[str, Any]) -> None:
        """default, or yarn: GPTModel's YarnRotaryEmbedding (`yarn_*` TransformerConfig attributes)."""
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise self.refuse(f"partial_rotary_factor {rope['partial_rotary_factor']}")
        if rope["rope_type"] == "default":
            return
        if rope["rope_type"] != "yarn":
            raise self.refuse(f"rope_type {rope['rope_type']!r} (mapped: default, yarn)")
        if rope.get("attention_factor") is not None:
            raise self.refuse("yarn with an explicit attention_factor (megatron derives it from the factor)")
        y = yarn_fields(rope, self.max_pos)
        # HF: get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both are set, else
        # get_mscale(factor); megatron the same with None for "not set"
        both = bool(rope.get("mscale") and rope.get("mscale_all_dim"))
        self.yarn = dict(
            yarn_rotary_scaling_factor=y["factor"],
            yarn_original_max_position_embeddings=y["original"],
            yarn_beta_fast=y["beta_fast"],
            yarn_beta_slow=y["beta_slow"],
            yarn_mscale=float(rope["mscale"]) if both else None,
            yarn_mscale_all_dim=float(rope["mscale_all_dim"]) if both else None,
            yarn_correction_range_round_to_int=bool(rope.get("truncate", True)),
        )


@register_bridge("GptOssForCausalLM")
class GptOssBridge(DenseBridge):
    family = "GPT-OSS"
    # training/megatron_lora.py: attention and expert adapters (the biases and sinks are the base's)
    lora_refusal = None
    interleaved_gate_up = True  # HF's gate_up_proj columns [g0, u0, g1, u1, ...]; fc1's rows [gate; up]

    def dims(self, hf_config: Any) -> GptOssDims:
        return GptOssDims(hf_config_dict(hf_config), self.family)

    def layout_refusal(self, hf_config: dict[str, Any], layout: Any, *, step: bool = True) -> str | None:
        etp = layout.etp or layout.tp
        if etp > 1:
            return (
                f"expert tensor parallel {etp} (--expert-tensor-parallel-size, default: "
                f"--tensor-model-parallel-size {layout.tp}) with GPT-OSS's biased experts: megatron-core builds "
                "biased experts at expert TP 1 only; add --expert-tensor-parallel-size 1"
            )
        return None

    def transformer_config(self, hf_config: Any) -> dict[str, Any]:
        """dense.py's fields with biases, sinks, windows, the clamped SwiGLU, the softmax router; the
        `yarn_*` keys are attributes megatron_parallel sets on the built TransformerConfig."""
        d = self.dims(hf_config)
        window = any(d.sliding)
        return dict(
            super().transformer_config(hf_config),
            add_bias_linear=True,
            softmax_type="learnable",
            window_size=(d.window - 1, 0) if window else None,
            window_attn_skip_freq=[int(s) for s in d.sliding] if window else None,
            activation_func=partial(sigmoid_gate, alpha=d.alpha),
            activation_func_clamp_value=d.limit,
            glu_linear_offset=1.0,
            **softmax_moe_config(d.experts, d.top_k, d.ffn, pre_softmax=False),
            **(d.yarn or {}),
        )

    def gpt_model_kwargs(self, hf_config: Any, tensor_model_parallel_size: int = 1) -> dict[str, Any]:
        kw = super().gpt_model_kwargs(hf_config, tensor_model_parallel_size)
        return dict(kw, position_embedding_type="yarn" if self.dims(hf_config).yarn else "rope")

    def layer_spec_kwargs(self, hf_config: Any) -> dict[str, Any]:
        return dict(qk_layernorm=False, num_experts=self.dims(hf_config).experts, moe_grouped_gemm=False)

    def mlp_norm_fuses(self, d: GptOssDims, i: int) -> bool:
        return False  # every layer is an MoE block

    def attention_extras_to_megatron(self, get, d: GptOssDims, hp: str, mp: str) -> dict[str, torch.Tensor]:
        return {
            mp + "self_attention.linear_proj.bias": get(hp + "self_attn.o_proj.bias", (d.hidden,)),
            mp + "self_attention.core_attention.softmax_offset": get(hp + "self_attn.sinks", (d.heads,)),
        }

    def attention_extras_to_hf(self, get, d: GptOssDims, hp: str, mp: str) -> dict[str, torch.Tensor]:
        return {
            hp + "self_attn.o_proj.bias": get(mp + "self_attention.linear_proj.bias", (d.hidden,)),
            hp + "self_attn.sinks": get(mp + "self_attention.core_attention.softmax_offset", (d.heads,)),
        }

    def mlp_to_megatron(self, hf_sd, get, d: GptOssDims, hp: str, mp: str, i: int) -> dict[str, torch.Tensor]:
        E, H, inter = d.experts, d.hidden, d.ffn
        x = hp + "mlp.experts."
        gate_up, gate_up_b = (
            get(x + "gate_up_proj", (E, H, 2 * inter)),
            get(x + "gate_up_proj_bias", (E, 2 * inter)),
        )
        down, down_b = get(x + "down_proj", (E, inter, H)), get(x + "down_proj_bias", (E, H))
        out = {mp + "mlp.router.weight": get(hp + "mlp.router.weight", (E, H)),
               mp + "mlp.router.bias": get(hp + "mlp.router.bias", (E,))}  # fmt: skip
        for e in range(E):
            ep = f"{mp}mlp.experts.local_experts.{e}."
            out[ep + "linear_fc1.weight"] = torch.cat([gate_up[e, :, 0::2].t(), gate_up[e, :, 1::2].t()])
            out[ep + "linear_fc1.bias"] = torch.cat([gate_up_b[e, 0::2], gate_up_b[e, 1::2]])
            out[ep + "linear_fc2.weight"] = down[e].t().contiguous()
            out[ep + "linear_fc2.bias"] = down_b[e]
        return out

    def mlp_to_hf(self, get, d: GptOssDims, hp: str, mp: str, i: int) -> dict[str, torch.Tensor]:
        E, H, inter = d.experts, d.hidden, d.ffn
        ep = [f"{mp}mlp.experts.local_experts.{e}." for e in range(E)]
        fc1 = torch.stack([get(p + "linear_fc1.weight", (2 * inter, H)) for p in ep])  # [E, 2I, H]: gate; up
        fc1_b = torch.stack([get(p + "linear_fc1.bias", (2 * inter,)) for p in ep])
        x = hp + "mlp.experts."
        out = {hp + "mlp.router.weight": get(mp + "mlp.router.weight", (E, H)),
               hp + "mlp.router.bias": get(mp + "mlp.router.bias", (E,))}  # fmt: skip
        out[x + "gate_up_proj"] = _interleave(fc1.transpose(1, 2), inter)
        out[x + "gate_up_proj_bias"] = _interleave(fc1_b, inter)
        out[x + "down_proj"] = torch.stack([get(p + "linear_fc2.weight", (H, inter)).t() for p in ep])
        out[x + "down_proj_bias"] = torch.stack([get(p + "linear_fc2.bias", (H,)) for p in ep])
        return out


def _interleave(gate_then_up: torch.Tensor, inter: int) -> torch.Tensor:
    """[..., 2I] with the gate's I columns first, then up's -> HF's [g0, u0, g1, u1, ...]."""
    gate, up = gate_then_up[..., :inter], gate_then_up[..., inter:]
    return torch.stack([gate, up], dim=-1).flatten(-2)
