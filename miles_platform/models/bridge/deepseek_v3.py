"""DeepSeek-V3 <-> megatron-core GPTModel: MLA attention (`MLATransformerConfig`, the layer spec's
`multi_latent_attention=True`) and DeepSeek's MoE, at any expert and tensor parallel size.

Tensor parallel: the up projections (`linear_q_up_proj` / `linear_q_proj`, `linear_kv_up_proj`) split whole
heads' rows, `linear_proj` their columns; the latent down projections and norms are whole on every rank, in TE's
spec (duplicated TELinear) and in the local one (`adapt_layer_spec`: training/megatron_mla.py's
DuplicatedLinear, where it says why), with --sequence-parallel (the shared rope key's gradient is summed over
the heads' ranks on that path only).

HF (module names)                                    megatron (local spec; TE spec name in brackets)
model.layers.i.self_attn.q_a_proj.weight             decoder.layers.i.self_attention.linear_q_down_proj.weight
model.layers.i.self_attn.q_a_layernorm.weight        decoder.layers.i.self_attention.q_layernorm.weight
                                                       [decoder.layers.i.self_attention.linear_q_up_proj.layer_norm_weight]
model.layers.i.self_attn.q_b_proj.weight             decoder.layers.i.self_attention.linear_q_up_proj.weight
model.layers.i.self_attn.q_proj.weight (q_lora_rank null) decoder.layers.i.self_attention.linear_q_proj.weight
model.layers.i.self_attn.kv_a_proj_with_mqa.weight   decoder.layers.i.self_attention.linear_kv_down_proj.weight
model.layers.i.self_attn.kv_a_layernorm.weight       decoder.layers.i.self_attention.kv_layernorm.weight
                                                       [decoder.layers.i.self_attention.linear_kv_up_proj.layer_norm_weight]
model.layers.i.self_attn.kv_b_proj.weight            decoder.layers.i.self_attention.linear_kv_up_proj.weight
model.layers.i.self_attn.o_proj.weight               decoder.layers.i.self_attention.linear_proj.weight
input_layernorm / post_attention_layernorm, embeddings, final norm, lm_head: as models/bridge/dense.py
(the TE spec keeps input_layernorm apart; it fuses a dense layer's post_attention_layernorm into
linear_fc1 and keeps an MoE layer's as pre_mlp_layernorm, which the router reads).

Layers i < first_k_dense_replace are dense (`intermediate_size`; megatron's `moe_layer_freq` list
has 0 there): mlp.{gate,up,down}_proj as dense.py. The others are MoE blocks:
model.layers.i.mlp.gate.weight                       decoder.layers.i.mlp.router.weight
model.layers.i.mlp.gate.e_score_correction_bias      decoder.layers.i.mlp.router.expert_bias (a buffer on both sides)
model.layers.i.mlp.experts.*                         decoder.layers.i.mlp.experts.local_experts.e.* (as qwen3_moe.py)
model.layers.i.mlp.shared_experts.{gate,up}_proj     decoder.layers.i.mlp.shared_experts.linear_fc1.weight ([gate; up])
model.layers.i.mlp.shared_experts.down_proj          decoder.layers.i.mlp.shared_experts.linear_fc2.weight

Q/K/V row layouts are the same on both sides: q_b_proj per head [nope; rope] (megatron qk_head_dim then
qk_pos_emb_head_dim), kv_a_proj_with_mqa [kv latent; rope key], kv_b_proj per head [k nope; v].

RoPE: megatron's MLA always reads the rope dims as interleaved pairs (x0, x1), (x2, x3), ...
(rope_utils: `multi_latent_attention` takes t[0::2], t[1::2] and rotates them as halves), which is
HF's `rope_interleave=True` (DeepSeek's checkpoints; transformers' default) exactly, so those rows map
as they are. With `rope_interleave=False` HF rotates pairs (j, j + d/2): the rope rows of q_b_proj /
q_proj and kv_a_proj_with_mqa are permuted to [0, d/2, 1, d/2 + 1, ...] on the way in (and back on
the way out), which makes megatron's pairs HF's. rope_type default maps to megatron `rope_type="rope"`;
yarn (DeepSeek-V3 / R1 / Kimi-K2 as published) to `rope_type="yarn"` with the same factor, original
context, beta_fast / beta_slow and mscale / mscale_all_dim (HF's attention factor and softmax scale).

Routing (HF `DeepseekV3TopkRouter`): sigmoid scores; the score-correction bias is added for the choice
only (`moe_router_score_function="sigmoid"`, `moe_router_enable_expert_bias`, the bias loaded into
`expert_bias` and kept: `moe_router_bias_update_rate=0`, as HF's model never updates it); group-limited
top-k (`n_group` / `topk_group` -> `moe_router_num_groups` / `moe_router_group_topk`: both rank a
group by the sum of its top-2 biased scores, megatron by top-(topk / group_topk), so topk = 2 x
topk_group is required); gates renormalized (`norm_topk_prob`: megatron's sigmoid path always
renormalizes at top-k > 1) times `routed_scaling_factor` (`moe_router_topk_scaling_factor`).

Refused by name (CheckpointError; preflight turns it into a ConfigError before Ray): hidden_act other
than silu, attention_bias, norm_topk_prob false or top-1 routing, topk != 2 x topk_group under
group-limited routing, n_shared_experts 0, partial rotary, rope types other than default / yarn, a yarn
config megatron's YarnRotaryEmbedding cannot reproduce (explicit attention_factor, truncate false,
mscale_all_dim without mscale). The MTP layers of a published checkpoint are dropped (transformers does
too); megatron builds none (`mtp_num_layers` unset).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from miles_platform.errors import CheckpointError
from miles_platform.models.bridge.base import Bridge, hf_config_dict, padded_vocab, register_bridge
from miles_platform.models.bridge.dense import (
    _pad_rows,
    ends_to_hf,
    ends_to_megatron,
    rope_params,
    take,
    yarn_fields,
)
from miles_platform.models.bridge.qwen3_moe import experts_to_hf, experts_to_megatron

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MLP_KINDS = ("dense", "sparse")  # mlp_layer_types (GLM-4.7-Flash)


class DeepseekMoe:
    """DeepSeek's MoE fields of a config (DeepSeek-V3, GLM-4.7-Flash, GLM-4.5: sigmoid routing with the
    score-correction bias, group-limited top-k, shared experts, dense first layers), checked against
    what megatron's router reproduces."""

    def __init__(self, c: dict[str, Any], family: str):
        self.family = family
        self.layers = c["num_hidden_layers"]
        self.experts = int(c["n_routed_experts"])
        self.top_k = int(c["num_experts_per_tok"])
        self.moe_ffn = int(c["moe_intermediate_size"])
        self.shared = int(c.get("n_shared_experts") or 0)
        kinds = c.get("mlp_layer_types")  # GLM-4.7-Flash; DeepSeek: the first first_k_dense_replace dense
        if kinds is None:
            kinds = [
                "dense" if i < int(c.get("first_k_dense_replace") or 0) else "sparse"
                for i in range(self.layers)
            ]
        if len(kinds) != self.layers or set(kinds) - set(_MLP_KINDS):
            raise self.refuse(f"mlp_layer_types {kinds} (one of {_MLP_KINDS} per layer)")
        self.moe_layers = [k == "sparse" for k in kinds]
        self.scaling = float(c.get("routed_scaling_factor", 1.0))
        n_group, topk_group = int(c.get("n_group") or 1), int(c.get("topk_group") or 1)
        # group selection that keeps every group is no selection (megatron: no group-limited routing)
        self.groups = (n_group, topk_group) if 1 < n_group and topk_group < n_group else None
        if c.get("hidden_act", "silu") != "silu":
            raise self.refuse(f"hidden_act {c['hidden_act']!r} (the bridge maps silu)")
        if not c.get("norm_topk_prob", True) or self.top_k < 2:
            raise self.refuse(
                f"norm_topk_prob {c.get('norm_topk_prob')} with num_experts_per_tok {self.top_k} "
                "(megatron's sigmoid router renormalizes the gates exactly when top-k > 1)"
            )
        if self.top_k > self.experts:
            raise self.refuse(f"num_experts_per_tok {self.top_k} > n_routed_experts {self.experts}")
        if self.groups and (self.experts % n_group or self.top_k != 2 * topk_group):
            raise self.refuse(
                f"n_group {n_group} / topk_group {topk_group} with {self.experts} experts, top-{self.top_k} "
                "(HF ranks a group by its top-2 scores, megatron by its top-(topk / topk_group): topk must "
                "be 2 x topk_group, the experts divide into the groups)"
            )
        if self.shared < 1:
            raise self.refuse("n_shared_experts 0 (megatron's layer here has a shared expert)")

    def moe_layer(self, i: int) -> bool:
        return self.moe_layers[i]

    def refuse(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"{self.family} config: {what}; the megatron mapping cannot reproduce it: use --train-backend fsdp "
            "for this checkpoint"
        )

    def moe_config(self) -> dict[str, Any]:
        """TransformerConfig's MoE fields: the routing above, no load-balancing loss inside the model."""
        return dict(
            num_moe_experts=self.experts, moe_router_topk=self.top_k, moe_ffn_hidden_size=self.moe_ffn,
            moe_layer_freq=[int(self.moe_layer(i)) for i in range(self.layers)],
            moe_shared_expert_intermediate_size=self.moe_ffn * self.shared,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0, moe_router_pre_softmax=False,
            moe_router_num_groups=self.groups[0] if self.groups else None,
            moe_router_group_topk=self.groups[1] if self.groups else None,
            moe_router_topk_scaling_factor=self.scaling,
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_permute_fusion=False,
            moe_router_fusion=False,
        )  # fmt: skip


