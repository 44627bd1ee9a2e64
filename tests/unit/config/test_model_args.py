"""Megatron's model flags (a Miles launch script's MODEL_ARGS) are checked against the checkpoint's
config.json: equal passes, anything else names the flag, both values and the config key."""

import json

import pytest

from miles_platform.config import ConfigError, parse_run_config
from miles_platform.config.model_args import moe_layer_pattern
from miles_platform.models.architecture import check_model_args, megatron_model_args
from miles_platform.models.tiny import save_tiny_checkpoint


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    out = {}
    for fam in ("qwen3", "qwen2", "llama", "qwen3_moe"):
        path = save_tiny_checkpoint(tmp_path_factory.mktemp(fam) / "ckpt", fam)
        out[fam] = json.loads((tmp_path_factory.getbasetemp() / path / "config.json").read_text())
    return out


def _argv_of(view: dict) -> list[str]:
    """The model flags a Miles script would pass for a checkpoint with this view."""
    argv = []
    for name, (_, _, value) in view.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is None or value is False:
            continue
        elif name == "moe_layer_freq":
            argv += [flag, "[" + ",".join(map(str, value)) + "]"]
        else:
            argv += [flag, str(value)]
    return argv


@pytest.mark.parametrize("fam", ["qwen3", "qwen2", "llama", "qwen3_moe"])
def test_the_flags_that_describe_a_checkpoint_pass(families, fam):
    argv = _argv_of(megatron_model_args(families[fam]))
    assert "--num-layers" in argv and "--vocab-size" in argv
    cfg = parse_run_config(["--rollout-batch-size", "2", *argv])
    check_model_args(cfg.model_args_given(), families[fam], "config.json")


@pytest.mark.parametrize(
    ("fam", "argv", "key", "said"),
    [
        ("qwen3", ["--hidden-size", "33"], "hidden_size", "is 32"),
        ("qwen3", ["--num-layers", "3"], "num_hidden_layers", "is 2"),
        ("qwen3", ["--rotary-base", "1000000"], "rope_theta", "is 10000.0"),
        ("qwen3", ["--untie-embeddings-and-output-weights"], "tie_word_embeddings", "is True"),
        ("qwen3", ["--add-qkv-bias"], "model_type", "is 'qwen3'"),
        ("qwen2", ["--qk-layernorm"], "model_type", "is 'qwen2'"),
        ("qwen3", ["--num-experts", "4"], "num_experts", "has no num_experts"),
        ("qwen3_moe", ["--moe-router-topk", "8"], "num_experts_per_tok", "is 2"),
        ("qwen3_moe", ["--moe-layer-freq", "[0]*1+[1]*1"], "mlp_only_layers / decoder_sparse_step", ""),
        ("qwen3", ["--vocab-size", "151936"], "vocab_size", ""),
        ("qwen3", ["--model-name", "qwen2"], "model_type", "is 'qwen3'"),
    ],
)
def test_a_flag_the_checkpoint_contradicts_is_named_with_both_values(families, fam, argv, key, said):
    cfg = parse_run_config(["--rollout-batch-size", "2", *argv])
    with pytest.raises(ConfigError) as e:
        check_model_args(cfg.model_args_given(), families[fam], "/ckpt/config.json")
    msg = str(e.value)
    assert msg.startswith(argv[0]) and key in msg and said in msg and "/ckpt/config.json" in msg, msg
    if len(argv) > 1:
        assert argv[1] in msg or f"{float(argv[1]):g}" in msg


def test_moe_layer_freq_patterns():
    assert moe_layer_pattern("1", 3) == [1, 1, 1]
    assert moe_layer_pattern("2", 4) == [1, 0, 1, 0]
    assert moe_layer_pattern("([0]*3+[1]*2)", 5) == [0, 0, 0, 1, 1]
    assert moe_layer_pattern("[1,0,1]", 3) == [1, 0, 1]
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        parse_run_config(["--rollout-batch-size", "2", "--moe-layer-freq", "__import__('os')"])


