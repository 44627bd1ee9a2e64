"""MLA's compressed KV cache in the embedded engine, and decode in the absorbed form.

Multi-head latent attention (GLM-4.7-Flash, DeepSeek-V3 / V3.2) caches per token and layer only the
compressed latent `c` (kv_a_proj_with_mqa's first `kv_lora_rank` outputs after kv_a_layernorm) and
the decoupled rope key `k_rot` (`qk_rope_head_dim`, shared by every head): transformers' MLA layers
write exactly these to the cache (`keys` [B, 1, T, kv_lora_rank], `values` [B, 1, T, qk_rope_head_dim]),
so the engine's batched cache (rollout/engine_batch.py) holds `kv_lora_rank + qk_rope_head_dim`
values per token per layer, not the `heads x (qk_head_dim + v_head_dim)` of decompressed K / V
(`cache_values_per_token` gives both).

HF's layer then decompresses the whole cached context through kv_b_proj at every step (a
`T x heads x (qk_nope_head_dim + v_head_dim)` product and tensor per decode step). Decode steps here
run the absorbed form instead, as DeepSeek's inference code and SGLang's MLA decode do: with
kv_b_proj's weight split per head into W_UK [nope, rank] and W_UV [v, rank],

    score[h, t] = (W_UK[h]^T q_nope[h]) . c[t] + q_rot[h] . k_rot[t]      (W_UK absorbed into q)
    out[h]      = W_UV[h] (sum_t p[h, t] c[t])                              (W_UV applied after)

so attention runs against the latents (one shared "head" of width rank + rope), and nothing per head
is built for the context. Prefill keeps HF's decompressed form (many queries: SGLang does the same).
The weights are read at each step (updates copy in place; nothing is precomputed to go stale).
DeepSeek-V3.2's DSA indexer runs unchanged (its own key cache, `indexer_keys`); its top-k selection
masks the absorbed scores as it masks HF's. HF's forward runs instead when kv_b_proj is not a plain
Linear or has hooks (a served LoRA adapter on it, rollout/lora_serving.py), or the attention kernel
is not eager / sdpa.
"""

from __future__ import annotations

import sys
import types

import torch
from torch import nn


def is_mla_attention(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("kv_a_proj_with_mqa", "kv_b_proj", "kv_lora_rank", "expand_kv"))


def cache_values_per_token(config) -> dict[str, int]:
    """Values cached per token per MLA layer: `compressed` (the latent and the rope key: what the
    engine holds), `indexer` (DeepSeek-V3.2's DSA key, 0 without one) and `decompressed` (each head's
    K and V: what a cache of HF's expanded states would hold)."""
    heads = config.num_attention_heads
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    return {
        "compressed": config.kv_lora_rank + config.qk_rope_head_dim,
        "indexer": int(getattr(config, "index_head_dim", None) or 0) if hasattr(config, "index_topk") else 0,
        "decompressed": heads * (qk + config.v_head_dim),
    }


def absorb_mla_decode(model: nn.Module) -> int:
    """Run every MLA attention layer of `model` in the absorbed form at decode steps; returns how many."""
    n = 0
    for m in model.modules():
        if is_mla_attention(m) and not getattr(m, "_mla_absorbed", False):
            m.forward = types.MethodType(_forward, m)
            m._mla_absorbed = True
            n += 1
    return n


def _plain(lin: nn.Module) -> bool:
    """A Linear whose forward is `x @ W^T`, nothing added (no bias, hooks, or replaced forward)."""
    return (
        type(lin) is nn.Linear
        and lin.bias is None
        and not lin._forward_hooks
        and not lin._forward_pre_hooks
        and "forward" not in vars(lin)
    )


def _absorbable(self, hidden_states, cache) -> bool:
    return (
        hidden_states.shape[1] == 1
        and cache is not None
        and not self.training
        and self.config._attn_implementation in ("eager", "sdpa")
        and _plain(self.kv_b_proj)
    )


def _forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
    if not _absorbable(self, hidden_states, cache):
        return type(self).forward(
            self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs
        )
    hf = sys.modules[type(self).__module__]  # the family's own rope functions
    bsz, seq = hidden_states.shape[:-1]
    nope, rope, rank = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
    q_resid = None
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        q = self.q_b_proj(q_resid)
    q = q.view(bsz, seq, -1, self.qk_head_dim).transpose(1, 2)
    q_nope, q_rot = torch.split(q, [nope, rope], dim=-1)
    kv_c, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    kv_c = self.kv_a_layernorm(kv_c).view(bsz, 1, seq, rank)
    k_rot = k_rot.view(bsz, 1, seq, rope)
    cos, sin = position_embeddings
    indexer = getattr(self, "indexer", None)
    if indexer is not None or self.config.rope_interleave:  # V3.2's main attention is always interleaved
        q_rot, k_rot = hf.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    else:
        q_rot, k_rot = hf.apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
    kv_c, k_rot = cache.update(kv_c, k_rot, self.layer_idx, kwargs=kwargs)  # [B, 1, T, rank | rope]
    t = kv_c.shape[2]
    mask = None if attention_mask is None else attention_mask[:, :, :, :t]
    if indexer is not None:  # DSA: attend to the indexer's top-k tokens only
        if mask is None:
            mask = torch.ones(bsz, 1, seq, t, dtype=torch.bool, device=hidden_states.device)
        top = indexer(
            hidden_states, q_resid, position_embeddings, mask[:, 0], kwargs.get("position_ids"), cache=cache
        )
        dropped = torch.ones(bsz, 1, seq, t, dtype=torch.bool, device=mask.device)
        dropped = dropped.scatter(-1, top.long().unsqueeze(1), False)
        mask = (
            mask & ~dropped
            if mask.dtype == torch.bool
            else mask.masked_fill(dropped, torch.finfo(mask.dtype).min)
        )
    w = self.kv_b_proj.weight.view(self.num_heads, nope + self.v_head_dim, rank)
    q_lat = torch.matmul(q_nope, w[:, :nope])  # [B, H, S, rank]: W_UK absorbed into the query
    scores = (q_lat @ kv_c.transpose(-1, -2) + q_rot @ k_rot.transpose(-1, -2)) * self.scaling  # [B, H, S, T]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(kv_c.dtype)
    out = torch.matmul(p @ kv_c, w[:, nope:].transpose(-1, -2))  # [B, H, S, v]: W_UV after the latent sum
    return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1)), None