class DeepseekDims(DeepseekMoe):
    """The DeepSeek-V3 config fields the mapping needs, checked against what megatron reproduces."""

    def __init__(self, hf_config: Any, family: str = "DeepSeek-V3"):
        c = hf_config_dict(hf_config)
        super().__init__(c, family)
        self.hidden = c["hidden_size"]
        self.heads, self.vocab, self.ffn = c["num_attention_heads"], c["vocab_size"], c["intermediate_size"]
        self.tied = bool(c.get("tie_word_embeddings", False))
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.max_pos = c.get("max_position_embeddings", 4096)
        self.q_lora = c.get("q_lora_rank")  # None: one q_proj (DeepSeek-V2-Lite, Moonlight)
        self.kv_lora = int(c["kv_lora_rank"])
        self.nope, self.rope, self.v = (
            int(c["qk_nope_head_dim"]),
            int(c["qk_rope_head_dim"]),
            int(c["v_head_dim"]),
        )
        self.rope_interleave = bool(c.get("rope_interleave", True))
        if c.get("attention_bias"):
            raise self.refuse("attention_bias = true (q_a / kv_a / o_proj biases)")
        self.rope_config = self._rope(c)

    def _rope(self, c: dict[str, Any]) -> dict[str, Any]:
        """MLATransformerConfig's rope fields for HF's rope parameters."""
        r = rope_params(c)
        if float(r.get("partial_rotary_factor", 1.0)) != 1.0:
            raise self.refuse(f"partial_rotary_factor {r['partial_rotary_factor']}")
        base = float(r["rope_theta"])
        if r["rope_type"] == "default":
            return dict(rope_type="rope", rotary_base=base, rotary_scaling_factor=1.0, mscale_all_dim=0.0)
        if r["rope_type"] != "yarn":
            raise self.refuse(f"rope_type {r['rope_type']!r} (mapped: default, yarn)")
        y = yarn_fields(r, self.max_pos)
        mscale, all_dim = r.get("mscale"), r.get("mscale_all_dim")
        if r.get("attention_factor") is not None or r.get("truncate", True) is False:
            raise self.refuse(
                "yarn with attention_factor / truncate = false (megatron derives / truncates them)"
            )
        if all_dim and not mscale:  # HF: attention factor get_mscale(factor); megatron: a ratio with all_dim
            raise self.refuse("yarn with mscale_all_dim but no mscale")
        return dict(
            rope_type="yarn", rotary_base=base, rotary_scaling_factor=y["factor"],
            original_max_position_embeddings=y["original"], beta_fast=y["beta_fast"], beta_slow=y["beta_slow"],
            mscale=float(mscale) if all_dim else 1.0, mscale_all_dim=float(all_dim or 0.0),
        )  # fmt: skip

    @property
    def q_head(self) -> int:
        return self.nope + self.rope


