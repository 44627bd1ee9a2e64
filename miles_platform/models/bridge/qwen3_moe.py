"""Qwen3-MoE <-> megatron-core GPTModel with MoE layers, expert parallel 1.

Attention, norms and embeddings are Qwen3's (models/bridge/dense.py). Every layer's MLP is a
top-k MoE block:

HF (module names; on disk per expert)           megatron (SequentialMLP experts, TopKRouter)
model.layers.i.mlp.gate.weight [E, H]           decoder.layers.i.mlp.router.weight
model.layers.i.mlp.experts.gate_up_proj [E, 2I, H]
  (on disk: mlp.experts.e.{gate,up}_proj.weight) decoder.layers.i.mlp.experts.local_experts.e.linear_fc1.weight ([gate; up])
model.layers.i.mlp.experts.down_proj [E, H, I]
  (on disk: mlp.experts.e.down_proj.weight)     decoder.layers.i.mlp.experts.local_experts.e.linear_fc2.weight

transformers 5 fuses the per-expert tensors of a checkpoint into the 3-D module parameters on
load and splits them on save; `hf_to_megatron` reads either layout, `megatron_to_hf` gives the
module names and `checkpoint_layout` the on-disk ones (what `convert torch-dist-to-hf` writes).

Routing: HF takes the top-k of softmax(logits) and, with `norm_topk_prob`, renormalizes them to sum
to one, which is softmax over the top-k logits: megatron's `moe_router_pre_softmax=False`. Without
it the gates are the full softmax's top-k values: `moe_router_pre_softmax=True`. No load-balancing
loss inside the model (`moe_router_load_balancing_type="none"`), no shared experts, no expert bias.
The token dispatcher is "allgather": at EP=1 it only permutes locally ("alltoall" allocates a CUDA
stream in its constructor).

Refused by name: layers that are not all sparse (`mlp_only_layers`, `decoder_sparse_step` > 1).
"""

from __future__ import annotations

from typing import Any

import torch

from miles_platform.errors import CheckpointError
from miles_platform.models.bridge.base import hf_config_dict, register_bridge
from miles_platform.models.bridge.dense import DenseBridge, Dims


class MoeDims(Dims):
    def __init__(self, hf_config: Any, family: str, qkv_bias: bool, qk_norm: bool):
        super().__init__(hf_config, family, qkv_bias, qk_norm)
        c = hf_config_dict(hf_config)
        # published Qwen3-MoE configs write num_experts; transformers 5 saves it as num_local_experts
        self.experts = int(c.get("num_experts") or c["num_local_experts"])
        self.top_k = int(c["num_experts_per_tok"])
        self.moe_ffn = int(c["moe_intermediate_size"])
        self.norm_topk_prob = bool(c.get("norm_topk_prob", False))
        dense_layers = [
            i
            for i in range(self.layers)
            if i in (c.get("mlp_only_layers") or []) or (i + 1) % int(c.get("decoder_sparse_step", 1) or 1)
        ]
        if dense_layers:
            raise CheckpointError(
                f"{family} config: layers {dense_layers} are dense MLPs (mlp_only_layers / decoder_sparse_step); "
                "the megatron mapping takes every layer sparse; use --train-backend fsdp for this checkpoint"
            )
        if not 0 < self.top_k <= self.experts:
            raise CheckpointError(
                f"{family} config: num_experts_per_tok {self.top_k} must be in 1..num_experts ({self.experts})"
            )


@register_bridge("Qwen3MoeForCausalLM")
class Qwen3MoeBridge(DenseBridge):
    family = "Qwen3-MoE"
    qk_norm = True

    def dims(self, hf_config: Any) -> MoeDims:
        c = hf_config_dict(hf_config)
        return MoeDims(c, self.family, self.qkv_bias(c), self.qk_norm)

    def transformer_config(self, hf_config: Any) -> dict[str, Any]:
        d = self.dims(hf_config)
        return dict(
            super().transformer_config(hf_config),
            **softmax_moe_config(d.experts, d.top_k, d.moe_ffn, pre_softmax=not d.norm_topk_prob),
        )

    def layer_spec_kwargs(self, hf_config: Any) -> dict[str, Any]:
        return dict(qk_layernorm=True, num_experts=self.dims(hf_config).experts, moe_grouped_gemm=False)

    def mlp_norm_fuses(self, d: MoeDims, i: int) -> bool:
        return False  # every layer is an MoE block

    def mlp_to_megatron(self, hf_sd, get, d: MoeDims, hp: str, mp: str, i: int) -> dict[str, torch.Tensor]:
        out = {mp + "mlp.router.weight": get(hp + "mlp.gate.weight", (d.experts, d.hidden))}
        out.update(experts_to_megatron(hf_sd, get, d.experts, d.hidden, d.moe_ffn, hp, mp))
        return out

    def mlp_to_hf(self, get, d: MoeDims, hp: str, mp: str, i: int) -> dict[str, torch.Tensor]:
        out = {hp + "mlp.gate.weight": get(mp + "mlp.router.weight", (d.experts, d.hidden))}
        out.update(experts_to_hf(get, d.experts, d.hidden, d.moe_ffn, hp, mp))
        return out


def softmax_moe_config(experts: int, top_k: int, ffn: int, pre_softmax: bool) -> dict[str, Any]:
    """TransformerConfig's fields of a softmax top-k router (Qwen3-MoE, GPT-OSS): pre_softmax takes the
    top-k of the softmax over all experts, else the softmax over the top-k logits; no load-balancing loss
    inside the model, the allgather dispatcher, no fused kernels."""
    return dict(
        num_moe_experts=experts,
        moe_router_topk=top_k,
        moe_ffn_hidden_size=ffn,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=pre_softmax,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )


def experts_to_megatron(hf_sd, get, E: int, H: int, inter: int, hp: str, mp: str) -> dict[str, torch.Tensor]:
    """One layer's routed experts, HF `hp` prefix -> megatron `mp` prefix (SequentialMLP), from either
    HF layout; `get(name, shape)` takes a tensor."""
    out = {}
    fused = hp + "mlp.experts.gate_up_proj" in hf_sd
    if fused:  # transformers' module parameters
        gate_up = get(hp + "mlp.experts.gate_up_proj", (E, 2 * inter, H))
        down = get(hp + "mlp.experts.down_proj", (E, H, inter))
    for e in range(E):
        xp, ep = f"{hp}mlp.experts.{e}.", f"{mp}mlp.experts.local_experts.{e}."
        if fused:
            fc1, fc2 = gate_up[e], down[e]
        else:  # the checkpoint's per-expert tensors
            fc1 = torch.cat(
                [get(xp + "gate_proj.weight", (inter, H)), get(xp + "up_proj.weight", (inter, H))]
            )
            fc2 = get(xp + "down_proj.weight", (H, inter))
        out[ep + "linear_fc1.weight"] = fc1
        out[ep + "linear_fc2.weight"] = fc2
    return out


def experts_to_hf(get, E: int, H: int, inter: int, hp: str, mp: str) -> dict[str, torch.Tensor]:
    """The inverse of `experts_to_megatron`, into transformers' fused module parameters."""
    ep = [f"{mp}mlp.experts.local_experts.{e}." for e in range(E)]
    return {
        hp + "mlp.experts.gate_up_proj": torch.stack(
            [get(p + "linear_fc1.weight", (2 * inter, H)) for p in ep]
        ),
        hp + "mlp.experts.down_proj": torch.stack([get(p + "linear_fc2.weight", (H, inter)) for p in ep]),
    }
