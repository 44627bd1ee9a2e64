"""Qwen3.5 dense (`Qwen3_5ForCausalLM`) <-> megatron-core GPTModel: gated-DeltaNet linear-attention layers
(megatron's `GatedDeltaNet`, `experimental_attention_variant="gated_delta_net"`) between gated full-attention
layers, zero-centered RMSNorms, a partial rotary and dense SwiGLU MLPs.

HF (module names; on disk the same)                 megatron (local spec; TE spec name in brackets)
model.layers.i.input_layernorm.weight               decoder.layers.i.input_layernorm.weight
                                                      [linear_qkv.layer_norm_weight / in_proj.layer_norm_weight]
linear-attention layers (`layer_types[i] == "linear_attention"`; `linear_attn.` -> `self_attention.`):
  in_proj_qkv [2 Dk + Dv, H], in_proj_z [Dv, H],    in_proj.weight: [qkv; z; b; a] rows, the order GatedDeltaNet's
  in_proj_b [Nv, H], in_proj_a [Nv, H]                forward splits (qkv keeps HF's [Q_all; K_all; V_all]: the conv's)
  conv1d.weight [2 Dk + Dv, 1, K], dt_bias, A_log     conv1d.weight, dt_bias, A_log (as they are)
  norm.weight [dv] (x * w: not zero-centered)         out_norm.weight (megatron_gdn.GatedOutNorm: x * w as well)
  out_proj.weight                                     out_proj.weight
full-attention layers:
  self_attn.q_proj [heads * 2 hd, H]: per head       self_attention.linear_qkv.weight, per query group g:
    [query_h; gate_h]; k_proj, v_proj                   [queries of g; gates of g; k_g; v_g] (attention_output_gate)
  self_attn.{q,k}_norm.weight                         self_attention.{q,k}_layernorm.weight
  self_attn.o_proj.weight                             self_attention.linear_proj.weight
MLP, post_attention_layernorm, embeddings, final norm, lm_head: dense.py's.

What makes megatron's layers HF's (tests/unit/models/test_qwen3_5_bridge.py checks each against HF in fp32,
with a control that drops it):
- zero-centered norms: HF's Qwen3_5RMSNorm is x * (1 + w) (input / post-attention / final norms, q/k norms);
  `layernorm_zero_centered_gamma` makes megatron_parallel.RMSNorm (and TE's norms) do the same, so the weights
  map as they are. The DeltaNet's gated norm is x * w: its megatron norm ignores the flag (GatedOutNorm).
- in_proj: GatedDeltaNet splits its output as [qkv; z; beta; alpha] and convolves qkv whole; HF convolves
  in_proj_qkv's [Q_all; K_all; V_all], so the four HF projections concatenate in that order. Both repeat a key
  head over consecutive value heads (repeat_interleave), take beta = sigmoid(b), g = -exp(A_log) softplus(a +
  dt_bias), l2-normalize q and k (eps 1e-6) and gate the norm's output with silu(z).
- the attention gate: megatron's `attention_output_gate` splits each query group's linear_qkv rows as
  [queries; gates; key; value] and multiplies the attention output by sigmoid(gate), as HF does with the second
  half of each head's q_proj rows.
- partial rotary: `partial_rotary_factor` -> GPTModel `rotary_percent`, as glm4_moe.py. HF's text positions are
  one M-RoPE section repeated, i.e. a plain rotary.

Layouts: TP with SP (base.tp_shard splits in_proj and conv1d part by part, rank-major: each rank its key /
value heads' rows of every part; megatron_weights.tp_parts reads the sizes off the layer), PP, DP; CP 1
(`Qwen35Bridge.layout_refusal`, which names why TP needs SP).
Batches reach GatedDeltaNet as right-padded rows (megatron_step.forward_chunk, never packed THD, which it refuses);
it ignores the attention mask, and the padding after a row's last token cannot reach the earlier (causal) tokens.
Refused by name (CheckpointError; preflight turns it into a ConfigError before Ray): attention_bias, hidden_act
other than silu, rope types other than default, layer types other than linear / full attention.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_platform.errors import CheckpointError
from miles_platform.models.bridge.base import hf_config_dict, register_bridge
from miles_platform.models.bridge.dense import (
    DenseBridge,
    Dims,
    _pad_rows,
    ends_to_hf,
    ends_to_megatron,
    take,
)

_LAYER_TYPES = ("linear_attention", "full_attention")
QWEN3_5_DEFAULT_PARTIAL_ROTARY = 0.25  # Qwen3_5TextConfig's default


class Qwen35Dims(Dims):
    """dense.py's attention fields (q/k norm, no biases), the layer kinds, the DeltaNet's shapes, the rotary."""

    def __init__(self, c: dict[str, Any], family: str):
        if c.get("attention_bias"):
            raise self.refuse(family, "attention_bias true (o_proj's bias has no megatron mapping here)")
        self.top_level_partial = c.get("partial_rotary_factor")  # older config.json files put it here
        super().__init__(c, family, qkv_bias=False, qk_norm=True)
        kinds = c.get("layer_types")
        if not kinds:
            n = int(c.get("full_attention_interval") or 4)
            kinds = ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(self.layers)]
        if len(kinds) != self.layers or set(kinds) - set(_LAYER_TYPES):
            raise self.refuse(family, f"layer_types {kinds} (one of {_LAYER_TYPES} per layer)")
        self.linear = [k == "linear_attention" for k in kinds]
        self.conv_kernel = int(c["linear_conv_kernel_dim"])
        self.dk, self.dv = int(c["linear_key_head_dim"]), int(c["linear_value_head_dim"])
        self.nk, self.nv = int(c["linear_num_key_heads"]), int(c["linear_num_value_heads"])
        if self.nv % self.nk:
            raise self.refuse(
                family, f"linear_num_value_heads {self.nv} not a multiple of linear_num_key_heads {self.nk}"
            )
        self.conv_dim = 2 * self.nk * self.dk + self.nv * self.dv

    @staticmethod
    def refuse(family: str, what: str) -> CheckpointError:
        return CheckpointError(
            f"{family} config: {what}; the megatron mapping cannot reproduce it: use --train-backend fsdp "
            "for this checkpoint"
        )

    def rope_scaling(self, rope: dict[str, Any]) -> None:
        """default rope with a partial rotary (`rotary_percent`); M-RoPE sections are one plain rotary on text."""
        if rope["rope_type"] != "default":
            raise self.refuse(self.family, f"rope_type {rope['rope_type']!r} (mapped: default)")
        partial = rope.get("partial_rotary_factor", self.top_level_partial)
        self.rotary_percent = float(QWEN3_5_DEFAULT_PARTIAL_ROTARY if partial is None else partial)
        if not 0.0 < self.rotary_percent <= 1.0:
            raise self.refuse(self.family, f"partial_rotary_factor {self.rotary_percent}")


@register_bridge("Qwen3_5ForCausalLM")
class Qwen35Bridge(DenseBridge):
    family = "Qwen3.5"
    # training/megatron_lora.py: the full-attention layers' q/k/v/o (q_proj's [query; gate] rows regrouped as
    # linear_qkv's), the MLPs and experts; the gated-DeltaNet projections (one fused megatron in_proj) take
    # none, as Miles' native LoRA (a target naming one is refused)
    lora_refusal = None
    qk_norm = True

    def dims(self, hf_config: Any) -> Qwen35Dims:
        return Qwen35Dims(hf_config_dict(hf_config), self.family)

    def layout_refusal(self, hf_config: dict[str, Any], layout: Any, *, step: bool = True) -> str | None:
        """CP 1; TP splits whole key / value heads of the DeltaNet, and a step at TP > 1 needs SP, under which
        megatron sums the TP ranks' partial gradients of the DeltaNet's output norm (megatron_gdn.GatedOutNorm)."""
        if layout.cp > 1:
            return (
                f"--context-parallel-size {layout.cp} with gated-DeltaNet layers (Qwen3.5 / Qwen3-Next): megatron-core "
                "0.16's GatedDeltaNet has no context parallelism; use CP 1 (tensor / sequence / data / pipeline "
                "parallel), or --train-backend fsdp"
            )
        nk, nv, tp = hf_config.get("linear_num_key_heads"), hf_config.get("linear_num_value_heads"), layout.tp
        if not nv or tp == 1:
            return None
        if int(nk) % tp or int(nv) % tp:
            return (
                f"--tensor-model-parallel-size {tp}: the gated-DeltaNet layers' {nk} key and {nv} value heads "
                "(linear_num_key_heads / linear_num_value_heads) must both divide by it"
            )
        if step and not layout.sp:
            return (
                f"gated-DeltaNet layers (Qwen3.5 / Qwen3-Next) at --tensor-model-parallel-size {tp} need --sequence-parallel: "
                "each TP rank normalizes its own value heads with the shared output norm, and megatron-core sums "
                "that norm's partial gradients over TP only for sequence-parallel weights"
            )
        return None

    def transformer_config(self, hf_config: Any) -> dict[str, Any]:
        d = self.dims(hf_config)
        return dict(
            super().transformer_config(hf_config),
            attention_output_gate=True,
            layernorm_zero_centered_gamma=True,
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=[int(x) for x in d.linear],
            linear_conv_kernel_dim=d.conv_kernel,
            linear_key_head_dim=d.dk,
            linear_value_head_dim=d.dv,
            linear_num_key_heads=d.nk,
            linear_num_value_heads=d.nv,
        )

    def gpt_model_kwargs(self, hf_config: Any, tensor_model_parallel_size: int = 1) -> dict[str, Any]:
        kw = super().gpt_model_kwargs(hf_config, tensor_model_parallel_size)
        return dict(kw, rotary_percent=self.dims(hf_config).rotary_percent)

    # ---- one decoder layer's attention, both ways

    def _gdn_shapes(self, d: Qwen35Dims) -> dict[str, tuple[int, ...]]:
        H = d.hidden
        return {
            "in_proj_qkv.weight": (d.conv_dim, H),
            "in_proj_z.weight": (d.nv * d.dv, H),
            "in_proj_b.weight": (d.nv, H),
            "in_proj_a.weight": (d.nv, H),
        }

    def in_proj_to_megatron(self, get, d: Qwen35Dims, h: str) -> list[torch.Tensor]:
        """A DeltaNet's in_proj parts in megatron's order, [Q_all; K_all; V_all], Z, B, A (Qwen3-Next: its fused ones)."""
        return [get(h + k, s) for k, s in self._gdn_shapes(d).items()]

    def in_proj_to_hf(self, parts: list[torch.Tensor], d: Qwen35Dims, h: str) -> dict[str, torch.Tensor]:
        """The inverse of `in_proj_to_megatron`: HF's tensors from [qkv, z, b, a]."""
        return {h + k: p for k, p in zip(self._gdn_shapes(d), parts, strict=True)}

    def _linear_to_megatron(self, get, d: Qwen35Dims, hp: str, mp: str) -> dict[str, torch.Tensor]:
        h, m = hp + "linear_attn.", mp + "self_attention."
        return {
            m + "in_proj.weight": torch.cat(self.in_proj_to_megatron(get, d, h), dim=0),  # [qkv; z; b; a]
            m + "conv1d.weight": get(h + "conv1d.weight", (d.conv_dim, 1, d.conv_kernel)),
            m + "dt_bias": get(h + "dt_bias", (d.nv,)),
            m + "A_log": get(h + "A_log", (d.nv,)),
            m + "out_norm.weight": get(h + "norm.weight", (d.dv,)),
            m + "out_proj.weight": get(h + "out_proj.weight", (d.hidden, d.nv * d.dv)),
        }

    def _linear_to_hf(self, get, d: Qwen35Dims, hp: str, mp: str) -> dict[str, torch.Tensor]:
        h, m = hp + "linear_attn.", mp + "self_attention."
        sizes = [d.conv_dim, d.nv * d.dv, d.nv, d.nv]
        parts = list(get(m + "in_proj.weight", (sum(sizes), d.hidden)).split(sizes, dim=0))
        out = self.in_proj_to_hf(parts, d, h)
        out.update({
            h + "conv1d.weight": get(m + "conv1d.weight", (d.conv_dim, 1, d.conv_kernel)),
            h + "dt_bias": get(m + "dt_bias", (d.nv,)),
            h + "A_log": get(m + "A_log", (d.nv,)),
            h + "norm.weight": get(m + "out_norm.weight", (d.dv,)),
            h + "out_proj.weight": get(m + "out_proj.weight", (d.hidden, d.nv * d.dv)),
        })  # fmt: skip
        return out

    def _full_to_megatron(self, get, d: Qwen35Dims, hp: str, mp: str) -> dict[str, torch.Tensor]:
        H, hd, g, qpg = d.hidden, d.head_dim, d.groups, d.q_per_group
        h, m = hp + "self_attn.", mp + "self_attention."
        # q_proj rows per head: [query; gate] -> per group [queries; gates]
        qg = get(h + "q_proj.weight", (2 * d.heads * hd, H)).reshape(g, qpg, 2, hd, H)
        q, gate = qg[:, :, 0].reshape(g, qpg * hd, H), qg[:, :, 1].reshape(g, qpg * hd, H)
        k = get(h + "k_proj.weight", (g * hd, H)).reshape(g, hd, H)
        v = get(h + "v_proj.weight", (g * hd, H)).reshape(g, hd, H)
        return {
            m + "linear_qkv.weight": torch.cat([q, gate, k, v], dim=1).reshape(-1, H),
            m + "q_layernorm.weight": get(h + "q_norm.weight", (hd,)),
            m + "k_layernorm.weight": get(h + "k_norm.weight", (hd,)),
            m + "linear_proj.weight": get(h + "o_proj.weight", (H, d.heads * hd)),
        }

    def _full_to_hf(self, get, d: Qwen35Dims, hp: str, mp: str) -> dict[str, torch.Tensor]:
        H, hd, g, qpg = d.hidden, d.head_dim, d.groups, d.q_per_group
        h, m = hp + "self_attn.", mp + "self_attention."
        qkv = get(m + "linear_qkv.weight", (g * (2 * qpg + 2) * hd, H)).reshape(g, (2 * qpg + 2) * hd, H)
        q, gate, k, v = qkv.split([qpg * hd, qpg * hd, hd, hd], dim=1)
        qg = torch.stack([q.reshape(g, qpg, hd, H), gate.reshape(g, qpg, hd, H)], dim=2)
        return {
            h + "q_proj.weight": qg.reshape(-1, H),
            h + "k_proj.weight": k.reshape(-1, H),
            h + "v_proj.weight": v.reshape(-1, H),
            h + "q_norm.weight": get(m + "q_layernorm.weight", (hd,)),
            h + "k_norm.weight": get(m + "k_layernorm.weight", (hd,)),
            h + "o_proj.weight": get(m + "linear_proj.weight", (H, d.heads * hd)),
        }

    # ---- whole state dicts

    def hf_to_megatron(self, hf_sd, config, *, fused_norms=False, padded_vocab_size=None):
        d = self.dims(config)
        where = "HF checkpoint"
        used: set[str] = set()

        def get(name, shape):
            used.add(name)
            return take(hf_sd, name, shape, where)

        H = d.hidden
        out = {"embedding.word_embeddings.weight": _pad_rows(get("model.embed_tokens.weight", (d.vocab, H)),
                                                             padded_vocab_size)}  # fmt: skip
        for i in range(d.layers):
            hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
            attn = self._linear_to_megatron if d.linear[i] else self._full_to_megatron
            out.update(attn(get, d, hp, mp))
            out.update(self.mlp_to_megatron(hf_sd, get, d, hp, mp, i))
            fused_in = mp + ("self_attention.in_proj.layer_norm_weight" if d.linear[i]
                             else "self_attention.linear_qkv.layer_norm_weight")  # fmt: skip
            out[fused_in if fused_norms else mp + "input_layernorm.weight"] = get(
                hp + "input_layernorm.weight", (H,)
            )
            fused_mlp = fused_norms and self.mlp_norm_fuses(d, i)  # an MoE layer's router reads the norm
            mlp_norm = mp + ("mlp.linear_fc1.layer_norm_weight" if fused_mlp else "pre_mlp_layernorm.weight")
            out[mlp_norm] = get(hp + "post_attention_layernorm.weight", (H,))
        return ends_to_megatron(out, hf_sd, get, used, d, padded_vocab_size, where, lambda k: False)

    def megatron_to_hf_part(self, mcore_sd, config, unit: tuple[int, int]) -> dict[str, torch.Tensor]:
        d = self.dims(config)
        H = d.hidden

        def get(name, shape):
            return take(mcore_sd, name, shape, "megatron state")

        def norm(fused: str, local: str):
            return get(fused if fused in mcore_sd else local, (H,))

        kind, i = unit
        if kind != 1:
            out = ends_to_hf(mcore_sd, kind, d.vocab, H, d.tied)
        else:
            hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
            out = (self._linear_to_hf if d.linear[i] else self._full_to_hf)(get, d, hp, mp)
            out.update(self.mlp_to_hf(get, d, hp, mp, i))
            fused_in = "in_proj.layer_norm_weight" if d.linear[i] else "linear_qkv.layer_norm_weight"
            out[hp + "input_layernorm.weight"] = norm(
                mp + "self_attention." + fused_in, mp + "input_layernorm.weight"
            )
            out[hp + "post_attention_layernorm.weight"] = norm(
                mp + "mlp.linear_fc1.layer_norm_weight", mp + "pre_mlp_layernorm.weight"
            )
        return {k: v.contiguous() for k, v in out.items()}