def test_vocab_padding_multiple_is_the_bridges_or_refused():
    assert parse_run_config(["--rollout-batch-size", "2", "--make-vocab-size-divisible-by", "128"])
    with pytest.raises(ConfigError, match=r"--make-vocab-size-divisible-by 16: .*lcm\(128, TP\)"):
        parse_run_config(["--rollout-batch-size", "2", "--make-vocab-size-divisible-by", "16"])


# Miles' scripts/models/glm4.5-106B-A12B.py and glm4.7-flash.py model flags, less the refused ones (MLA,
# kernels): sigmoid routers with an expert bias, a dense first layer, q/k/v-only biases (GLM-4.5),
# MLA's kv_channels = the no-rope q/k dim and its latent norms (GLM-4.7-Flash)
GLM45 = ("--disable-bias-linear --group-query-attention --num-attention-heads 96 --num-query-groups 8 "
         "--kv-channels 128 --num-layers 46 --hidden-size 4096 --ffn-hidden-size 10944 --add-qkv-bias "
         "--normalization RMSNorm --position-embedding-type rope --rotary-percent 0.5 --swiglu "
         "--untie-embeddings-and-output-weights --vocab-size 151552 --rotary-base 1000000 "
         "--moe-ffn-hidden-size 1408 --moe-shared-expert-intermediate-size 1408 --moe-router-pre-softmax "
         "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-topk 8 "
         "--moe-layer-freq [0]*1+[1]*45 --num-experts 128")  # fmt: skip
GLM47_FLASH = ("--moe-layer-freq [0]*1+[1]*46 --num-experts 64 --moe-shared-expert-intermediate-size 1536 "
               "--moe-router-topk 4 --moe-ffn-hidden-size 1536 --moe-router-score-function sigmoid "
               "--moe-router-pre-softmax --moe-router-enable-expert-bias --moe-router-topk-scaling-factor 1.8 "
               "--num-layers 47 --hidden-size 2048 --ffn-hidden-size 10240 --num-attention-heads 20 "
               "--disable-bias-linear --add-qkv-bias --swiglu --untie-embeddings-and-output-weights "
               "--position-embedding-type rope --no-position-embedding --normalization RMSNorm "
               "--norm-epsilon 1e-5 --qk-layernorm --kv-channels 192 --rotary-base 1000000 "
               "--multi-latent-attention --q-lora-rank 768 --kv-lora-rank 512 --qk-head-dim 192 --v-head-dim 256 "
               "--qk-pos-emb-head-dim 64")  # fmt: skip


@pytest.mark.parametrize(
    "flags, config",
    [
        (GLM45, dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", hidden_size=4096,
                     intermediate_size=10944, num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
                     head_dim=128, moe_intermediate_size=1408, n_routed_experts=128, num_experts_per_tok=8,
                     n_shared_experts=1, first_k_dense_replace=1, vocab_size=151552, attention_bias=True,
                     tie_word_embeddings=False, partial_rotary_factor=0.5, rope_theta=1000000.0)),
        (GLM47_FLASH, dict(architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite", hidden_size=2048,
                           intermediate_size=10240, num_hidden_layers=47, num_attention_heads=20,
                           num_key_value_heads=20, moe_intermediate_size=1536, n_routed_experts=64,
                           num_experts_per_tok=4, n_shared_experts=1, routed_scaling_factor=1.8, q_lora_rank=768,
                           kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                           rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=1000000.0)),
    ],
)  # fmt: skip
def test_miles_glm_model_flags_agree_with_the_glm_config(flags, config):
    cfg = parse_run_config(["--hf-checkpoint", "/x", "--rollout-batch-size", "4", "--global-batch-size", "4",
                            *flags.split()])  # fmt: skip
    check_model_args(cfg.model_args_given(), config, "config.json")  # GLM's own script passes as is
    with pytest.raises(
        ConfigError, match="--moe-router-score-function softmax: .*i.e. --moe-router-score-function sigmoid"
    ):
        check_model_args({"moe_router_score_function": "softmax"}, config, "config.json")


