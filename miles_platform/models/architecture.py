"""A checkpoint's architecture in megatron's model-flag terms (the flags a Miles launch script passes,
config/model_args.py), read from its config.json, and the check that the flags given agree with it.

`megatron_model_args(config)` maps each flag to (the config.json key an error names, what the file
says there, the flag's value it means). Properties the architecture implies rather than a key
(q/k norm in Qwen3, q/k/v biases in Qwen2) name `model_type`.
"""

from __future__ import annotations

import math
from typing import Any

from miles_platform.config.flags import flag_name
from miles_platform.config.model_args import moe_layer_pattern, window_pair, windowed_layers
from miles_platform.errors import ConfigError

# Miles' `--spec` layer plugins (its scripts/models/*.py) for the architectures whose bridge here builds
# the same layers from config.json: the flag is taken where it names the checkpoint's own
MILES_SPECS = {
    "Qwen3_5ForCausalLM": ("miles_plugins.models.qwen3_5", "get_qwen3_5_spec"),
    "Qwen3_5MoeForCausalLM": ("miles_plugins.models.qwen3_5", "get_qwen3_5_spec"),
    "Qwen3NextForCausalLM": ("miles_plugins.models.qwen3_next", "get_qwen3_next_spec"),
    "DeepseekV32ForCausalLM": ("miles_plugins.models.glm5.glm5", "get_glm5_spec"),  # DSA: V3.2 and GLM-5's
}
# Qwen3.5 / Qwen3-Next: zero-centered (1 + w) norms, gated attention output; the MoE ones a gated shared
# expert (the layers their bridges build; Gemma's 1 + w norms have no megatron bridge here)
GATED_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
GATED_SHARED_EXPERT_TYPES = ("qwen3_5_moe_text", "qwen3_next")
# per-head RMSNorm on q and k (GLM-4.5: with use_qk_norm)
SINK_TYPES = ("gpt_oss",)  # attention sinks (megatron's learnable softmax) and a clamped SwiGLU
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")  # biases on q/k/v only
QKV_ONLY_ATTENTION_BIAS = ("glm4_moe",)  # attention_bias puts biases on q/k/v, none on o_proj
# routers scoring with a sigmoid and an expert score bias (e_score_correction_bias)
SIGMOID_ROUTER_TYPES = (
    "deepseek_v3",
    "deepseek_v32",
    "glm4_moe",
    "glm4_moe_lite",
    "nemotron_h",
    "minimax_m2",
)


def _with_defaults(config: dict) -> dict:
    """config.json with the keys its transformers config class defaults (a file may leave out
    `tie_word_embeddings`, `rms_norm_eps`, ...), text_config first for a multimodal config."""
    c = dict(config.get("text_config") or config)
    try:
        import transformers

        full = transformers.AutoConfig.for_model(
            c["model_type"], **{k: v for k, v in c.items() if k != "model_type"}
        ).to_dict()
        return {**full, **c}
    except Exception:  # an unknown model_type: the file as it is
        return c