def rope_row_order(d: DeepseekDims) -> torch.Tensor | None:
    """Megatron row j of a head's rope part is HF row order[j]; None where the layouts agree."""
    if d.rope_interleave:
        return None
    half = torch.arange(d.rope // 2)
    return torch.stack([half, half + d.rope // 2], dim=1).reshape(-1)


def permute_head_rows(w: torch.Tensor, order: torch.Tensor, heads: int) -> torch.Tensor:
    """`w`'s rows as `heads` equal blocks, each block's rows taken in `order` (an index built on the
    CPU, moved to `w`'s device: the trainer maps states on the rank's device)."""
    return w.reshape(heads, len(order), *w.shape[1:])[:, order.to(w.device)].reshape(w.shape)


def _permute_rope(w: torch.Tensor, d: DeepseekDims, order: torch.Tensor | None, heads: int, lead: int):
    """`w`'s rows as `heads` blocks of [lead rows; rope rows], the rope rows taken in `order`."""
    if order is None:
        return w
    return permute_head_rows(w, torch.cat([torch.arange(lead), lead + order]), heads)


@register_bridge("DeepseekV3ForCausalLM")
class DeepseekV3Bridge(Bridge):
    family = "DeepSeek-V3"
    # TE's MLA spec fuses the q latent's norm into linear_q_up_proj (DeepSeek-V3.2 keeps it apart)
    te_fuses_q_norm = True
    lora_refusal = None  # training/megatron_lora.py: MLA's projections, dense MLPs, shared and routed experts

    def dims(self, hf_config: Any) -> DeepseekDims:
        return DeepseekDims(hf_config, self.family)

    def transformer_config(self, hf_config: Any) -> dict[str, Any]:
        d = self.dims(hf_config)
        return dict(
            num_layers=d.layers, hidden_size=d.hidden, ffn_hidden_size=d.ffn, num_attention_heads=d.heads,
            num_query_groups=d.heads, kv_channels=d.v,  # the local core attention's value width
            normalization="RMSNorm", layernorm_epsilon=d.eps, gated_linear_unit=True,
            activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
            qk_layernorm=True,  # MLA: the q / kv latent norms
            multi_latent_attention=True, q_lora_rank=d.q_lora, kv_lora_rank=d.kv_lora, qk_head_dim=d.nope,
            qk_pos_emb_head_dim=d.rope, v_head_dim=d.v, **d.rope_config,
            hidden_dropout=0.0, attention_dropout=0.0,
            # fused kernels are CUDA/TE-only or change rounding; the torch paths match HF in fp32
            bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
            persist_layer_norm=False, gradient_accumulation_fusion=False,
            **d.moe_config(),
        )  # fmt: skip

    def gpt_model_kwargs(self, hf_config: Any, tensor_model_parallel_size: int = 1) -> dict[str, Any]:
        d = self.dims(hf_config)
        return dict(
            vocab_size=padded_vocab(d.vocab, tensor_model_parallel_size),
            max_sequence_length=d.max_pos,
            position_embedding_type="rope",  # GPTModel leaves RoPE to the MLA layers
            rotary_base=d.rope_config["rotary_base"],
            share_embeddings_and_output_weights=d.tied,
        )

    def layout_refusal(self, hf_config: dict[str, Any], layout: Any, *, step: bool = True) -> str | None:
        if step and layout.tp > 1 and not layout.sp:
            return (
                f"--tensor-model-parallel-size {layout.tp} with multi-latent attention needs --sequence-parallel: "
                "megatron-core's MLA sums the shared rope key's gradient over the heads' TP ranks on that path only "
                "(training/megatron_mla.py)"
            )
        return None

    def adapt_layer_spec(self, spec: Any, use_te: bool) -> Any:
        """The local spec's latent down projections duplicated, as TE's (training/megatron_mla.py)."""
        if use_te:
            return spec
        from miles_platform.training.megatron_mla import duplicated_down_projections

        return duplicated_down_projections(spec)

    def layer_spec_kwargs(self, hf_config: Any) -> dict[str, Any]:
        """The MoE layers' spec; megatron_parallel builds the dense layers' without `num_experts`."""
        d = self.dims(hf_config)
        return dict(
            qk_layernorm=True, multi_latent_attention=True, num_experts=d.experts, moe_grouped_gemm=False
        )

    def hf_to_megatron(self, hf_sd, config, *, fused_norms=False, padded_vocab_size=None):
        d = self.dims(config)
        used: set[str] = set()

        def get(name, shape):
            used.add(name)
            return take(hf_sd, name, shape, "HF checkpoint")

        H = d.hidden
        out = {
            "embedding.word_embeddings.weight": _pad_rows(
                get("model.embed_tokens.weight", (d.vocab, H)), padded_vocab_size
            )
        }
        for i in range(d.layers):
            out.update(self._layer_to_megatron(hf_sd, get, d, i, fused_norms))
        unmapped = lambda k: mtp_layer(k, d.layers)  # noqa: E731
        return ends_to_megatron(out, hf_sd, get, used, d, padded_vocab_size, "HF checkpoint", unmapped)

    def _layer_to_megatron(self, hf_sd, get, d: DeepseekDims, i: int, fused: bool) -> dict[str, torch.Tensor]:
        H, n, order = d.hidden, d.heads, rope_row_order(d)
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        a, sa = hp + "self_attn.", mp + "self_attention."
        out: dict[str, torch.Tensor] = {}
        if d.q_lora is None:
            q = get(a + "q_proj.weight", (n * d.q_head, H))
            out[sa + "linear_q_proj.weight"] = _permute_rope(q, d, order, n, d.nope)
        else:
            out[sa + "linear_q_down_proj.weight"] = get(a + "q_a_proj.weight", (d.q_lora, H))
            q_norm = (
                "linear_q_up_proj.layer_norm_weight"
                if fused and self.te_fuses_q_norm
                else "q_layernorm.weight"
            )
            out[sa + q_norm] = get(a + "q_a_layernorm.weight", (d.q_lora,))
            q = get(a + "q_b_proj.weight", (n * d.q_head, d.q_lora))
            out[sa + "linear_q_up_proj.weight"] = _permute_rope(q, d, order, n, d.nope)
        kv_a = get(a + "kv_a_proj_with_mqa.weight", (d.kv_lora + d.rope, H))
        out[sa + "linear_kv_down_proj.weight"] = _permute_rope(kv_a, d, order, 1, d.kv_lora)
        kv_norm = "linear_kv_up_proj.layer_norm_weight" if fused else "kv_layernorm.weight"
        out[sa + kv_norm] = get(a + "kv_a_layernorm.weight", (d.kv_lora,))
        out[sa + "linear_kv_up_proj.weight"] = get(a + "kv_b_proj.weight", (n * (d.nope + d.v), d.kv_lora))
        out[sa + "linear_proj.weight"] = get(a + "o_proj.weight", (H, n * d.v))
        out[mp + "input_layernorm.weight"] = get(hp + "input_layernorm.weight", (H,))
        mlp_norm = get(hp + "post_attention_layernorm.weight", (H,))
        if not d.moe_layer(i):
            out[mp + ("mlp.linear_fc1.layer_norm_weight" if fused else "pre_mlp_layernorm.weight")] = mlp_norm
            out.update(_gated_to_megatron(get, hp + "mlp.", mp + "mlp.", d.ffn, H))
            return out
        out[mp + "pre_mlp_layernorm.weight"] = mlp_norm
        out.update(moe_to_megatron(hf_sd, get, d, H, hp, mp))
        return out

    def megatron_to_hf_part(self, mcore_sd, config, unit: tuple[int, int]) -> dict[str, torch.Tensor]:
        d = self.dims(config)
        H, V = d.hidden, d.vocab

        def get(name, shape):
            return take(mcore_sd, name, shape, "megatron state")

        kind, i = unit
        out = (
            ends_to_hf(mcore_sd, kind, V, H, d.tied) if kind != 1 else self._layer_to_hf(mcore_sd, get, d, i)
        )
        return {k: v.contiguous() for k, v in out.items()}

    def _layer_to_hf(self, mcore_sd, get, d: DeepseekDims, i: int) -> dict[str, torch.Tensor]:
        H, n, order = d.hidden, d.heads, rope_row_order(d)
        inverse = None if order is None else torch.argsort(order)
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        a, sa = hp + "self_attn.", mp + "self_attention."

        def either(fused: str, local: str, shape):
            return get(fused if fused in mcore_sd else local, shape)

        out: dict[str, torch.Tensor] = {}
        if d.q_lora is None:
            q = get(sa + "linear_q_proj.weight", (n * d.q_head, H))
            out[a + "q_proj.weight"] = _permute_rope(q, d, inverse, n, d.nope)
        else:
            out[a + "q_a_proj.weight"] = get(sa + "linear_q_down_proj.weight", (d.q_lora, H))
            out[a + "q_a_layernorm.weight"] = either(
                sa + "linear_q_up_proj.layer_norm_weight", sa + "q_layernorm.weight", (d.q_lora,)
            )
            q = get(sa + "linear_q_up_proj.weight", (n * d.q_head, d.q_lora))
            out[a + "q_b_proj.weight"] = _permute_rope(q, d, inverse, n, d.nope)
        kv_a = get(sa + "linear_kv_down_proj.weight", (d.kv_lora + d.rope, H))
        out[a + "kv_a_proj_with_mqa.weight"] = _permute_rope(kv_a, d, inverse, 1, d.kv_lora)
        out[a + "kv_a_layernorm.weight"] = either(
            sa + "linear_kv_up_proj.layer_norm_weight", sa + "kv_layernorm.weight", (d.kv_lora,)
        )
        out[a + "kv_b_proj.weight"] = get(sa + "linear_kv_up_proj.weight", (n * (d.nope + d.v), d.kv_lora))
        out[a + "o_proj.weight"] = get(sa + "linear_proj.weight", (H, n * d.v))
        out[hp + "input_layernorm.weight"] = get(mp + "input_layernorm.weight", (H,))
        out[hp + "post_attention_layernorm.weight"] = either(
            mp + "mlp.linear_fc1.layer_norm_weight", mp + "pre_mlp_layernorm.weight", (H,)
        )
        if not d.moe_layer(i):
            out.update(_gated_to_hf(get, hp + "mlp.", mp + "mlp.", d.ffn, H))
            return out
        out.update(moe_to_hf(get, d, H, hp, mp))
        return out


def mtp_layer(name: str, num_layers: int) -> bool:
    """A published checkpoint's multi-token-prediction layer (`model.layers.<num_hidden_layers + k>.*`),
    which transformers drops on load and megatron does not build."""
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= num_layers


def moe_to_megatron(hf_sd, get, m: DeepseekMoe, H: int, hp: str, mp: str) -> dict[str, torch.Tensor]:
    """One DeepSeek MoE block (HF `hp` layer prefix -> megatron `mp`): router, its score-correction
    bias, routed experts, shared experts; `get(name, shape)` takes a tensor."""
    out = {
        mp + "mlp.router.weight": get(hp + "mlp.gate.weight", (m.experts, H)),
        mp + "mlp.router.expert_bias": get(hp + "mlp.gate.e_score_correction_bias", (m.experts,)),
    }
    out.update(experts_to_megatron(hf_sd, get, m.experts, H, m.moe_ffn, hp, mp))
    shared = m.moe_ffn * m.shared
    out.update(_gated_to_megatron(get, hp + "mlp.shared_experts.", mp + "mlp.shared_experts.", shared, H))
    return out


def moe_to_hf(get, m: DeepseekMoe, H: int, hp: str, mp: str) -> dict[str, torch.Tensor]:
    """The inverse of `moe_to_megatron`, into transformers' module names."""
    out = {
        hp + "mlp.gate.weight": get(mp + "mlp.router.weight", (m.experts, H)),
        hp + "mlp.gate.e_score_correction_bias": get(mp + "mlp.router.expert_bias", (m.experts,)),
    }
    out.update(experts_to_hf(get, m.experts, H, m.moe_ffn, hp, mp))
    shared = m.moe_ffn * m.shared
    out.update(_gated_to_hf(get, hp + "mlp.shared_experts.", mp + "mlp.shared_experts.", shared, H))
    return out


def _gated_to_megatron(get, hp: str, mp: str, ffn: int, H: int) -> dict[str, torch.Tensor]:
    """A SwiGLU MLP (`hp` = its HF prefix with the dot): gate / up -> linear_fc1 [gate; up], down -> fc2."""
    fc1 = torch.cat([get(hp + "gate_proj.weight", (ffn, H)), get(hp + "up_proj.weight", (ffn, H))])
    return {mp + "linear_fc1.weight": fc1, mp + "linear_fc2.weight": get(hp + "down_proj.weight", (H, ffn))}


def _gated_to_hf(get, hp: str, mp: str, ffn: int, H: int) -> dict[str, torch.Tensor]:
    gate, up = get(mp + "linear_fc1.weight", (2 * ffn, H)).chunk(2, dim=0)
    return {
        hp + "gate_proj.weight": gate,
        hp + "up_proj.weight": up,
        hp + "down_proj.weight": get(mp + "linear_fc2.weight", (H, ffn)),
    }