# Miles' scripts/models/deepseek-v3.py model_args() (61 layers), verbatim, and DeepSeek-V3's config.json
DEEPSEEK_V3_ARGS = (
    "--disable-bias-linear --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 "
    "--kv-channels 128 --normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --swiglu "
    "--untie-embeddings-and-output-weights --vocab-size 129280 --multi-latent-attention --q-lora-rank 1536 "
    "--kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm "
    "--rotary-scaling-factor 40 --rotary-base 10000 --mscale 1.0 --mscale-all-dim 1.0 --attention-softmax-in-fp32 "
    "--no-rope-fusion --num-experts 256 --moe-layer-freq [0]*3+[1]*58 --moe-ffn-hidden-size 2048 "
    "--moe-router-topk 8 --moe-shared-expert-intermediate-size 2048 --moe-router-pre-softmax "
    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-load-balancing-type "
    "seq_aux_loss --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0 --moe-router-bias-update-rate 0 "
    "--moe-router-group-topk 4 --moe-router-num-groups 8 --moe-grouped-gemm --moe-router-topk-scaling-factor 2.5 "
    "--moe-router-dtype fp32 --moe-permute-fusion"
)
DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
    num_attention_heads=128, num_key_value_heads=128, num_hidden_layers=61, vocab_size=129280, rms_norm_eps=1e-6,
    hidden_act="silu", tie_word_embeddings=False, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000, max_position_embeddings=163840,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "type": "yarn"},
    n_routed_experts=256, moe_intermediate_size=2048, num_experts_per_tok=8, n_shared_experts=1,
    first_k_dense_replace=3, routed_scaling_factor=2.5, n_group=8, topk_group=4, topk_method="noaux_tc",
    scoring_func="sigmoid", norm_topk_prob=True, attention_bias=False,
)  # fmt: skip


def test_miles_deepseek_v3_mla_and_yarn_flags_are_checked_not_refused():
    """Miles' deepseek-v3 script's MLA (--multi-latent-attention, the latent ranks, the head dims) and YaRN
    (--mscale / --mscale-all-dim) flags describe DeepSeek-V3's config.json: they pass as is; each contradicted
    one is named with both values and the config key; on a model without MLA the flag is refused."""
    cfg = parse_run_config(["--hf-checkpoint", "/x", "--rollout-batch-size", "4", "--global-batch-size", "4",
                            "--train-backend", "megatron", *DEEPSEEK_V3_ARGS.split()])  # fmt: skip
    given = cfg.model_args_given()
    assert {"multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
            "v_head_dim", "mscale", "mscale_all_dim"} <= set(given)  # fmt: skip
    check_model_args(given, DEEPSEEK_V3, "config.json")
    check_model_args({"beta_fast": 32.0, "beta_slow": 1.0}, DEEPSEEK_V3, "config.json")  # HF's values
    for flags, match in (
        ({"kv_lora_rank": 256}, r"--kv-lora-rank 256: .*kv_lora_rank is 512"),
        ({"qk_head_dim": 192}, r"--qk-head-dim 192: .*qk_nope_head_dim is 128"),
        ({"qk_pos_emb_head_dim": 32}, r"--qk-pos-emb-head-dim 32: .*qk_rope_head_dim is 64"),
        ({"mscale_all_dim": 0.707}, r"--mscale-all-dim 0.707: .*rope_scaling.mscale_all_dim is 1.0"),
        ({"beta_fast": 16.0}, r"--beta-fast 16: .*rope_scaling.beta_fast is 32"),
    ):
        with pytest.raises(ConfigError, match=match):
            check_model_args(flags, DEEPSEEK_V3, "config.json")
    dense = {**GPT_OSS_20B, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    with pytest.raises(ConfigError, match=r"--multi-latent-attention set: .*has no kv_lora_rank \(rules out"):
        check_model_args({"multi_latent_attention": True}, dense, "config.json")


# Miles' scripts/models/gpt-oss-20b.py model_args(), verbatim, and GPT-OSS-20B's config.json
GPT_OSS_20B_ARGS = (
    "--num-layers 24 --hidden-size 2880 --ffn-hidden-size 2880 --num-attention-heads 64 --group-query-attention "
    "--num-query-groups 8 --kv-channels 64 --use-rotary-position-embeddings --rotary-percent 1.0 "
    "--rotary-base 150000 --max-position-embeddings 131072 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu "
    "--untie-embeddings-and-output-weights --vocab-size 201088 --softmax-type learnable --window-size 128,0 "
    "--window-attn-skip-freq 2 --no-masked-softmax-fusion --no-rope-fusion --num-experts 32 --moe-router-topk 4 "
    "--moe-aux-loss-coeff 0.0 --moe-token-dispatcher-type alltoall --moe-router-dtype fp32 --moe-grouped-gemm"
)
GPT_OSS_20B = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_hidden_layers=24, hidden_size=2880,
    intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64, rope_theta=150000,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096},
    max_position_embeddings=131072, rms_norm_eps=1e-5, vocab_size=201088, tie_word_embeddings=False,
    num_local_experts=32, num_experts_per_tok=4, sliding_window=128, attention_bias=True, swiglu_limit=7.0,
    layer_types=["sliding_attention", "full_attention"] * 12, hidden_act="silu",
)  # fmt: skip


