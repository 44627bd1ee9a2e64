"""The model families the platform takes, and a tiny random config of each for tests.

Every family is a real HF architecture (transformers' own classes serve as the reference on the
HF side); a family's megatron mapping lives in `models/bridge/<family>.py`. Real checkpoints of
these families load unchanged; `validate_hf_dir` refuses any other architecture with this list.

family   HF architecture      what differs from Qwen3 on the megatron side
qwen3    Qwen3ForCausalLM     (reference) q/k RMSNorm per head, no biases
qwen2    Qwen2ForCausalLM     q/k/v biases (megatron `add_qkv_bias`), no q/k norm (Qwen2.5)
llama    LlamaForCausalLM     no q/k norm, no biases, rope_type llama3 (Llama 3.1+) -> `rope_scaling`

MoE (`MOE_FAMILIES`): the fsdp backend and the embedded engine run HF's MoE blocks (routing record /
replay in `models/moe.py`); the megatron backend maps them to TopKRouter + SequentialMLP experts at
expert parallel 1, R3 through its routers' replay hook (`models/bridge/qwen3_moe.py`, docs/moe.md).
qwen3_moe Qwen3MoeForCausalLM  Qwen3 attention, every layer a top-k MoE block (`num_experts`)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads with the first model, not with the module (the Dagster code location)
    import torch


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str
    config_class: str
    tiny: dict[str, Any]  # what the tiny config sets beyond the shared dims


# Llama 3.2's rope: theta 5e5, llama3 scaling (factor 32, low/high 1/4, original context 8192). With
# theta 5e5 the slowest ~40% of the rotary frequencies of a tiny head are divided by 32, so the
# tiny Llama exercises the scaling (at head_dim 16: 3 of 8 divided, 1 smoothed).
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("qwen3", "Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 32, "rope_theta": 10000.0}),
        Family(
            "qwen2", "Qwen2ForCausalLM", "Qwen2Config", {"rope_theta": 10000.0, "use_sliding_window": False}
        ),
        Family(
            "llama",
            "LlamaForCausalLM",
            "LlamaConfig",
            # the real one's context: transformers wants max_position_embeddings > the original 8192
            {"head_dim": 32, "rope_parameters": _LLAMA3_ROPE, "max_position_embeddings": 131072},
        ),
    )
}
MOE_FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        # 4 experts, top-2, every layer sparse; ~430k parameters like the dense tiny models
        {"head_dim": 32, "rope_theta": 10000.0, "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 96, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
    )
}  # fmt: skip
ALL_FAMILIES: dict[str, Family] = {**FAMILIES, **MOE_FAMILIES}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(f.architecture for f in ALL_FAMILIES.values())


def family_of(hf_config: Any) -> Family | None:
    """The family of an HF config (PretrainedConfig or config.json dict), or None."""
    cfg = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    archs = cfg.get("architectures") or []
    return next((f for f in ALL_FAMILIES.values() if f.architecture in archs), None)


def is_moe_config(hf_config: Any) -> bool:
    fam = family_of(hf_config)
    return fam is not None and fam.name in MOE_FAMILIES


def tiny_config(family: str, vocab_size: int, **overrides):
    """A tiny random config of `family` (a few hundred thousand parameters at the defaults)."""
    if family not in ALL_FAMILIES:
        raise ValueError(f"model family {family!r}: supported {sorted(ALL_FAMILIES)}")
    import transformers

    fam = ALL_FAMILIES[family]
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        torch_dtype="float32",
        architectures=[fam.architecture],
    )
    cfg.update(fam.tiny)
    cfg.update(overrides)
    return getattr(transformers, fam.config_class)(**cfg)


def build_model(config, seed: int = 0) -> torch.nn.Module:
    """The family's HF model with random weights (eval mode). HF initializes biases to zero; the
    tiny model draws them like the weights, so the bias mapping of every path carries real values."""
    import torch
    import transformers

    fam = family_of(config)
    arch = fam.architecture if fam else (config.architectures or ["Qwen3ForCausalLM"])[0]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, config.initializer_range)
    model.eval()
    return model


_PER_EXPERT = re.compile(
    r"^(?P<pre>.*\.mlp\.experts\.)(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def fuse_checkpoint_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An MoE checkpoint's per-expert tensors (HF's on-disk layout, what `save_pretrained` and the
    published Qwen3-MoE checkpoints hold: `mlp.experts.e.{gate,up,down}_proj.weight`) as the fused
    parameters transformers 5's modules hold (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows
    first, and `mlp.experts.down_proj` [E, H, I]); any other state is returned as it is."""
    import torch

    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, t in state.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        groups.setdefault(m["pre"], {}).setdefault(m["proj"], {})[int(m["e"])] = t
    for pre, projs in groups.items():
        n = {len(v) for v in projs.values()}
        experts = sorted(projs.get("down_proj", {}))
        if len(projs) != 3 or len(n) != 1 or experts != list(range(len(experts))):
            raise ValueError(
                f"{pre}*: per-expert tensors are incomplete ({ {p: len(v) for p, v in projs.items()} })"
            )
        gate, up, down = (
            torch.stack([projs[p][e] for e in experts]) for p in ("gate_proj", "up_proj", "down_proj")
        )
        out[f"{pre}gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{pre}down_proj"] = down
    return out


def split_fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `fuse_checkpoint_experts`: fused expert parameters as HF's per-expert
    checkpoint tensors (what the run's HF exports and publications hold, and SGLang's Qwen3-MoE
    loader reads); any other state is returned as it is."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj") and t.dim() == 3:
            pre = name[: -len("gate_up_proj")]
            gates, ups = t.chunk(2, dim=1)  # [E, I, H] each: gate rows, then up rows
            for e in range(t.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = gates[e].contiguous()
                out[f"{pre}{e}.up_proj.weight"] = ups[e].contiguous()
        elif name.endswith("mlp.experts.down_proj") and t.dim() == 3:
            pre = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out
