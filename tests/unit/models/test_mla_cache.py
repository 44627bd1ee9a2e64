"""MLA's compressed KV cache in the embedded engine (models/mla_cache.py): on the tiny GLM-4.7-Flash,
DeepSeek-V3 and V3.2 (DSA top-8 active past 8 tokens), the engine's cache holds kv_lora_rank +
qk_rope_head_dim values per token per layer (plus V3.2's indexer key), and decode steps in the absorbed
form give HF's decompressed-attention logits within 1e-5 (a left-padded batch, and one without
padding whose mask is None), never decompressing the context; a LoRA hook on kv_b_proj keeps HF's
path. The engine's batched decode against the trainer: tests/unit/models/test_hf_families.py."""

import copy

import pytest
import torch

from miles_platform.models.families import HF_FAMILIES, build_model, tiny_config
from miles_platform.models.mla_cache import absorb_mla_decode, cache_values_per_token, is_mla_attention
from miles_platform.rollout.engine_batch import new_cache
from miles_platform.rollout.engine_memory import kv_bytes_per_token

MLA = sorted(f for f, fam in HF_FAMILIES.items() if fam.mla)


def _steps(model, ids, mask, steps: int):
    """Prefill then `steps` greedy decode steps as the engine runs them; logits of each forward."""
    cache = new_cache(model.config)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    padded = not bool(mask.all())
    out = [model(input_ids=ids, attention_mask=mask if padded else None, position_ids=pos, cache=cache,
                 use_cache=True).logits[:, -1]]  # fmt: skip
    nxt = pos[:, -1:] + 1
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        tok = out[-1].argmax(-1, keepdim=True)
        out.append(model(input_ids=tok, attention_mask=mask if padded else None, position_ids=nxt,
                         cache=cache, use_cache=True).logits[:, -1])  # fmt: skip
        nxt = nxt + 1
    return torch.stack(out), cache


@pytest.mark.parametrize("family", MLA)
@torch.no_grad()
def test_mla_cache_is_compressed_and_absorbed_decode_matches(family):
    cfg = tiny_config(family, 128)
    ref = build_model(cfg)
    model = copy.deepcopy(ref)
    assert absorb_mla_decode(model) == cfg.num_hidden_layers
    expanded = []  # decompressions of a context: HF's prefill only
    for m in model.modules():
        if is_mla_attention(m):
            m.expand_kv = (lambda f: lambda *a: expanded.append(a[0].shape[2]) or f(*a))(m.expand_kv)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row
    for m in (mask, torch.ones_like(ids)):
        want, _ = _steps(ref, ids, m, steps=6)
        expanded.clear()
        got, cache = _steps(model, ids, m, steps=6)
        assert expanded == [12] * cfg.num_hidden_layers  # the decode steps ran absorbed
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    # per token per layer: the latent + rope key (+ V3.2's indexer key), not each head's K and V
    per = cache_values_per_token(cfg)
    assert per["compressed"] == cfg.kv_lora_rank + cfg.qk_rope_head_dim == 24
    assert per["decompressed"] == cfg.num_attention_heads * (16 + 16) == 128
    assert per["indexer"] == (16 if family == "deepseek_v32" else 0)
    tokens = 2 * (12 + 6)
    for layer in cache.layers:
        assert (
            layer.keys.shape == (2, 1, 18, cfg.kv_lora_rank)
            and layer.values.shape[-1] == cfg.qk_rope_head_dim
        )
        held = sum(t.numel() * t.element_size() for t in (layer.keys, layer.values, getattr(layer, "indexer_keys", None))
                   if t is not None)  # fmt: skip
        assert held == tokens * 4 * (per["compressed"] + per["indexer"])
    assert kv_bytes_per_token(cfg, torch.float32) == cfg.num_hidden_layers * 4 * (
        per["compressed"] + per["indexer"]
    )
    assert kv_bytes_per_token(cfg, torch.bfloat16) == cfg.num_hidden_layers * 2 * (
        per["compressed"] + per["indexer"]
    )

    # a forward hook on kv_b_proj (a served LoRA adapter) keeps HF's decompressed decode
    attn = next(m for m in model.modules() if is_mla_attention(m))
    handle = attn.kv_b_proj.register_forward_hook(lambda mod, i, o: None)
    expanded.clear()
    got, _ = _steps(model, ids, mask, steps=2)
    handle.remove()
    assert expanded.count(14) == 1  # the hooked layer decompressed its 14-token context at the last step