def _gpt_oss_cfg(extra: str = ""):
    return parse_run_config(["--hf-checkpoint", "/x", "--rollout-batch-size", "4", "--global-batch-size", "4",
                             *GPT_OSS_20B_ARGS.split(), *extra.split()])  # fmt: skip


def test_miles_gpt_oss_model_flags_agree_with_the_gpt_oss_config():
    """The window, the sinks and the clamp are model flags like the others: Miles' own gpt-oss script passes
    as is (its --window-size 128,0, and megatron's exact 127,0 for HF's 128 keys), each checked."""
    check_model_args(_gpt_oss_cfg().model_args_given(), GPT_OSS_20B, "config.json")
    for ok in (
        "--window-size 127,0",
        "--window-attn-skip-freq [1,0]*12",
        "--activation-func-clamp-value 7.0",
    ):
        check_model_args(_gpt_oss_cfg(ok).model_args_given(), GPT_OSS_20B, "config.json")


@pytest.mark.parametrize(
    ("extra", "config", "match"),
    [
        ("--window-size 64,0", GPT_OSS_20B, r"--window-size 64,0: .*sliding_window / layer_types is 128, i\.e\. --window-size 128,0"),
        ("--window-size 128,8", GPT_OSS_20B, r"--window-size 128,8: "),
        ("--window-attn-skip-freq 3", GPT_OSS_20B, r"--window-attn-skip-freq 3: .*layer_types.*i\.e\. --window-attn-skip-freq 2"),
        ("--activation-func-clamp-value 10", GPT_OSS_20B, r"--activation-func-clamp-value 10: .*swiglu_limit is 7\.0"),
        ("--softmax-type vanilla", GPT_OSS_20B, r"--softmax-type vanilla: .*model_type is 'gpt_oss', i\.e\. --softmax-type learnable"),
    ],
)  # fmt: skip
def test_a_window_sink_or_clamp_the_checkpoint_contradicts_is_named(extra, config, match):
    with pytest.raises(ConfigError, match=match):
        check_model_args(_gpt_oss_cfg(extra).model_args_given(), config, "config.json")


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--softmax-type", "learnable"], r"--softmax-type learnable: .*model_type is 'qwen3', i\.e\. --softmax-type vanilla"),
        (["--window-size", "128,0"], r"--window-size 128,0: the checkpoint's config.json has no sliding_window / layer_types"),
        (["--window-attn-skip-freq", "2"], r"--window-attn-skip-freq 2: the checkpoint's config.json"),
        (["--activation-func-clamp-value", "7"], r"--activation-func-clamp-value 7: the checkpoint's config.json has no swiglu_limit"),
    ],
)  # fmt: skip
def test_a_window_sink_or_clamp_on_a_model_without_one_is_refused(families, argv, match):
    cfg = parse_run_config(["--rollout-batch-size", "2", *argv])
    with pytest.raises(ConfigError, match=match):
        check_model_args(cfg.model_args_given(), families["qwen3"], "config.json")


