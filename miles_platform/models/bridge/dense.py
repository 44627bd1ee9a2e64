"""Dense decoder-only HF models (Qwen3, Qwen2, Llama) <-> megatron-core GPTModel.

HF                                            megatron (local spec; TE spec name in brackets)
model.embed_tokens.weight                     embedding.word_embeddings.weight
model.layers.i.input_layernorm.weight         decoder.layers.i.input_layernorm.weight
                                                [decoder.layers.i.self_attention.linear_qkv.layer_norm_weight]
model.layers.i.self_attn.{q,k,v}_proj.weight  decoder.layers.i.self_attention.linear_qkv.weight
model.layers.i.self_attn.{q,k,v}_proj.bias    decoder.layers.i.self_attention.linear_qkv.bias  (qkv_bias)
model.layers.i.self_attn.{q,k}_norm.weight    decoder.layers.i.self_attention.{q,k}_layernorm.weight (qk_norm)
model.layers.i.self_attn.o_proj.weight        decoder.layers.i.self_attention.linear_proj.weight
model.layers.i.post_attention_layernorm.weight decoder.layers.i.pre_mlp_layernorm.weight
                                                [decoder.layers.i.mlp.linear_fc1.layer_norm_weight]
model.layers.i.mlp.{gate,up}_proj.weight      decoder.layers.i.mlp.linear_fc1.weight  ([gate; up])
model.layers.i.mlp.down_proj.weight           decoder.layers.i.mlp.linear_fc2.weight
model.norm.weight                             decoder.final_layernorm.weight
lm_head.weight (untied only)                  output_layer.weight (untied only)

linear_qkv rows (and its bias) are grouped per query group g: [q heads of g (q_per_group*head_dim);
k_g (head_dim); v_g (head_dim)], which is what lets TP split it on dim 0 by whole groups.

RoPE: `rope_type` default, or llama3 (Llama 3.1+) with megatron's built-in scaling, whose
low/high frequency factors and original context are fixed at Llama's 1 / 4 / 8192; a config that
asks for anything else is refused by name rather than served with other frequencies.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_platform.errors import CheckpointError
from miles_platform.models.bridge.base import Bridge, hf_config_dict, padded_vocab

_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
# megatron-core RotaryEmbedding._apply_scaling's fixed llama3 parameters
MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def ends_to_megatron(out, hf_sd, get, used: set[str], d, padded_vocab_size, where: str, unmapped):
    """The end of every decoder's `hf_to_megatron`: the final norm and (untied) the output layer
    into `out`, then a refusal of any HF tensor no mapping took (`get` records what it takes in
    `used`; `unmapped(name)`: tensors a bridge drops on purpose, e.g. MTP layers). Returns `out`."""
    H = d.hidden
    out["decoder.final_layernorm.weight"] = get("model.norm.weight", (H,))
    if not d.tied:
        out["output_layer.weight"] = _pad_rows(get("lm_head.weight", (d.vocab, H)), padded_vocab_size)
    else:
        used.add("lm_head.weight")  # tied copies, if saved, are the embedding
    extra = [k for k in hf_sd if k not in used and not k.endswith(_IGNORED_HF_SUFFIXES) and not unmapped(k)]
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor(s) for this config: {sorted(extra)[:5]}")
    return out


def ends_to_hf(mcore_sd, kind: int, V: int, H: int, tied: bool) -> dict[str, torch.Tensor]:
    """Units (0, 0) and (2, 0) of `megatron_to_hf_part`, the same for every decoder: the embedding, or
    the final norm and (untied) the output layer; the vocab's padding rows dropped."""

    def vocab_rows(name):
        t = mcore_sd.get(name)
        if t is None:
            raise CheckpointError(f"megatron state: missing tensor {name!r}")
        if t.dim() != 2 or t.shape[1] != H or t.shape[0] < V:
            raise CheckpointError(
                f"megatron state: tensor {name!r} has shape {tuple(t.shape)}, config expects ({V}, {H})"
            )
        return t[:V]

    if kind == 0:
        return {"model.embed_tokens.weight": vocab_rows("embedding.word_embeddings.weight")}
    out = {"model.norm.weight": take(mcore_sd, "decoder.final_layernorm.weight", (H,), "megatron state")}
    if not tied:
        out["lm_head.weight"] = vocab_rows("output_layer.weight")
    return out


def checked_rotary_percent(percent: float, head_dim: int, refuse) -> float:
    """A partial rotary's fraction of each head (megatron's `rotary_percent`): in (0, 1] and an even number
    of rotated dims, else `refuse(what)` is raised (GLM-4.5, MiniMax-M2)."""
    if not 0.0 < percent <= 1.0 or int(head_dim * percent) % 2:
        raise refuse(
            f"partial_rotary_factor {percent} of head_dim {head_dim} (an even number of rotated dims, at most head_dim)"
        )
    return percent


