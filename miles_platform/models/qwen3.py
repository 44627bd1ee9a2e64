"""Tiny Qwen3-style policy: a real HF architecture (Qwen3ForCausalLM), small enough for 2 CPU cores."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def tiny_qwen3_config(vocab_size: int, **overrides) -> Qwen3Config:
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        torch_dtype="float32",
    )
    cfg.update(overrides)
    return Qwen3Config(**cfg)


def build_model(config: Qwen3Config, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.eval()
    return model


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