@pytest.mark.parametrize(
    "argv", [["--window-size", "128"], ["--window-size", "a,b"], ["--window-attn-skip-freq", "x"]]
)
def test_a_malformed_window_flag_is_refused_at_parse(argv):
    with pytest.raises(ConfigError, match=argv[0]):
        parse_run_config(["--rollout-batch-size", "2", *argv]).validate()


def test_miles_spec_plugins_and_dsa_flags_are_checked_not_refused():
    """Miles' Qwen3.5 / Qwen3-Next / DeepSeek-V3.2 scripts pass `--spec <plugin> <function>` (and V3.2's
    DSA shapes): taken where the plugin is the checkpoint's own layers, which the bridge builds from
    config.json; another spec, or one on a model without a plugin, is refused naming what is taken."""
    from miles_platform.models.families import tiny_config

    v32 = tiny_config("deepseek_v32", 128).to_dict()
    q35 = tiny_config("qwen3_5", 128).to_dict()
    cfg = parse_run_config(["--rollout-batch-size", "2", "--spec", "miles_plugins.models.glm5.glm5", "get_glm5_spec",
                            "--experimental-attention-variant", "dsa", "--dsa-indexer-topk", "8",
                            "--dsa-indexer-n-heads", "8", "--dsa-indexer-head-dim", "16"])  # fmt: skip
    check_model_args(cfg.model_args_given(), v32, "config.json")
    check_model_args({"spec": ["miles_plugins.models.qwen3_5", "get_qwen3_5_spec"]}, q35, "config.json")
    check_model_args({"experimental_attention_variant": "gated_delta_net"}, q35, "config.json")
    gates = {"apply_layernorm_1p": True, "attention_output_gate": True}  # Qwen3.5's norms, gated attention
    check_model_args(gates, q35, "config.json")
    check_model_args(
        {**gates, "moe_shared_expert_gate": True}, tiny_config("qwen3_5_moe", 128).to_dict(), "c.json"
    )
    with pytest.raises(ConfigError, match=r"--moe-shared-expert-gate set: .*model_type is 'qwen3_5_text'"):
        check_model_args({"moe_shared_expert_gate": True}, q35, "config.json")
    with pytest.raises(ConfigError, match=r"--attention-output-gate set: .*model_type is 'deepseek_v32'"):
        check_model_args({"attention_output_gate": True}, v32, "config.json")
    for flags, config, match in (
        ({"spec": ["miles_plugins.models.qwen3_5", "get_qwen3_5_spec"]}, v32,
         r"--spec miles_plugins.models.qwen3_5 get_qwen3_5_spec: a custom megatron layer spec; .*DeepseekV32"),
        ({"spec": ["miles_plugins.models.glm4", "get_glm_spec"]}, q35, r"take Miles' spec flag only where"),
        ({"dsa_indexer_topk": 2048}, v32, r"--dsa-indexer-topk 2048: .*index_topk is 8"),
        ({"experimental_attention_variant": "dsa"}, q35, r"--experimental-attention-variant dsa: .*gated_delta_net"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            check_model_args(flags, config, "config.json")
    with pytest.raises(ConfigError, match=r"--experimental-attention-variant dsv4: not built here"):
        parse_run_config(
            ["--rollout-batch-size", "2", "--experimental-attention-variant", "dsv4"]
        )  # Miles' V4
