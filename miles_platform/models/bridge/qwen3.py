"""Qwen3 (dense) <-> megatron-core GPTModel.

HF                                            megatron (local spec; TE spec name in brackets)
model.embed_tokens.weight                     embedding.word_embeddings.weight
model.layers.i.input_layernorm.weight         decoder.layers.i.input_layernorm.weight
                                                [decoder.layers.i.self_attention.linear_qkv.layer_norm_weight]
model.layers.i.self_attn.{q,k,v}_proj.weight  decoder.layers.i.self_attention.linear_qkv.weight
model.layers.i.self_attn.{q,k}_norm.weight    decoder.layers.i.self_attention.{q,k}_layernorm.weight
model.layers.i.self_attn.o_proj.weight        decoder.layers.i.self_attention.linear_proj.weight
model.layers.i.post_attention_layernorm.weight decoder.layers.i.pre_mlp_layernorm.weight
                                                [decoder.layers.i.mlp.linear_fc1.layer_norm_weight]
model.layers.i.mlp.{gate,up}_proj.weight      decoder.layers.i.mlp.linear_fc1.weight  ([gate; up])
model.layers.i.mlp.down_proj.weight           decoder.layers.i.mlp.linear_fc2.weight
model.norm.weight                             decoder.final_layernorm.weight
lm_head.weight (untied only)                  output_layer.weight (untied only)

linear_qkv rows are grouped per query group g: [q heads of g (q_per_group*head_dim); k_g
(head_dim); v_g (head_dim)], which is what lets TP split it on dim 0 by whole groups.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_platform.errors import CheckpointError
from miles_platform.models.bridge.base import Bridge, hf_config_dict, padded_vocab, register_bridge

_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


class _Dims:
    def __init__(self, hf_config: Any):
        c = hf_config_dict(hf_config)
        if c.get("attention_bias"):
            raise CheckpointError(
                "Qwen3 bridge: attention_bias=true is not supported (megatron biases differ)"
            )
        self.hidden = c["hidden_size"]
        self.layers = c["num_hidden_layers"]
        self.heads = c["num_attention_heads"]
        self.groups = c.get("num_key_value_heads") or self.heads
        self.head_dim = c.get("head_dim") or self.hidden // self.heads
        self.ffn = c["intermediate_size"]
        self.vocab = c["vocab_size"]
        self.tied = bool(c.get("tie_word_embeddings", False))
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.rope_theta = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.max_pos = c.get("max_position_embeddings", 4096)
        if self.heads % self.groups:
            raise CheckpointError(
                f"Qwen3 config: num_attention_heads {self.heads} not divisible by num_key_value_heads {self.groups}"
            )
        self.q_per_group = self.heads // self.groups


def _take(sd: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], where: str) -> torch.Tensor:
    if name not in sd:
        raise CheckpointError(f"{where}: missing tensor {name!r}")
    t = sd[name]
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(
            f"{where}: tensor {name!r} has shape {tuple(t.shape)}, config expects {tuple(shape)}"
        )
    return t


@register_bridge("Qwen3ForCausalLM")
class Qwen3Bridge(Bridge):
    def transformer_config(self, hf_config: Any) -> dict[str, Any]:
        d = _Dims(hf_config)
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
            add_qkv_bias=False,
            qk_layernorm=True,
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
        d = _Dims(hf_config)
        return dict(
            vocab_size=padded_vocab(d.vocab, tensor_model_parallel_size),
            max_sequence_length=d.max_pos,
            position_embedding_type="rope",
            rotary_base=d.rope_theta,
            share_embeddings_and_output_weights=d.tied,
        )

    def layer_spec_kwargs(self, hf_config: Any) -> dict[str, Any]:
        return dict(qk_layernorm=True)

    def hf_to_megatron(self, hf_sd, config, *, fused_norms=False, padded_vocab_size=None):
        d = _Dims(config)
        where = "HF checkpoint"
        used: set[str] = set()

        def take(name, shape):
            used.add(name)
            return _take(hf_sd, name, shape, where)

        H, hd, g, qpg = d.hidden, d.head_dim, d.groups, d.q_per_group
        out: dict[str, torch.Tensor] = {}
        emb = take("model.embed_tokens.weight", (d.vocab, H))
        out["embedding.word_embeddings.weight"] = _pad_rows(emb, padded_vocab_size)
        for i in range(d.layers):
            hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
            q = take(hp + "self_attn.q_proj.weight", (d.heads * hd, H)).reshape(g, qpg * hd, H)
            k = take(hp + "self_attn.k_proj.weight", (g * hd, H)).reshape(g, hd, H)
            v = take(hp + "self_attn.v_proj.weight", (g * hd, H)).reshape(g, hd, H)
            out[mp + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, H)
            out[mp + "self_attention.q_layernorm.weight"] = take(hp + "self_attn.q_norm.weight", (hd,))
            out[mp + "self_attention.k_layernorm.weight"] = take(hp + "self_attn.k_norm.weight", (hd,))
            out[mp + "self_attention.linear_proj.weight"] = take(
                hp + "self_attn.o_proj.weight", (H, d.heads * hd)
            )
            gate = take(hp + "mlp.gate_proj.weight", (d.ffn, H))
            up = take(hp + "mlp.up_proj.weight", (d.ffn, H))
            out[mp + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
            out[mp + "mlp.linear_fc2.weight"] = take(hp + "mlp.down_proj.weight", (H, d.ffn))
            in_norm = take(hp + "input_layernorm.weight", (H,))
            mlp_norm = take(hp + "post_attention_layernorm.weight", (H,))
            if fused_norms:
                out[mp + "self_attention.linear_qkv.layer_norm_weight"] = in_norm
                out[mp + "mlp.linear_fc1.layer_norm_weight"] = mlp_norm
            else:
                out[mp + "input_layernorm.weight"] = in_norm
                out[mp + "pre_mlp_layernorm.weight"] = mlp_norm
        out["decoder.final_layernorm.weight"] = take("model.norm.weight", (H,))
        if not d.tied:
            out["output_layer.weight"] = _pad_rows(take("lm_head.weight", (d.vocab, H)), padded_vocab_size)
        else:
            used.add("lm_head.weight")  # tied copies, if saved, are the embedding
        extra = [k for k in hf_sd if k not in used and not k.endswith(_IGNORED_HF_SUFFIXES)]
        if extra:
            raise CheckpointError(f"{where}: unexpected tensor(s) for this config: {sorted(extra)[:5]}")
        return out

    def megatron_to_hf(self, mcore_sd, config):
        d = _Dims(config)
        where = "megatron state"
        H, hd, g, qpg = d.hidden, d.head_dim, d.groups, d.q_per_group
        V = d.vocab

        def take(name, shape):
            return _take(mcore_sd, name, shape, where)

        def take_vocab(name):
            if name not in mcore_sd:
                raise CheckpointError(f"{where}: missing tensor {name!r}")
            t = mcore_sd[name]
            if t.dim() != 2 or t.shape[1] != H or t.shape[0] < V:
                raise CheckpointError(
                    f"{where}: tensor {name!r} has shape {tuple(t.shape)}, config expects ({V}, {H})"
                )
            return t[:V]

        def norm(fused: str, local: str):
            return take(fused if fused in mcore_sd else local, (H,))

        out: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": take_vocab("embedding.word_embeddings.weight")
        }
        for i in range(d.layers):
            hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
            qkv = take(mp + "self_attention.linear_qkv.weight", (g * (qpg + 2) * hd, H)).reshape(
                g, (qpg + 2) * hd, H
            )
            q, k, v = qkv.split([qpg * hd, hd, hd], dim=1)
            out[hp + "self_attn.q_proj.weight"] = q.reshape(-1, H)
            out[hp + "self_attn.k_proj.weight"] = k.reshape(-1, H)
            out[hp + "self_attn.v_proj.weight"] = v.reshape(-1, H)
            out[hp + "self_attn.q_norm.weight"] = take(mp + "self_attention.q_layernorm.weight", (hd,))
            out[hp + "self_attn.k_norm.weight"] = take(mp + "self_attention.k_layernorm.weight", (hd,))
            out[hp + "self_attn.o_proj.weight"] = take(
                mp + "self_attention.linear_proj.weight", (H, d.heads * hd)
            )
            gate, up = take(mp + "mlp.linear_fc1.weight", (2 * d.ffn, H)).chunk(2, dim=0)
            out[hp + "mlp.gate_proj.weight"] = gate
            out[hp + "mlp.up_proj.weight"] = up
            out[hp + "mlp.down_proj.weight"] = take(mp + "mlp.linear_fc2.weight", (H, d.ffn))
            out[hp + "input_layernorm.weight"] = norm(
                mp + "self_attention.linear_qkv.layer_norm_weight", mp + "input_layernorm.weight"
            )
            out[hp + "post_attention_layernorm.weight"] = norm(
                mp + "mlp.linear_fc1.layer_norm_weight", mp + "pre_mlp_layernorm.weight"
            )
        out["model.norm.weight"] = take("decoder.final_layernorm.weight", (H,))
        if not d.tied:
            out["lm_head.weight"] = take_vocab("output_layer.weight")
        return {k: v.contiguous() for k, v in out.items()}


def _pad_rows(t: torch.Tensor, rows: int | None) -> torch.Tensor:
    if rows is None or rows == t.shape[0]:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)
