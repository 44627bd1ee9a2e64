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

HF families (`HF_FAMILIES`): transformers' own classes on the fsdp backend and the embedded engine
(whose batched KV cache carries every cache layer kind they use, rollout/engine_batch.py). The megatron
backend refuses all but qwen3_5, qwen3_5_moe, qwen3_next, deepseek_v3, glm4_moe_lite, glm4_moe, gpt_oss and minimax_m2 by name with
`Family.megatron` (the reason), before anything starts; Qwen3.5 has a bridge (`qwen3_5.py`: megatron-core's
GatedDeltaNet + gated attention, TP + SP / PP, CP 1; `qwen3_5_moe.py`: + experts and a gated shared expert,
R3; `qwen3_next.py`: + its fused in_proj_qkvz / in_proj_ba), the other five a bridge, R3 through the routers' replay hook
(`models/bridge/deepseek_v3.py`: MLA + DeepSeek MoE at TP / SP / EP; GLM-4.7-Flash's classes are
DeepSeek-V3's renamed, its dense layers named by `mlp_layer_types`: `glm4_moe_lite.py`; GLM-4.5: GQA
attention with a partial rotary + DeepSeek's MoE, `glm4_moe.py`, at TP / SP / EP as Qwen3-MoE; GPT-OSS:
sinks, sliding windows, biased clamped experts, `gpt_oss.py`, at TP / SP / EP with expert TP 1; MiniMax-M2:
whole-projection q/k norms + sigmoid-routed experts, `minimax_m2.py`, at TP + SP / EP).
DeepSeek-V3.2: DeepSeek-V3's bridge plus the DSA indexer on megatron-core's DSAttention (`deepseek_v32.py`).
qwen3_5       Qwen3_5ForCausalLM      gated-DeltaNet linear attention (conv + recurrent state) / full; megatron too
qwen3_5_moe   Qwen3_5MoeForCausalLM   the same, MoE with a gated shared expert; megatron too
qwen3_next    Qwen3NextForCausalLM    the same as Qwen3.5-MoE (its predecessor); megatron too
glm4_moe      Glm4MoeForCausalLM      GLM-4.5: partial rotary, q/k norm, sigmoid group routing, shared expert; megatron too
glm4_moe_lite Glm4MoeLiteForCausalLM  GLM-4.7-Flash: MLA attention, DeepSeek-style MoE; megatron too
deepseek_v3   DeepseekV3ForCausalLM   MLA, first layers dense, sigmoid group-limited routing (noaux_tc); megatron too
deepseek_v32  DeepseekV32ForCausalLM  V3 + the DSA indexer: top-k sparse attention over its own key cache; megatron too
gpt_oss       GptOssForCausalLM       sliding-window / full layers, attention sinks, biased fused experts; megatron too
nemotron_h    NemotronHForCausalLM    Mamba-2 (conv + SSM state) / attention / relu2 MoE layers
minimax_m2    MiniMaxM2ForCausalLM    full attention with whole-projection q/k norm, sigmoid-routed MoE; megatron too
gemma4        Gemma4ForCausalLM       sliding / full layers (own head dim), per-layer inputs (text model)
Their on-disk names: models/checkpoint_layout.py. Refused by name (`REFUSED_ARCHITECTURES`): the
vision-language checkpoints of these families (their text `*ForCausalLM` is taken).

Vision-language families (`VLM_FAMILIES`, models/vlm.py): HF's classes with their vision tower on the
fsdp backend and the embedded engine (images through `image_data`); megatron refuses them by name.
qwen3_vl    Qwen3VLForConditionalGeneration     Qwen3 text model + ViT with deepstack, interleaved M-RoPE
qwen2_5_vl  Qwen2_5_VLForConditionalGeneration  Qwen2.5 text model + windowed ViT, M-RoPE
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads with the first model, not with the module (the Dagster code location)
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
_NO_BRIDGE = "no megatron bridge is written here for {what}; train it with --train-backend fsdp"

