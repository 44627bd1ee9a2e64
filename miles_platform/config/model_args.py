"""The model's architecture as a Miles launch script passes it: megatron's model flags, which Miles
scripts take from `scripts/models/<model>` (`MODEL_ARGS`). This build reads the architecture from
--hf-checkpoint's config.json; each flag given is checked against it before anything starts
(preflight, `models/architecture.py` says what the checkpoint's config means in these flags'
terms): equal, or an error naming the flag, both values and the config key. A flag not given is
not checked: the checkpoint decides.

`--make-vocab-size-divisible-by` is the one flag here about the trainer, not the model: how megatron
pads the embedding rows beyond `--vocab-size` (Miles pads to a multiple of it x TP; the HF export
drops the padding). The megatron backend here pads to a multiple of lcm(128, TP), so 128 is honoured
and any other value is refused (its torch_dist tensors would have other shapes)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from miles_platform.config.flags import POSITIVE, flag
from miles_platform.errors import ConfigError

RANGES: dict[str, tuple] = dict.fromkeys(
    ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
     "vocab_size", "make_vocab_size_divisible_by", "max_position_embeddings", "num_experts",
     "moe_ffn_hidden_size", "moe_router_topk", "moe_shared_expert_intermediate_size",
     "original_max_position_embeddings", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
     "v_head_dim", "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk"),
    POSITIVE,
)  # fmt: skip

ATTENTION_VARIANTS = ("dsa", "gated_delta_net")  # megatron-core's, as the bridges build them
VOCAB_PAD_MULTIPLE = 128  # models/bridge/base.py pads megatron's embedding to lcm(this, TP)
_G = "model"


@dataclass
class ModelArgsFlags:
    num_layers: int | None = flag(None, _G, "transformer layers (config.json num_hidden_layers)")
    hidden_size: int | None = flag(None, _G, "hidden size (hidden_size)")
    ffn_hidden_size: int | None = flag(None, _G, "MLP hidden size (intermediate_size)")
    num_attention_heads: int | None = flag(None, _G, "attention heads (num_attention_heads)")
    group_query_attention: bool = flag(False, _G, "GQA (num_key_value_heads < num_attention_heads)")
    num_query_groups: int | None = flag(None, _G, "key/value heads (num_key_value_heads)")
    kv_channels: int | None = flag(None, _G, "per-head dim (head_dim, else hidden_size / heads)")
    normalization: str | None = flag(
        None, _G, "norm kind (RMSNorm: rms_norm_eps)", choices=("LayerNorm", "RMSNorm")
    )
    norm_epsilon: float | None = flag(None, _G, "norm epsilon (rms_norm_eps)")
    swiglu: bool = flag(False, _G, "gated SiLU MLP (hidden_act silu)")
    disable_bias_linear: bool = flag(False, _G, "no linear biases (attention_bias / mlp_bias false)")
    add_qkv_bias: bool = flag(False, _G, "q/k/v biases (Qwen2 / attention_bias)")
    qk_layernorm: bool = flag(False, _G, "per-head q/k RMSNorm (Qwen3, Qwen3-MoE)")
    untie_embeddings_and_output_weights: bool = flag(
        False, _G, "separate output layer (tie_word_embeddings false)"
    )
    position_embedding_type: str | None = flag(
        None, _G, "position embedding (rope: rope_theta)", choices=("learned_absolute", "rope", "mrope", "relative", "none")
    )  # fmt: skip
    use_rotary_position_embeddings: bool = flag(
        False, _G, "rotary position embedding (megatron's older flag)"
    )
    no_position_embedding: bool = flag(
        False, _G, "no learned absolute position table (rope models have none)"
    )
    rotary_base: float | None = flag(None, _G, "rope theta (rope_theta / rope_parameters)")
    rotary_percent: float | None = flag(None, _G, "fraction of the head dim rotated (partial_rotary_factor)")
    rotary_scaling_factor: float | None = flag(None, _G, "rope scaling factor (rope_scaling.factor)")
    rope_type: str | None = flag(None, _G, "rope variant (rope_scaling.rope_type)", choices=("rope", "yarn"))
    original_max_position_embeddings: int | None = flag(
        None, _G, "context the rope scaling extends (rope_scaling.original_max_position_embeddings)"
    )
    max_position_embeddings: int | None = flag(None, _G, "context length (max_position_embeddings)")
    vocab_size: int | None = flag(None, _G, "vocabulary size, before megatron's padding (vocab_size)")
    make_vocab_size_divisible_by: int | None = flag(
        None, _G, f"megatron's embedding padding multiple (x TP); this build pads to {VOCAB_PAD_MULTIPLE}"
    )
    num_experts: int | None = flag(None, _G, "MoE experts (num_experts / num_local_experts)")
    moe_ffn_hidden_size: int | None = flag(None, _G, "expert MLP hidden size (moe_intermediate_size)")
    moe_router_topk: int | None = flag(None, _G, "experts per token (num_experts_per_tok)")
    moe_layer_freq: str | None = flag(
        None, _G, "which layers are MoE: N (every Nth) or a 0/1 list, e.g. [0]*3+[1]*45 (mlp_only_layers, decoder_sparse_step)"
    )  # fmt: skip
    moe_router_score_function: str | None = flag(
        None, _G, "router scores (scoring_func, else softmax)", choices=("softmax", "sigmoid", "sqrtsoftplus")
    )
    moe_router_pre_softmax: bool = flag(False, _G, "softmax before top-k (norm_topk_prob false)")
    moe_shared_expert_intermediate_size: int | None = flag(
        None, _G, "shared expert MLP size (shared_expert_intermediate_size)"
    )
    moe_router_topk_scaling_factor: float | None = flag(
        None, _G, "routed weights scale (routed_scaling_factor)"
    )
    moe_router_enable_expert_bias: bool = flag(False, _G, "aux-loss-free expert bias (topk_method noaux_tc)")
    moe_router_num_groups: int | None = flag(None, _G, "expert groups of group-limited routing (n_group)")
    moe_router_group_topk: int | None = flag(None, _G, "groups routed to per token (topk_group)")
    softmax_type: str | None = flag(
        None, _G, "attention softmax: learnable = GPT-OSS's attention sinks (model_type)",
        choices=("vanilla", "off-by-one", "learnable"),
    )  # fmt: skip
    window_size: str | None = flag(
        None, _G, "sliding window LEFT,RIGHT of the windowed layers (sliding_window W: W,0 as Miles' "
        "gpt-oss script, or megatron's exact W-1,0; both train HF's W keys)"
    )  # fmt: skip
    window_attn_skip_freq: str | None = flag(
        None,
        _G,
        "which layers attend fully: N (every Nth, 1-based) or a 0/1 list, 1 = windowed (layer_types)",
    )
    activation_func_clamp_value: float | None = flag(None, _G, "clamped SwiGLU limit (swiglu_limit)")
    multi_latent_attention: bool = flag(
        False, _G, "multi-latent attention (DeepSeek-V3 / Kimi: kv_lora_rank)"
    )
    q_lora_rank: int | None = flag(None, _G, "MLA's query latent rank (q_lora_rank; none: one q projection)")
    kv_lora_rank: int | None = flag(None, _G, "MLA's key / value latent rank (kv_lora_rank)")
    qk_head_dim: int | None = flag(None, _G, "MLA's per-head q/k dim without rope (qk_nope_head_dim)")
    qk_pos_emb_head_dim: int | None = flag(None, _G, "MLA's per-head rope dim (qk_rope_head_dim)")
    v_head_dim: int | None = flag(None, _G, "MLA's per-head value dim (v_head_dim)")
    apply_layernorm_1p: bool = flag(
        False, _G, "(1 + weight) norms (Qwen3.5 / Qwen3-Next's zero-centered RMSNorm)"
    )
    attention_output_gate: bool = flag(
        False, _G, "gated attention output (Qwen3.5 / Qwen3-Next's full-attention layers)"
    )
    moe_shared_expert_gate: bool = flag(
        False, _G, "a sigmoid-gated shared expert (Qwen3.5-MoE / Qwen3-Next: shared_expert_gate)"
    )
    experimental_attention_variant: str | None = flag(
        None, _G, "DeepSeek sparse attention (dsa: index_topk) or gated DeltaNet layers (gated_delta_net: "
        "linear_attention in layer_types)",
    )  # fmt: skip
    dsa_indexer_n_heads: int | None = flag(None, _G, "DSA indexer heads (index_n_heads)")
    dsa_indexer_head_dim: int | None = flag(None, _G, "DSA indexer head dim (index_head_dim)")
    dsa_indexer_topk: int | None = flag(None, _G, "keys each query keeps under DSA (index_topk)")
    beta_fast: float | None = flag(None, _G, "YaRN's beta_fast (rope_scaling.beta_fast, default 32)")
    beta_slow: float | None = flag(None, _G, "YaRN's beta_slow (rope_scaling.beta_slow, default 1)")
    mscale: float | None = flag(None, _G, "YaRN's mscale (rope_scaling.mscale)")
    mscale_all_dim: float | None = flag(None, _G, "YaRN's mscale_all_dim (rope_scaling.mscale_all_dim)")
    model_name: str | None = flag(None, _G, "Miles' converter name (model_type, e.g. qwen3, qwen3_moe)")
    spec: list[str] | None = flag(
        None, _G, "Miles' layer-spec plugin (MODULE FUNCTION, its scripts/models/*.py): taken where it is the "
        "checkpoint's own (Qwen3.5 / -MoE, Qwen3-Next, DeepSeek-V3.2: their bridges build the same layers from "
        "config.json)", nargs="+",
    )  # fmt: skip

    def model_args_given(self) -> dict[str, object]:
        """The model flags set (a bool set means true), by field name."""
        return {
            n: getattr(self, n)
            for n in MODEL_ARGS
            if n != "make_vocab_size_divisible_by" and getattr(self, n) not in (None, False)
        }

    def _check_model_args(self) -> None:
        """What needs no checkpoint: the padding multiple this build has, a parseable layer pattern."""
        m = self.make_vocab_size_divisible_by
        if m is not None and m != VOCAB_PAD_MULTIPLE:
            raise ConfigError(
                f"--make-vocab-size-divisible-by {m}: the megatron backend pads the embedding to a multiple of "
                f"lcm({VOCAB_PAD_MULTIPLE}, TP), so its torch_dist tensors do not depend on the TP size; pass "
                f"{VOCAB_PAD_MULTIPLE} or drop the flag (the HF weights are the same either way; start from "
                "--hf-checkpoint rather than a Miles torch_dist padded otherwise)"
            )
        v = self.experimental_attention_variant
        if v is not None and v not in ATTENTION_VARIANTS:
            raise ConfigError(
                f"--experimental-attention-variant {v}: not built here (the megatron bridges build "
                f"{', '.join(ATTENTION_VARIANTS)}: DeepSeek-V3.2's sparse attention, Qwen3.5 / Qwen3-Next's DeltaNet "
                "layers); DeepSeek-V4's attention runs with Miles"
            )
        if self.moe_layer_freq is not None:
            moe_layer_pattern(self.moe_layer_freq, self.num_layers or 1)
        if self.window_size is not None:
            window_pair(self.window_size)
        if self.window_attn_skip_freq is not None:
            windowed_layers(self.window_attn_skip_freq, self.num_layers or 1)


MODEL_ARGS = tuple(f.name for f in dataclasses.fields(ModelArgsFlags))


def moe_layer_pattern(value: str, num_layers: int) -> list[int]:
    """megatron's --moe-layer-freq as one 0/1 per layer: an int N (layer i is MoE when i % N == 0) or
    a Python list expression of 0/1 such as `[1,1,0]` or `([0]*3+[1]*45)` (evaluated without eval)."""
    import ast

    text = str(value).strip()
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise ConfigError(f"--moe-layer-freq {value}: must be >= 1")
        return [int(i % n == 0) for i in range(num_layers)]

    def ev(node):
        if isinstance(node, ast.List) and all(
            isinstance(e, ast.Constant) and e.value in (0, 1) for e in node.elts
        ):
            return [e.value for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return ev(node.left) + ev(node.right)
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Mult)
            and isinstance(node.right, ast.Constant)
        ):
            return ev(node.left) * int(node.right.value)
        raise ValueError

    try:
        return ev(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise ConfigError(
            f"--moe-layer-freq {value!r}: expected N or a 0/1 list such as [1,1,1] or ([0]*3+[1]*45)"
        ) from None


def window_pair(value: str) -> tuple[int, int]:
    """megatron's --window-size LEFT,RIGHT (tokens before and after a query it attends to)."""
    parts = [p.strip() for p in str(value).strip("()[] ").split(",")]
    if len(parts) != 2 or not all(p.lstrip("-").isdigit() for p in parts):
        raise ConfigError(f"--window-size {value}: expected LEFT,RIGHT, e.g. 128,0")
    left, right = int(parts[0]), int(parts[1])
    if left < 0 or right < 0:
        raise ConfigError(f"--window-size {value}: LEFT and RIGHT are token counts >= 0")
    return left, right


def windowed_layers(value: str, num_layers: int) -> list[int]:
    """megatron's --window-attn-skip-freq as one 0/1 per layer, 1 = sliding-window attention: an int N
    (layer numbers, 1-based, that are multiples of N attend fully) or a 0/1 list expression."""
    text = str(value).strip()
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise ConfigError(f"--window-attn-skip-freq {value}: must be >= 1")
        return [int((i + 1) % n != 0) for i in range(num_layers)]
    try:
        return moe_layer_pattern(text, num_layers)  # the same list syntax, read as-is
    except ConfigError:
        raise ConfigError(
            f"--window-attn-skip-freq {value}: expected N or a 0/1 list such as [1,0]*12"
        ) from None
