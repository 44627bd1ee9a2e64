"""Tiny Qwen3-style policy: a real HF architecture (Qwen3ForCausalLM), small enough for 2 CPU cores."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def tiny_qwen3_config(vocab_size: int, **overrides) -> Qwen3Config:
    """The tiny Qwen3 of the demo and the tests: `models.families.tiny_config("qwen3", ...)`."""
    from miles_platform.models.families import tiny_config

    return tiny_config("qwen3", vocab_size, **overrides)


def build_model(config: Qwen3Config, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.eval()
    return model


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