# Families only HF's classes run (fsdp + the embedded engine); megatron refuses each with its reason.
HF_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        # megatron: models/bridge/qwen3_5.py (megatron-core's GatedDeltaNet, gated attention; TP + SP / PP, CP 1)
        Family("qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(_LINEAR)),
        # megatron: models/bridge/qwen3_5_moe.py (Qwen3.5's layers + softmax top-k experts, gated shared expert)
        Family("qwen3_5_moe", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", _QWEN_NEXT_MOE, moe=True),
        # megatron: models/bridge/qwen3_next.py (Qwen3.5-MoE's mapping, its fused in_proj_qkvz / in_proj_ba)
        Family("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
               {**_QWEN_NEXT_MOE, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
               moe=True),
        # megatron: models/bridge/glm4_moe.py (GQA + partial rotary as dense.py, DeepSeek-V3's MoE)
        Family("glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeConfig",
               {**_DEEPSEEK_MOE, "routed_scaling_factor": 1.0, "use_qk_norm": True, "n_group": 1, "topk_group": 1,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
               moe=True),
        # megatron: models/bridge/glm4_moe_lite.py (DeepSeek-V3's mapping; dense layers by mlp_layer_types)
        Family("glm4_moe_lite", "Glm4MoeLiteForCausalLM", "Glm4MoeLiteConfig",
               {**_DEEPSEEK_MOE, **_MLA, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.8},
               layer_pattern={"mlp_layer_types": ("dense", "sparse")}, mla=True, moe=True),
        # 2 groups of 2 experts, 1 group per token: the group-limited routing runs
        # megatron: models/bridge/deepseek_v3.py (MLA, first layers dense, sigmoid group routing, expert bias)
        Family("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config",
               {**_DEEPSEEK_MOE, **_MLA, "n_group": 2, "topk_group": 1}, mla=True, moe=True),
        # megatron: models/bridge/deepseek_v32.py (V3's mapping + the indexer, on megatron-core's DSAttention)
        # the indexer keeps 8 of the context's tokens per query: the sparse attention runs at test lengths;
        # 8 indexer heads keep its ReLU scores off ties (ties make top-k differ between shapes)
        Family("deepseek_v32", "DeepseekV32ForCausalLM", "DeepseekV32Config",
               {**_DEEPSEEK_MOE, **_MLA, "n_group": 2, "topk_group": 1, "index_topk": 8, "index_head_dim": 16,
                "index_n_heads": 8},
               layer_pattern={"mlp_layer_types": ("dense", "sparse")}, mla=True,
               moe=True),
        # an 8-token window: the sliding layers drop context at test lengths
        # megatron: models/bridge/gpt_oss.py (sinks, windows, biased clamped experts; expert TP 1)
        Family("gpt_oss", "GptOssForCausalLM", "GptOssConfig",
               {"head_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
               layer_pattern={"layer_types": ("sliding_attention", "full_attention")}, moe=True),
        # Mamba-2 / attention / MoE layers (3 at least, one of each); relu2 experts without a gate
        Family("nemotron_h", "NemotronHForCausalLM", "NemotronHConfig",
               {"head_dim": 32, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 1,
                "chunk_size": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                "moe_shared_expert_intermediate_size": 48, "n_group": 1, "topk_group": 1, "tie_word_embeddings": False},
               layer_pattern={"layers_block_type": ("linear_attention", "full_attention", "moe")}, moe=True,
               megatron=_NO_BRIDGE.format(what="Mamba-2 layers (Nemotron-H)")),
        Family("minimax_m2", "MiniMaxM2ForCausalLM", "MiniMaxM2Config",
               {"head_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "bos_token_id": None,
                "eos_token_id": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
               moe=True),  # megatron: models/bridge/minimax_m2.py (whole-projection q/k norms over TP)
        Family("gemma4", "Gemma4ForCausalLM", "Gemma4TextConfig",
               {"head_dim": 32, "sliding_window": 8, "hidden_size_per_layer_input": 8},
               layer_pattern={"layer_types": ("sliding_attention", "full_attention")},
               megatron=_NO_BRIDGE.format(what="Gemma-4's per-layer inputs and mixed head dims")),
    )
}  # fmt: skip
_NO_VLM_BRIDGE = "no megatron bridge is written here for vision-language models ({what}); train it with --train-backend fsdp"
# The tiny config of a VLM family is models/vlm.py's (a nested text + vision config), not `tiny_config`.
VLM_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("qwen3_vl", "Qwen3VLForConditionalGeneration", "Qwen3VLConfig", {},
               megatron=_NO_VLM_BRIDGE.format(what="Qwen3-VL")),
        Family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig", {},
               megatron=_NO_VLM_BRIDGE.format(what="Qwen2.5-VL")),
    )
}  # fmt: skip
ALL_FAMILIES: dict[str, Family] = {**FAMILIES, **MOE_FAMILIES, **HF_FAMILIES, **VLM_FAMILIES}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(f.architecture for f in ALL_FAMILIES.values())
# Real architectures refused by name, with why (validate_hf_dir raises it).
_VL = "a vision-language checkpoint: the text model's {arch} checkpoint is taken (no vision tower is served)"
REFUSED_ARCHITECTURES: dict[str, str] = {
    f"{a}ForConditionalGeneration": _VL.format(arch=f"{a}ForCausalLM")
    for a in ("Qwen3_5", "Qwen3_5Moe", "Gemma4")
}


def family_of(hf_config: Any) -> Family | None:
    """The family of an HF config (PretrainedConfig or config.json dict), or None."""
    cfg = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    archs = cfg.get("architectures") or []
    return next((f for f in ALL_FAMILIES.values() if f.architecture in archs), None)


def routed_experts(cfg: dict[str, Any]) -> int:
    """A config.json's routed expert count (0: dense), under any family's name for it."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)


def is_moe_config(hf_config: Any) -> bool:
    fam = family_of(hf_config)
    return fam is not None and fam.moe


def tiny_config(family: str, vocab_size: int, **overrides):
    """A tiny random config of `family` (a few hundred thousand parameters at the defaults)."""
    if family not in ALL_FAMILIES or family in VLM_FAMILIES:
        raise ValueError(
            f"model family {family!r}: supported {sorted(set(ALL_FAMILIES) - set(VLM_FAMILIES))} "
            "(a vision-language one: models/vlm.py tiny_vlm_config)"
        )
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
    if (
        fam.name == "nemotron_h"
    ):  # its layer count is its block pattern's: one Mamba, attention and MoE layer at least
        n = max(cfg["num_hidden_layers"], 3)
        cfg["layers_block_type"] = [fam.layer_pattern["layers_block_type"][i % 3] for i in range(n)]
        cfg["num_hidden_layers"] = n
    if fam.name == "gemma4":  # the per-layer input embedding covers the vocabulary; one head dim
        cfg.update(vocab_size_per_layer_input=cfg["vocab_size"], global_head_dim=cfg["head_dim"])
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
                p.normal_(0.0, _init_range(config))
    model.eval()
    return model


def _init_range(config) -> float:
    """initializer_range of a config, or of its text config (vision-language configs nest it)."""
    r = getattr(config, "initializer_range", None)
    if r is None and hasattr(config, "get_text_config"):
        r = getattr(config.get_text_config(), "initializer_range", None)
    return 0.02 if r is None else r
