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

HF-only families (`HF_FAMILIES`): transformers' own classes on the fsdp backend and the embedded engine
(whose batched KV cache carries every cache layer kind they use, rollout/engine_batch.py); the megatron
backend refuses them by name with `Family.megatron` (the reason), before anything starts.
qwen3_5       Qwen3_5ForCausalLM      gated-DeltaNet linear attention (conv + recurrent state) / full
qwen3_5_moe   Qwen3_5MoeForCausalLM   the same, MoE with a gated shared expert
qwen3_next    Qwen3NextForCausalLM    the same as Qwen3.5-MoE (its predecessor)
glm4_moe      Glm4MoeForCausalLM      GLM-4.5: partial rotary, q/k norm, sigmoid group routing, shared expert
glm4_moe_lite Glm4MoeLiteForCausalLM  GLM-4.7-Flash: MLA attention, DeepSeek-style MoE
deepseek_v3   DeepseekV3ForCausalLM   MLA, first layers dense, sigmoid group-limited routing (noaux_tc)
deepseek_v32  DeepseekV32ForCausalLM  V3 + the DSA indexer: top-k sparse attention over its own key cache
gpt_oss       GptOssForCausalLM       sliding-window / full layers, attention sinks, biased fused experts
gemma4        Gemma4ForCausalLM       sliding / full layers (own head dim), per-layer inputs (text model)
Refused by name (`REFUSED_ARCHITECTURES`): families whose checkpoint layout the platform's export and
publications do not map yet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str
    config_class: str
    tiny: dict[str, Any]  # what the tiny config sets beyond the shared dims
    # per-layer lists repeated to num_hidden_layers (layer_types, mlp_layer_types, ...)
    layer_pattern: dict[str, tuple[str, ...]] = field(default_factory=dict)
    moe: bool = False  # experts and top-k routers in its sparse layers
    mla: bool = False  # multi-head latent attention: head_dim is the rope part, kv heads = heads
    megatron: str | None = None  # why the megatron backend refuses the family (None: it has a bridge)


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
        moe=True,
    )
}  # fmt: skip
_LINEAR = {
    "head_dim": 32,
    "full_attention_interval": 2,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 48}