def rope_params(c: dict[str, Any]) -> dict[str, Any]:
    """rope_theta + scaling of a config.json dict: transformers 5 writes `rope_parameters`, older
    checkpoints (Llama 3.x as published) `rope_theta` + `rope_scaling`."""
    out = dict(c.get("rope_scaling") or {})
    out.update(c.get("rope_parameters") or {})
    out.setdefault("rope_theta", c.get("rope_theta") or 10000.0)
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    return out


class Dims:
    """The HF config fields the mapping needs, checked against what megatron can represent."""

    def __init__(self, hf_config: Any, family: str, qkv_bias: bool, qk_norm: bool = False):
        c = hf_config_dict(hf_config)
        self.family = family
        self.qkv_bias = qkv_bias
        self.qk_norm = qk_norm  # per-head RMSNorm on q and k (Qwen3; GLM-4.5 with use_qk_norm)
        self.hidden = c["hidden_size"]
        self.layers = c["num_hidden_layers"]
        self.heads = c["num_attention_heads"]
        self.groups = c.get("num_key_value_heads") or self.heads
        self.head_dim = c.get("head_dim") or self.hidden // self.heads
        self.ffn = c["intermediate_size"]
        self.vocab = c["vocab_size"]
        self.tied = bool(c.get("tie_word_embeddings", False))
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.max_pos = c.get("max_position_embeddings", 4096)
        rope = rope_params(c)
        self.rope_theta = rope["rope_theta"]
        self.rope_scaling_factor: float | None = None
        self.rope_scaling(rope)
        if c.get("hidden_act", "silu") != "silu":
            raise CheckpointError(
                f"{family} config: hidden_act {c['hidden_act']!r}; the bridge maps silu: use --train-backend fsdp "
                "for this checkpoint"
            )
        if self.heads % self.groups:
            raise CheckpointError(
                f"{family} config: num_attention_heads {self.heads} not divisible by num_key_value_heads {self.groups}"
            )
        self.q_per_group = self.heads // self.groups

    def rope_scaling(self, rope: dict[str, Any]) -> None:
        """The rope scaling of `rope_params`: default, or llama3 with megatron's fixed parameters
        (`rope_scaling_factor`); a family with other rope types overrides this."""
        if rope["rope_type"] == "llama3":
            fixed = {k: rope.get(k) for k in MEGATRON_LLAMA3_ROPE}
            if fixed != MEGATRON_LLAMA3_ROPE:
                raise CheckpointError(
                    f"{self.family} config: llama3 rope with {fixed}; the megatron backend supports "
                    f"{MEGATRON_LLAMA3_ROPE} (Llama 3.1-3.3); use --train-backend fsdp for this checkpoint"
                )
            self.rope_scaling_factor = float(rope["factor"])
        elif rope["rope_type"] != "default":
            raise CheckpointError(
                f"{self.family} config: rope_type {rope['rope_type']!r} has no megatron mapping (supported: "
                "default, llama3); use --train-backend fsdp for this checkpoint"
            )


def yarn_fields(rope: dict[str, Any], max_pos: int) -> dict[str, float]:
    """A yarn `rope_params`' factor (HF's default: the context over the original one), original context
    and beta_fast / beta_slow (HF's defaults 32 / 1), as transformers' `_compute_yarn_parameters` reads them."""
    original = int(rope["original_max_position_embeddings"])
    return dict(
        factor=float(rope.get("factor") or max_pos / original),
        original=original,
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
    )


def take(sd: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], where: str) -> torch.Tensor:
    if name not in sd:
        raise CheckpointError(f"{where}: missing tensor {name!r}")
    t = sd[name]
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(
            f"{where}: tensor {name!r} has shape {tuple(t.shape)}, config expects {tuple(shape)}"
        )
    return t


