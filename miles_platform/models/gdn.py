"""Gated-DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) in reduced precision: `A_log` stays fp32.

`A_log` is the log decay rate of each value head: every token's state update decays by
g = -exp(A_log) * softplus(a + dt_bias), so a bf16 rounding of A_log (up to 2^-8 relative) changes every
decay of the recurrence. Miles' Qwen3.5 model and SGLang hold it in fp32 whatever the checkpoint's dtype
(Qwen3.5 ships it fp32, Qwen3.6 bf16); so do the embedded engine (rollout/engine_weights.load_model) and the
megatron trainer under --bf16 / --fp16 (training/megatron_backend.py), and the fsdp trainer holds every
parameter in its fp32 master dtype by default. transformers' and megatron-core's forwards compute the decay
in fp32 from an fp32 A_log; weight updates keep each served parameter's own dtype.
"""

from __future__ import annotations

import torch


def keep_decay_fp32(model: torch.nn.Module) -> list[str]:
    """Cast every gated-DeltaNet layer's `A_log` to fp32 in place (the Parameter kept); its names."""
    names = []
    for name, module in model.named_modules():
        a_log = getattr(module, "A_log", None)
        if type(module).__name__.endswith("GatedDeltaNet") and isinstance(a_log, torch.nn.Parameter):
            if a_log.dtype != torch.float32:
                a_log.data = a_log.data.float()
            names.append(f"{name}.A_log")
    return names
