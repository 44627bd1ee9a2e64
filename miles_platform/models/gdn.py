"""Gated-DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) in reduced precision: `A_log` stays fp32.

`A_log` is the log decay rate of each value head: every token's state update decays by
g = -exp(A_log) * softplus(a + dt_bias), so a bf16 rounding of A_log (up to 2^-8 relative) changes every
decay of the recurrence. Miles' Qwen3.5 model and SGLang hold it in fp32 whatever the checkpoint's dtype
(Qwen3.5 ships it fp32, Qwen3.6 bf16); so do the embedded engine (rollout/engine_weights.load_model) and the
megatron trainer under --bf16 / --fp16 (training/megatron_backend.py), and the fsdp trainer holds every
parameter in its fp32 master dtype by default. transformers' and megatron-core's forwards compute the decay
in fp32 from an fp32 A_log; weight updates keep each served parameter's own dtype. Loading a checkpoint in
bf16 must not round it on the way (`keep_decay_fp32` after the load would cast the rounded value back up):
`load_decay_fp32` names it in transformers' `_keep_in_fp32_modules_strict` of these families' models, so
`from_pretrained` reads it into fp32 as stored.
"""

from __future__ import annotations

import torch

# architectures whose transformers models have gated-DeltaNet layers -> (modeling module, PreTrainedModel class)
_HF_MODELS = {
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5PreTrainedModel"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe", "Qwen3_5MoePreTrainedModel"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextPreTrainedModel"),
}


def load_decay_fp32(architectures: list[str] | tuple[str, ...]) -> None:
    """Before `from_pretrained` of one of these architectures: its `A_log` loads into fp32 at any dtype."""
    import importlib

    for arch in architectures:
        if arch in _HF_MODELS:
            module, cls_name = _HF_MODELS[arch]
            cls = getattr(
                importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls_name
            )
            cls._keep_in_fp32_modules_strict = {*(cls._keep_in_fp32_modules_strict or ()), "A_log"}


# HF's name of the parameter (Qwen3.5 / Qwen3.5-MoE / Qwen3-Next's `linear_attn` layers)
HF_DECAY_SUFFIX = ".linear_attn.A_log"


def served_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype an engine serving in `dtype` holds HF parameter `name` in (the weight-equality check's)."""
    return torch.float32 if name.endswith(HF_DECAY_SUFFIX) else dtype


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
