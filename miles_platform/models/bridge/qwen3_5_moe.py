"""Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`) <-> megatron-core GPTModel: Qwen3.5's layers (models/bridge/qwen3_5.py:
GatedDeltaNet / gated attention, zero-centered norms, partial rotary) with every MLP a top-k MoE block and a
sigmoid-gated shared expert.

HF (module names)                                  megatron
model.layers.i.mlp.gate.weight [E, H]              decoder.layers.i.mlp.router.weight
model.layers.i.mlp.experts.gate_up_proj / down_proj decoder.layers.i.mlp.experts.local_experts.e.linear_fc1 / fc2
                                                     (qwen3_moe.py's mapping, either HF layout)
model.layers.i.mlp.shared_expert.{gate,up}_proj    decoder.layers.i.mlp.shared_experts.linear_fc1.weight ([gate; up])
model.layers.i.mlp.shared_expert.down_proj         decoder.layers.i.mlp.shared_experts.linear_fc2.weight
model.layers.i.mlp.shared_expert_gate.weight [1, H] decoder.layers.i.mlp.shared_experts.gate_weight

Routing: HF's Qwen3_5MoeTopKRouter takes the top-k of softmax(logits) and always renormalizes them (no
`norm_topk_prob` field): softmax over the top-k logits, megatron's `moe_router_pre_softmax=False`. The shared
expert's output is scaled by sigmoid(x @ shared_expert_gate): megatron's `moe_shared_expert_gate`
(SharedExpertMLP: sigmoid(linear(x, gate_weight)) * output), added to the routed experts' as HF does.
The TE spec keeps pre_mlp_layernorm apart (the router reads it). Layouts as Qwen3.5's and MoE models' (CP, PP
refused for MoE; TP needs SP); R3 through the routers' replay hook, as Qwen3-MoE.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_platform.models.bridge.base import hf_config_dict, register_bridge
from miles_platform.models.bridge.qwen3_5 import Qwen35Bridge, Qwen35Dims
from miles_platform.models.bridge.qwen3_moe import experts_to_hf, experts_to_megatron, softmax_moe_config


class Qwen35MoeDims(Qwen35Dims):
    """Qwen3.5's fields, the experts and the shared expert."""

    def __init__(self, c: dict[str, Any], family: str):
        super().__init__(c, family)
        self.experts = int(c["num_experts"])
        self.top_k = int(c["num_experts_per_tok"])
        self.moe_ffn = int(c["moe_intermediate_size"])
        self.shared_ffn = int(c["shared_expert_intermediate_size"])
        if not 1 < self.top_k <= self.experts:
            raise self.refuse(
                family,
                f"num_experts_per_tok {self.top_k} of {self.experts} experts (megatron's softmax over the top-k "
                "logits takes 2..num_experts: at 1 it refuses, HF's renormalized gate is 1)",
            )


@register_bridge("Qwen3_5MoeForCausalLM")
class Qwen35MoeBridge(Qwen35Bridge):
    family = "Qwen3.5-MoE"

    def dims(self, hf_config: Any) -> Qwen35MoeDims:
        return Qwen35MoeDims(hf_config_dict(hf_config), self.family)

    def transformer_config(self, hf_config: Any) -> dict[str, Any]:
        d = self.dims(hf_config)
        return dict(
            super().transformer_config(hf_config),
            **softmax_moe_config(d.experts, d.top_k, d.moe_ffn, pre_softmax=False),
            moe_shared_expert_intermediate_size=d.shared_ffn,
            moe_shared_expert_gate=True,
        )

    def layer_spec_kwargs(self, hf_config: Any) -> dict[str, Any]:
        return dict(qk_layernorm=True, num_experts=self.dims(hf_config).experts, moe_grouped_gemm=False)

    def mlp_norm_fuses(self, d: Qwen35MoeDims, i: int) -> bool:
        return False  # every layer is an MoE block

    def mlp_to_megatron(
        self, hf_sd, get, d: Qwen35MoeDims, hp: str, mp: str, i: int
    ) -> dict[str, torch.Tensor]:
        H, s = d.hidden, hp + "mlp.shared_expert."
        out = {mp + "mlp.router.weight": get(hp + "mlp.gate.weight", (d.experts, H))}
        out.update(experts_to_megatron(hf_sd, get, d.experts, H, d.moe_ffn, hp, mp))
        gate_up = [
            get(s + "gate_proj.weight", (d.shared_ffn, H)),
            get(s + "up_proj.weight", (d.shared_ffn, H)),
        ]
        out[mp + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(gate_up)
        out[mp + "mlp.shared_experts.linear_fc2.weight"] = get(s + "down_proj.weight", (H, d.shared_ffn))
        out[mp + "mlp.shared_experts.gate_weight"] = get(hp + "mlp.shared_expert_gate.weight", (1, H))
        return out

    def mlp_to_hf(self, get, d: Qwen35MoeDims, hp: str, mp: str, i: int) -> dict[str, torch.Tensor]:
        H, s, m = d.hidden, hp + "mlp.shared_expert.", mp + "mlp.shared_experts."
        out = {hp + "mlp.gate.weight": get(mp + "mlp.router.weight", (d.experts, H))}
        out.update(experts_to_hf(get, d.experts, H, d.moe_ffn, hp, mp))
        gate, up = get(m + "linear_fc1.weight", (2 * d.shared_ffn, H)).chunk(2, dim=0)
        out[s + "gate_proj.weight"], out[s + "up_proj.weight"] = gate, up
        out[s + "down_proj.weight"] = get(m + "linear_fc2.weight", (H, d.shared_ffn))
        out[hp + "mlp.shared_expert_gate.weight"] = get(m + "gate_weight", (1, H))
        return out