class DenseBridge(Bridge):
    """A dense GQA decoder with SwiGLU MLP and RMSNorm; subclasses name the family's differences."""

    family = "dense"
    lora_refusal = None  # training/megatron_lora.py maps these projections (and Qwen3-MoE's experts)
    qk_norm = False  # per-head RMSNorm on q and k (Qwen3)

    def qkv_bias(self, c: dict[str, Any]) -> bool:
        """Whether q/k/v projections carry biases; refuse what megatron's GPT layer cannot hold."""
        if c.get("attention_bias") or c.get("mlp_bias"):
            raise CheckpointError(
                f"{self.family} config: attention_bias / mlp_bias = true (o_proj / MLP biases) has no "
                "megatron mapping here; use --train-backend fsdp for this checkpoint"
            )
        return False

    def dims(self, hf_config: Any) -> Dims:
        c = hf_config_dict(hf_config)
        return Dims(c, self.family, self.qkv_bias(c), self.qk_norm)

    def transformer_config(self, hf_config: Any) -> dict[str, Any]:
        d = self.dims(hf_config)
        return dict(
            num_layers=d.layers,
            hidden_size=d.hidden,
            ffn_hidden_size=d.ffn,
            num_attention_heads=d.heads,
            num_query_groups=d.groups,
            kv_channels=d.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=d.eps,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=d.qkv_bias,
            qk_layernorm=d.qk_norm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            # fused kernels are CUDA/TE-only or change rounding; the torch paths match HF in fp32
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
        )

    def gpt_model_kwargs(self, hf_config: Any, tensor_model_parallel_size: int = 1) -> dict[str, Any]:
        d = self.dims(hf_config)
        kw = dict(
            vocab_size=padded_vocab(d.vocab, tensor_model_parallel_size),
            max_sequence_length=d.max_pos,
            position_embedding_type="rope",
            rotary_base=d.rope_theta,
            share_embeddings_and_output_weights=d.tied,
        )
        if d.rope_scaling_factor is not None:
            kw.update(rope_scaling=True, rope_scaling_factor=d.rope_scaling_factor)
        return kw

    def layer_spec_kwargs(self, hf_config: Any) -> dict[str, Any]:
        return dict(qk_layernorm=self.dims(hf_config).qk_norm)

    def mlp_norm_fuses(self, d: Dims, i: int) -> bool:
        """Whether the TE spec fuses layer i's pre_mlp_layernorm into linear_fc1: a dense MLP's; an MoE
        layer keeps it (the router reads it)."""
        return True

    def unmapped_hf(self, name: str, d: Dims) -> bool:
        """An HF checkpoint tensor the mapping drops on purpose (besides rotary caches)."""
        return False

    def attention_extras_to_megatron(self, get, d: Dims, hp: str, mp: str) -> dict[str, torch.Tensor]:
        """A layer's attention tensors beyond q/k/v (+ biases, norms) and o_proj's weight (GPT-OSS:
        o_proj's bias, the sinks); `get(name, shape)` takes a tensor."""
        return {}

    def attention_extras_to_hf(self, get, d: Dims, hp: str, mp: str) -> dict[str, torch.Tensor]:
        return {}

    def mlp_to_megatron(self, hf_sd, get, d: Dims, hp: str, mp: str, i: int) -> dict[str, torch.Tensor]:
        """Layer i's MLP: HF `hp` prefix -> megatron `mp` prefix. `get(name, shape)` takes a tensor."""
        gate = get(hp + "mlp.gate_proj.weight", (d.ffn, d.hidden))
        up = get(hp + "mlp.up_proj.weight", (d.ffn, d.hidden))
        return {
            mp + "mlp.linear_fc1.weight": torch.cat([gate, up], dim=0),
            mp + "mlp.linear_fc2.weight": get(hp + "mlp.down_proj.weight", (d.hidden, d.ffn)),
        }

    def mlp_to_hf(self, get, d: Dims, hp: str, mp: str, i: int) -> dict[str, torch.Tensor]:
        gate, up = get(mp + "mlp.linear_fc1.weight", (2 * d.ffn, d.hidden)).chunk(2, dim=0)
        return {
            hp + "mlp.gate_proj.weight": gate,
            hp + "mlp.up_proj.weight": up,
            hp + "mlp.down_proj.weight": get(mp + "mlp.linear_fc2.weight", (d.hidden, d.ffn)),
        }

    def hf_to_megatron(self, hf_sd, config, *, fused_norms=False, padded_vocab_size=None):
        d = self.dims(config)
        where = "HF checkpoint"
        used: set[str] = set()

        def get(name, shape):
            used.add(name)
            return take(hf_sd, name, shape, where)

        H, hd, g, qpg = d.hidden, d.head_dim, d.groups, d.q_per_group
        out: dict[str, torch.Tensor] = {}
        emb = get("model.embed_tokens.weight", (d.vocab, H))
        out["embedding.word_embeddings.weight"] = _pad_rows(emb, padded_vocab_size)
        for i in range(d.layers):
            hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
            q = get(hp + "self_attn.q_proj.weight", (d.heads * hd, H)).reshape(g, qpg * hd, H)
            k = get(hp + "self_attn.k_proj.weight", (g * hd, H)).reshape(g, hd, H)
            v = get(hp + "self_attn.v_proj.weight", (g * hd, H)).reshape(g, hd, H)
            out[mp + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, H)
            if d.qkv_bias:
                qb = get(hp + "self_attn.q_proj.bias", (d.heads * hd,)).reshape(g, qpg * hd)
                kb = get(hp + "self_attn.k_proj.bias", (g * hd,)).reshape(g, hd)
                vb = get(hp + "self_attn.v_proj.bias", (g * hd,)).reshape(g, hd)
                out[mp + "self_attention.linear_qkv.bias"] = torch.cat([qb, kb, vb], dim=1).reshape(-1)
            if d.qk_norm:
                out[mp + "self_attention.q_layernorm.weight"] = get(hp + "self_attn.q_norm.weight", (hd,))
                out[mp + "self_attention.k_layernorm.weight"] = get(hp + "self_attn.k_norm.weight", (hd,))
            out[mp + "self_attention.linear_proj.weight"] = get(
                hp + "self_attn.o_proj.weight", (H, d.heads * hd)
            )
            out.update(self.attention_extras_to_megatron(get, d, hp, mp))
            out.update(self.mlp_to_megatron(hf_sd, get, d, hp, mp, i))
            in_norm = get(hp + "input_layernorm.weight", (H,))
            mlp_norm = get(hp + "post_attention_layernorm.weight", (H,))
            if fused_norms:
                out[mp + "self_attention.linear_qkv.layer_norm_weight"] = in_norm
            else:
                out[mp + "input_layernorm.weight"] = in_norm
            if fused_norms and self.mlp_norm_fuses(d, i):
                out[mp + "mlp.linear_fc1.layer_norm_weight"] = mlp_norm
            else:
                out[mp + "pre_mlp_layernorm.weight"] = mlp_norm
        return ends_to_megatron(
            out, hf_sd, get, used, d, padded_vocab_size, where, lambda k: self.unmapped_hf(k, d)
        )

    def megatron_to_hf_part(self, mcore_sd, config, unit: tuple[int, int]) -> dict[str, torch.Tensor]:
        """One unit of `megatron_to_hf`: (0, 0) the embedding, (1, i) decoder layer i, (2, 0) the
        final norm and the output layer; `mcore_sd` needs only that unit's tensors."""
        d = self.dims(config)
        where = "megatron state"
        H, hd, g, qpg = d.hidden, d.head_dim, d.groups, d.q_per_group
        V = d.vocab

        def get(name, shape):
            return take(mcore_sd, name, shape, where)

        def norm(fused: str, local: str):
            return get(fused if fused in mcore_sd else local, (H,))

        kind, i = unit
        out: dict[str, torch.Tensor] = {}
        if kind != 1:
            out = ends_to_hf(mcore_sd, kind, V, H, d.tied)
        else:
            hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
            qkv = get(mp + "self_attention.linear_qkv.weight", (g * (qpg + 2) * hd, H)).reshape(
                g, (qpg + 2) * hd, H
            )
            q, k, v = qkv.split([qpg * hd, hd, hd], dim=1)
            out[hp + "self_attn.q_proj.weight"] = q.reshape(-1, H)
            out[hp + "self_attn.k_proj.weight"] = k.reshape(-1, H)
            out[hp + "self_attn.v_proj.weight"] = v.reshape(-1, H)
            if d.qkv_bias:
                b = get(mp + "self_attention.linear_qkv.bias", (g * (qpg + 2) * hd,)).reshape(g, -1)
                qb, kb, vb = b.split([qpg * hd, hd, hd], dim=1)
                out[hp + "self_attn.q_proj.bias"] = qb.reshape(-1)
                out[hp + "self_attn.k_proj.bias"] = kb.reshape(-1)
                out[hp + "self_attn.v_proj.bias"] = vb.reshape(-1)
            if d.qk_norm:
                out[hp + "self_attn.q_norm.weight"] = get(mp + "self_attention.q_layernorm.weight", (hd,))
                out[hp + "self_attn.k_norm.weight"] = get(mp + "self_attention.k_layernorm.weight", (hd,))
            out[hp + "self_attn.o_proj.weight"] = get(
                mp + "self_attention.linear_proj.weight", (H, d.heads * hd)
            )
            out.update(self.attention_extras_to_hf(get, d, hp, mp))
            out.update(self.mlp_to_hf(get, d, hp, mp, i))
            out[hp + "input_layernorm.weight"] = norm(
                mp + "self_attention.linear_qkv.layer_norm_weight", mp + "input_layernorm.weight"
            )
            out[hp + "post_attention_layernorm.weight"] = norm(
                mp + "mlp.linear_fc1.layer_norm_weight", mp + "pre_mlp_layernorm.weight"
            )
        return {k: v.contiguous() for k, v in out.items()}


def _pad_rows(t: torch.Tensor, rows: int | None) -> torch.Tensor:
    if rows is None or rows == t.shape[0]:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)