def megatron_model_args(config: dict) -> dict[str, tuple[str, Any, Any]]:
    """flag field -> (config.json key, its value there, the value it means for the flag)."""
    from miles_platform.models.bridge.dense import rope_params

    c = _with_defaults(config)
    mt = str(c.get("model_type", ""))
    heads, hidden = c.get("num_attention_heads"), c.get("hidden_size")
    kv = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or (hidden // heads if hidden and heads else None)
    rope = rope_params(c)
    is_rope = "rope_theta" in c or bool(c.get("rope_parameters") or c.get("rope_scaling"))
    experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts")
    qkv_only = mt in QKV_ONLY_ATTENTION_BIAS
    bias = bool((c.get("attention_bias") and not qkv_only) or c.get("mlp_bias"))
    layers = c.get("num_hidden_layers")
    archs = list(c.get("architectures") or [])
    rotary = c.get("partial_rotary_factor") or (c.get("rope_parameters") or {}).get("partial_rotary_factor")
    sigmoid = mt in SIGMOID_ROUTER_TYPES
    mla = bool(c.get("kv_lora_rank"))  # megatron's MLA: kv_channels is the no-rope q/k dim; q/kv latent norms
    if mla:
        head_dim = c.get("qk_nope_head_dim")
    score = c.get("scoring_func") or ("sigmoid" if sigmoid else "softmax" if experts else None)
    shared = (c.get("shared_expert_intermediate_size") or c.get("moe_shared_expert_intermediate_size")
              or (c["n_shared_experts"] * c["moe_intermediate_size"] if c.get("n_shared_experts") else None))  # fmt: skip

    kinds = c.get("layer_types")
    windowed = [int(k == "sliding_attention") for k in kinds or []]
    window = c.get("sliding_window") if any(windowed) else None  # HF: W keys, i - W < j <= i

    # megatron's layer variant: DeepSeek-V3.2's sparse attention, Qwen3.5 / Qwen3-Next's DeltaNet layers
    variant = (
        "dsa" if c.get("index_topk") else "gated_delta_net" if "linear_attention" in (kinds or []) else None
    )

    def key(k: str) -> tuple[str, Any, Any]:
        return (k, c.get(k), c.get(k))

    yarn = rope["rope_type"] == "yarn"
    # megatron reads the YaRN fields only for a yarn rope (None: any value otherwise); its view of HF's, as
    # models/bridge/deepseek_v3.py maps them (HF's defaults beta_fast 32, beta_slow 1; mscale applies with
    # mscale_all_dim only)
    all_dim = rope.get("mscale_all_dim")
    yarn_view = {
        "beta_fast": ("rope_scaling.beta_fast", rope.get("beta_fast"), float(rope.get("beta_fast") or 32) if yarn else None),
        "beta_slow": ("rope_scaling.beta_slow", rope.get("beta_slow"), float(rope.get("beta_slow") or 1) if yarn else None),
        "mscale": ("rope_scaling.mscale", rope.get("mscale"),
                   (float(rope.get("mscale") or 1.0) if all_dim else 1.0) if yarn else None),
        "mscale_all_dim": ("rope_scaling.mscale_all_dim", all_dim, float(all_dim or 0.0) if yarn else None),
    }  # fmt: skip

    out = {
        "num_layers": key("num_hidden_layers"),
        "hidden_size": key("hidden_size"),
        "ffn_hidden_size": key("intermediate_size"),
        "num_attention_heads": key("num_attention_heads"),
        "group_query_attention": ("num_key_value_heads", kv, bool(kv and heads and kv < heads)),
        "num_query_groups": ("num_key_value_heads", kv, kv),
        "kv_channels": ("head_dim", c.get("head_dim"), head_dim),
        "normalization": ("rms_norm_eps", c.get("rms_norm_eps"), "RMSNorm" if "rms_norm_eps" in c else "LayerNorm"),
        "norm_epsilon": ("rms_norm_eps", c.get("rms_norm_eps"), c.get("rms_norm_eps", c.get("layer_norm_eps"))),
        "swiglu": ("hidden_act", c.get("hidden_act"), c.get("hidden_act") == "silu"),
        "disable_bias_linear": ("attention_bias", c.get("attention_bias"), not bias),
        # megatron's MLA reads no add_qkv_bias: either value (None)
        "add_qkv_bias": ("model_type", mt, None if mla else mt in QKV_BIAS_TYPES or bool(c.get("attention_bias"))),
        "qk_layernorm": ("model_type", mt, mla or mt in QK_NORM_TYPES or bool(c.get("use_qk_norm"))),
        "untie_embeddings_and_output_weights": (
            "tie_word_embeddings", c.get("tie_word_embeddings"), not c.get("tie_word_embeddings", True)
        ),
        "position_embedding_type": ("rope_theta", rope["rope_theta"], "rope" if is_rope else "learned_absolute"),
        "use_rotary_position_embeddings": ("rope_theta", rope["rope_theta"], is_rope),
        "no_position_embedding": ("rope_theta", rope["rope_theta"], is_rope),
        "rotary_base": ("rope_theta", rope["rope_theta"], rope["rope_theta"]),
        "rotary_percent": ("partial_rotary_factor", rotary, rotary or 1.0),
        "rotary_scaling_factor": ("rope_scaling.factor", rope.get("factor"), rope.get("factor")),
        "rope_type": ("rope_scaling.rope_type", rope["rope_type"], "yarn" if rope["rope_type"] == "yarn" else "rope"),
        "original_max_position_embeddings": (
            "rope_scaling.original_max_position_embeddings",
            rope.get("original_max_position_embeddings"),
            rope.get("original_max_position_embeddings"),
        ),
        "max_position_embeddings": key("max_position_embeddings"),
        "vocab_size": key("vocab_size"),
        "num_experts": ("num_experts", experts, experts),
        "moe_ffn_hidden_size": key("moe_intermediate_size"),
        "moe_router_topk": key("num_experts_per_tok"),
        "moe_layer_freq": (
            "mlp_only_layers / decoder_sparse_step / first_k_dense_replace / mlp_layer_types",
            (c.get("mlp_only_layers"), c.get("decoder_sparse_step")),
            _moe_layers(c, layers) if experts and layers else None,
        ),
        "moe_router_score_function": ("scoring_func", c.get("scoring_func"), score),
        # megatron reads pre-softmax only for a softmax router: a sigmoid one takes either (None)
        "moe_router_pre_softmax": ("norm_topk_prob", c.get("norm_topk_prob"),
                                   None if sigmoid else bool(experts) and not c.get("norm_topk_prob", False)),
        "moe_shared_expert_intermediate_size": ("shared_expert_intermediate_size", shared, shared),
        "moe_router_topk_scaling_factor": key("routed_scaling_factor"),
        "moe_router_enable_expert_bias": ("topk_method", c.get("topk_method"), c.get("topk_method") == "noaux_tc" or sigmoid),
        "moe_router_num_groups": key("n_group"),
        "moe_router_group_topk": key("topk_group"),
        "softmax_type": ("model_type", mt, "learnable" if mt in SINK_TYPES else "vanilla"),
        "window_size": ("sliding_window / layer_types", window, f"{window},0" if window else None),
        "window_attn_skip_freq": ("layer_types", kinds, windowed if window else None),
        "activation_func_clamp_value": (
            "swiglu_limit", c.get("swiglu_limit"), c.get("swiglu_limit") if mt in SINK_TYPES else None
        ),
        "multi_latent_attention": ("kv_lora_rank", c.get("kv_lora_rank"), mla),
        "q_lora_rank": key("q_lora_rank"),
        "kv_lora_rank": key("kv_lora_rank"),
        "qk_head_dim": key("qk_nope_head_dim"),
        "qk_pos_emb_head_dim": key("qk_rope_head_dim"),
        "v_head_dim": key("v_head_dim"),
        "apply_layernorm_1p": ("model_type", mt, mt in GATED_TYPES),
        "attention_output_gate": ("model_type", mt, mt in GATED_TYPES),
        "moe_shared_expert_gate": ("model_type", mt, mt in GATED_SHARED_EXPERT_TYPES),
        "experimental_attention_variant": ("index_topk / layer_types", c.get("index_topk") or kinds, variant),
        "dsa_indexer_n_heads": key("index_n_heads"),
        "dsa_indexer_head_dim": key("index_head_dim"),
        "dsa_indexer_topk": key("index_topk"),
        **yarn_view,
        "model_name": ("model_type", mt, mt),
        "spec": ("architectures", archs, list(MILES_SPECS[archs[0]]) if archs[:1] and archs[0] in MILES_SPECS else None),
    }  # fmt: skip
    return out


def _skip_freq(windowed: list[int]) -> str:
    """--window-attn-skip-freq for a 0/1 per layer (1 = windowed): N where that is the pattern."""
    for n in range(1, len(windowed) + 1):
        if windowed == windowed_layers(str(n), len(windowed)):
            return str(n)
    return str(windowed)


# flags whose view is None where megatron does not read them for the checkpoint's model: any value
ANY_VALUE = ("moe_router_pre_softmax", "add_qkv_bias", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _moe_layers(c: dict, layers: int) -> list[int]:
    """Which layers are MoE, as megatron's --moe-layer-freq lists them (HF: mlp_only_layers are dense,
    else every decoder_sparse_step-th layer is sparse)."""
    if c.get("mlp_layer_types"):  # GLM-4.7-Flash, DeepSeek-V3.2
        return [int(t == "sparse") for t in c["mlp_layer_types"]]
    first_dense = int(c.get("first_k_dense_replace") or 0)  # DeepSeek-V3, GLM-4.5
    dense = set(c.get("mlp_only_layers") or []) | set(range(first_dense))
    step = int(c.get("decoder_sparse_step") or 1)
    return [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]


def _norm_name(s: str) -> str:
    return str(s).lower().replace("-", "").replace("_", "")


def _agrees(name: str, given: Any, want: Any) -> bool:
    if name == "model_name":  # Miles' converter names: the model_type or its config class, any case
        return _norm_name(given) in (_norm_name(want), _norm_name(want) + "config")
    if name == "moe_layer_freq":
        return want is not None and moe_layer_pattern(given, len(want)) == want
    if name == "window_size":  # Miles' gpt-oss script: W,0; megatron's exact window of HF's W keys: W-1,0
        w = window_pair(want)[0] if want is not None else None
        return w is not None and window_pair(given) in ((w, 0), (w - 1, 0))
    if name == "window_attn_skip_freq":
        return want is not None and windowed_layers(given, len(want)) == want
    if name == "spec":  # Miles' `--spec MODULE FUNCTION`
        return want is not None and list(given) == want
    if isinstance(given, bool):
        return bool(want) is given
    if isinstance(given, int | float) and isinstance(want, int | float) and not isinstance(want, bool):
        return math.isclose(float(given), float(want), rel_tol=1e-9, abs_tol=0.0)
    return given == want


def check_model_args(given: dict[str, Any], config: dict, where: str) -> None:
    """Each model flag given (field -> value; bools only when set) against the checkpoint's config:
    ConfigError naming the flag, its value, the config key and the checkpoint's value (`where`: the
    config.json path, for the message)."""
    if not given:  # nothing to check: no bridge (megatron-core, torch) to import for it
        return
    view = megatron_model_args(config)
    for name, value in given.items():
        key, raw, want = view[name]
        if _agrees(name, value, want) or (name in ANY_VALUE and want is None):
            continue
        if name == "spec":
            took = ", ".join(" ".join(v) for v in MILES_SPECS.values())
            raise ConfigError(
                f"--spec {' '.join(map(str, value))}: a custom megatron layer spec; this build's bridges build each "
                f"model from config.json ({where}: architectures {raw}), and take Miles' spec flag only where it is "
                f"the checkpoint's own ({took}, for Qwen3.5 / -MoE, Qwen3-Next, DeepSeek-V3.2): drop the flag, or "
                "run that spec with Miles"
            )
        shown = "set" if value is True else f"{value:g}" if isinstance(value, float) else value
        said = f"has no {key}" if raw is None else f"{key} is {raw!r}"
        shown_want = _skip_freq(want) if name == "window_attn_skip_freq" and want else want
        means = "" if want == raw or isinstance(want, bool) else f", i.e. {flag_name(name)} {shown_want}"
        if isinstance(want, bool):
            means = f" ({'needs' if want else 'rules out'} {flag_name(name)})"
        raise ConfigError(
            f"{flag_name(name)} {shown}: the checkpoint's config.json {said}{means} ({where}). The model flags "
            "describe the checkpoint, they do not change it: fix the flag or point --hf-checkpoint at the model "
            "they describe"
        )
