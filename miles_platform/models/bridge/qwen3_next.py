"""Qwen3-Next (`Qwen3NextForCausalLM`) <-> megatron-core GPTModel: Qwen3.5-MoE's mapping (models/bridge/
qwen3_5_moe.py: GatedDeltaNet / gated attention, zero-centered norms, partial rotary, top-k experts with a gated
shared expert) with the DeltaNet's projections fused the way Qwen3-Next publishes them, and `norm_topk_prob`.

HF                                                   megatron
linear_attn.in_proj_qkvz [Nk * (2 dk + 2 r dv), H]   self_attention.in_proj.weight [Q_all; K_all; V_all; Z_all;
linear_attn.in_proj_ba   [Nk * 2 r, H]                 B_all; A_all] (r = Nv / Nk value heads per key head)

HF's rows are grouped per key head g: in_proj_qkvz [q_g (dk); k_g (dk); v of g's r value heads (r dv); z of them
(r dv)], in_proj_ba [b of g's r value heads; a of them] (`Qwen3NextGatedDeltaNet.fix_query_key_value_ordering`);
the conv then runs over [Q_all; K_all; V_all], as Qwen3.5's. The bridge regroups the rows part by part (a pure
permutation: bit-exact both ways); tests/unit/models/test_qwen3_5_bridge.py's control loads them flat instead.
Routing: top-k of the softmax, renormalized when `norm_topk_prob` (megatron `moe_router_pre_softmax` off, on
otherwise), as Qwen3-MoE. Refused by name: dense layers between the sparse ones (`mlp_only_layers`,
`decoder_sparse_step` > 1), and Qwen3.5-MoE's refusals.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_platform.models.bridge.base import hf_config_dict, register_bridge
from miles_platform.models.bridge.qwen3_5_moe import Qwen35MoeBridge, Qwen35MoeDims


class Qwen3NextDims(Qwen35MoeDims):
    def __init__(self, c: dict[str, Any], family: str):
        super().__init__(c, family)
        self.norm_topk_prob = bool(c.get("norm_topk_prob", True))
        step = int(c.get("decoder_sparse_step") or 1)
        dense = [i for i in range(self.layers) if i in (c.get("mlp_only_layers") or []) or (i + 1) % step]
        if dense:
            raise self.refuse(
                family, f"layers {dense} are dense MLPs (mlp_only_layers / decoder_sparse_step)"
            )


@register_bridge("Qwen3NextForCausalLM")
class Qwen3NextBridge(Qwen35MoeBridge):
    family = "Qwen3-Next"

    def dims(self, hf_config: Any) -> Qwen3NextDims:
        return Qwen3NextDims(hf_config_dict(hf_config), self.family)

    def transformer_config(self, hf_config: Any) -> dict[str, Any]:
        # the router follows norm_topk_prob, as qwen3_moe.py's: top-k of the softmax over all experts when unset
        return dict(
            super().transformer_config(hf_config),
            moe_router_pre_softmax=not self.dims(hf_config).norm_topk_prob,
        )

    def in_proj_to_megatron(self, get, d: Qwen3NextDims, h: str) -> list[torch.Tensor]:
        H, r = d.hidden, d.nv // d.nk
        qkvz = get(h + "in_proj_qkvz.weight", (d.nk * (2 * d.dk + 2 * r * d.dv), H)).reshape(d.nk, -1, H)
        q, k, v, z = qkvz.split([d.dk, d.dk, r * d.dv, r * d.dv], dim=1)
        b, a = get(h + "in_proj_ba.weight", (d.nk * 2 * r, H)).reshape(d.nk, 2 * r, H).split([r, r], dim=1)
        flat = [t.reshape(-1, H) for t in (q, k, v, z, b, a)]
        return [torch.cat(flat[:3]), *flat[3:]]

    def in_proj_to_hf(self, parts: list[torch.Tensor], d: Qwen3NextDims, h: str) -> dict[str, torch.Tensor]:
        H = d.hidden
        qkv, z, b, a = parts
        q, k, v = qkv.split([d.nk * d.dk, d.nk * d.dk, d.nv * d.dv])
        grouped = [t.reshape(d.nk, -1, H) for t in (q, k, v, z, b, a)]
        return {
            h + "in_proj_qkvz.weight": torch.cat(grouped[:4], dim=1).reshape(-1, H),
            h + "in_proj_ba.weight": torch.cat(grouped[4:], dim=1).reshape(-1, H),
        }