_QWEN_NEXT_MOE = {**_LINEAR, **_MOE, "num_experts": 4, "shared_expert_intermediate_size": 48}
# MLA: a 16-rank compressed KV (8 rope + 8 no-rope dims per head), 24-rank q
_MLA = {"kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
_DEEPSEEK_MOE = {
    **_MOE,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
}
_NO_BRIDGE = "megatron-core has no bridge here for {what}; train it with --train-backend fsdp"

# Families only HF's classes run (fsdp + the embedded engine); megatron refuses each with its reason.
HF_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(_LINEAR),
               megatron=_NO_BRIDGE.format(what="gated-DeltaNet linear attention (Qwen3.5)")),
        Family("qwen3_5_moe", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", _QWEN_NEXT_MOE,
               moe=True, megatron=_NO_BRIDGE.format(what="gated-DeltaNet linear attention (Qwen3.5-MoE)")),
        Family("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
               {**_QWEN_NEXT_MOE, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
               moe=True, megatron=_NO_BRIDGE.format(what="gated-DeltaNet linear attention (Qwen3-Next)")),
        Family("glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeConfig",
               {**_DEEPSEEK_MOE, "routed_scaling_factor": 1.0, "use_qk_norm": True, "n_group": 1, "topk_group": 1,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
               moe=True, megatron=_NO_BRIDGE.format(what="GLM-4.5's partial-rotary attention with shared experts")),
        Family("glm4_moe_lite", "Glm4MoeLiteForCausalLM", "Glm4MoeLiteConfig",
               {**_DEEPSEEK_MOE, **_MLA, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.8},
               layer_pattern={"mlp_layer_types": ("dense", "sparse")}, mla=True,
               moe=True, megatron=_NO_BRIDGE.format(what="MLA attention (GLM-4.7-Flash)")),
        # 2 groups of 2 experts, 1 group per token: the group-limited routing runs
        Family("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config",
               {**_DEEPSEEK_MOE, **_MLA, "n_group": 2, "topk_group": 1}, mla=True,
               moe=True, megatron=_NO_BRIDGE.format(what="MLA attention (DeepSeek-V3)")),
        # the indexer keeps 8 of the context's tokens per query: the sparse attention runs at test lengths;
        # 8 indexer heads keep its ReLU scores off ties (ties make top-k differ between shapes)
        Family("deepseek_v32", "DeepseekV32ForCausalLM", "DeepseekV32Config",
               {**_DEEPSEEK_MOE, **_MLA, "n_group": 2, "topk_group": 1, "index_topk": 8, "index_head_dim": 16,
                "index_n_heads": 8},
               layer_pattern={"mlp_layer_types": ("dense", "sparse")}, mla=True,
               moe=True, megatron=_NO_BRIDGE.format(what="MLA with DSA sparse attention (DeepSeek-V3.2)")),
        # an 8-token window: the sliding layers drop context at test lengths
        Family("gpt_oss", "GptOssForCausalLM", "GptOssConfig",
               {"head_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
               layer_pattern={"layer_types": ("sliding_attention", "full_attention")},
               moe=True, megatron=_NO_BRIDGE.format(what="GPT-OSS's attention sinks and biased, clamped experts")),
        Family("gemma4", "Gemma4ForCausalLM", "Gemma4TextConfig",
               {"head_dim": 32, "sliding_window": 8, "hidden_size_per_layer_input": 8},
               layer_pattern={"layer_types": ("sliding_attention", "full_attention")},
               megatron=_NO_BRIDGE.format(what="Gemma-4's per-layer inputs and mixed head dims")),
    )
}  # fmt: skip
ALL_FAMILIES: dict[str, Family] = {**FAMILIES, **MOE_FAMILIES, **HF_FAMILIES}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(f.architecture for f in ALL_FAMILIES.values())
# Real architectures refused by name, with why (validate_hf_dir raises it).
REFUSED_ARCHITECTURES: dict[str, str] = {
    "NemotronHForCausalLM": "Nemotron-H: its checkpoint layout (`backbone.*`, `mixer.experts.E.up_proj/down_proj`) "
    "is not mapped by the platform's HF export and disk-delta publications yet",
    "MiniMaxM2ForCausalLM": "MiniMax-M2: its checkpoint layout (`block_sparse_moe.experts.E.w1/w2/w3`) is not "
    "mapped by the platform's HF export and disk-delta publications yet",
}


def family_of(hf_config: Any) -> Family | None:
    """The family of an HF config (PretrainedConfig or config.json dict), or None."""
    cfg = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    archs = cfg.get("architectures") or []
    return next((f for f in ALL_FAMILIES.values() if f.architecture in archs), None)


def is_moe_config(hf_config: Any) -> bool:
    fam = family_of(hf_config)
    return fam is not None and fam.moe


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
    for key, pattern in fam.layer_pattern.items():
        n = cfg["num_hidden_layers"]
        cfg.setdefault(key, [pattern[i % len(pattern)] for i in range(n)])
    if fam.mla:  # the rope part of a head is its head_dim; every head keeps its own compressed K/V
        cfg.update(head_dim=cfg["qk_rope_head_dim"], num_key_value_heads=cfg["num_attention_heads"])
    if fam.name == "gemma4":  # the per-layer input embedding covers the vocabulary; one head dim
        cfg.update(vocab_size_per_layer_input=cfg["vocab_size"], global_head_dim=cfg["head_dim"])
    return getattr(transformers, fam.config_class)(**cfg)


def build_model(config, seed: int = 0) -> torch.nn.Module:
    """The family's HF model with random weights (eval mode). HF initializes biases to zero; the
    tiny model draws them like the weights, so the bias mapping of every path carries real values."""
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
    loader reads; transformers' `save_pretrained` layout of every MoE family here); any other state,
    and GPT-OSS's experts (fused on disk too), is returned as it is."""
    out = {}
    # GPT-OSS keeps its biased experts fused on disk as in the module ([E, H, 2I], gate / up interleaved)
    fused_on_disk = {n[: -len("_bias")] for n in state if n.endswith("mlp.experts.gate_up_proj_bias")}
    for name, t in state.items():
        if name in fused_on_disk or name[: -len("down_proj")] + "gate_up_proj" in fused_on_disk:
            out[name] = t
        elif name.endswith("mlp.experts.gate_up_proj") and t.dim() == 3:
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
