"""Miles recipes as Miles writes them: the argv of a launch script (MODEL_ARGS of a
scripts/models file, then CKPT_ARGS, ROLLOUT_ARGS, EVAL_ARGS, ... concatenated), modelled on Miles'
own examples with the model flags set to a tiny local checkpoint of the family and the paths to
test data. Each parses and passes validate_before_start; two (the GSM8K reproducibility recipe and
the MoE one with routing replay) run 2 rollouts end to end through `miles-platform train`; a wrong
--hidden-size fails naming the mismatch.

Megatron's parallelism, recompute and precision flags (--sequence-parallel, --recompute-*,
--accumulate-allreduce-grads-in-fp32, ...) are issue #47's and join these argvs when it lands; the
--sglang-* flags other than --sglang-max-running-requests are SGLang's (the embedded engine refuses
them by name), so only the SGLang recipe carries them."""

import base64
import json

import pytest

from miles_platform.cli import main as miles_platform
from miles_platform.config import ConfigError, parse_run_config
from miles_platform.models.tiny import save_tiny_checkpoint
from miles_platform.preflight import validate_before_start

# scripts/models/<model>.sh of the tiny checkpoints (models/tiny.py), in the shape of Miles' own
_DENSE = (
    "--swiglu --num-layers 2 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 2 "
    "--group-query-attention --num-query-groups 1 --use-rotary-position-embeddings --disable-bias-linear "
    "--normalization RMSNorm --norm-epsilon 1e-6 --vocab-size 259 --kv-channels 16 "
)
MODEL_ARGS = {
    "qwen3": (_DENSE + "--rotary-base 10000 --qk-layernorm").split(),  # qwen3-4B.py
    "qwen2": (_DENSE + "--rotary-base 10000 --add-qkv-bias").split(),  # qwen2.5-0.5B.py
    "qwen3_moe": (  # qwen3-30B-A3B.py
        "--disable-bias-linear --qk-layernorm --group-query-attention --num-attention-heads 2 "
        "--num-query-groups 1 --kv-channels 16 --num-layers 2 --hidden-size 32 --ffn-hidden-size 64 "
        "--normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --rotary-percent 1.0 "
        "--swiglu --vocab-size 259 --rotary-base 10000 --moe-ffn-hidden-size 96 "
        "--moe-router-score-function softmax --moe-token-dispatcher-type alltoall --moe-router-topk 2 "
        "--moe-layer-freq [1,1] --num-experts 4 --moe-grouped-gemm --moe-token-drop-policy probs "
        "--moe-router-dtype fp32 --moe-permute-fusion --moe-aux-loss-coeff 0"
    ).split(),
}
# what every Miles megatron recipe carries that is not the recipe's own
MISC_ARGS = (
    "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1 "
    "--expert-model-parallel-size 1 --attention-dropout 0.0 --hidden-dropout 0.0 --attention-backend flash "
    "--actor-num-nodes 1 --actor-num-gpus-per-node 1 --num-gpus-per-node 8 --num-cpus-per-actor 0.5"
).split()
GRPO_ARGS = (
    "--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl "
    "--entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28"
).split()
OPTIMIZER_ARGS = (
    "--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98"
).split()
WANDB_ARGS = (
    "--use-wandb --wandb-mode disabled --wandb-project miles-dev --wandb-group recipe --wandb-key frozen-key "
    "--disable-wandb-random-suffix"
).split()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Tiny checkpoints of the families (one fp8- and one int4-quantized, as Miles' low-precision
    recipes serve) and the data files the recipes point at."""
    from miles_platform.weights.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("recipes")
    ckpt = {fam: save_tiny_checkpoint(root / fam, fam) for fam in ("qwen3", "qwen2", "qwen3_moe")}
    ckpt["qwen3_fp8"] = str(root / "qwen3_fp8")
    quantize_checkpoint(ckpt["qwen3"], ckpt["qwen3_fp8"], "fp8")
    ckpt["qwen3_moe_int4"] = str(root / "qwen3_moe_int4")
    quantize_checkpoint(ckpt["qwen3_moe"], ckpt["qwen3_moe_int4"], "int4", group_size=16)
    rows = [{"prompt": f"What is {i}+{i}?", "label": str(2 * i)} for i in range(8)]
    (root / "dapo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "aime.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    gsm8k = [{"messages": [{"role": "user", "content": r["prompt"]}], "label": r["label"]} for r in rows]
    (root / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm8k))
    chats = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["label"]}]}
             for r in rows]  # fmt: skip
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    return {
        "root": root,
        "ckpt": ckpt,
        "data": {n: str(root / f"{n}.jsonl") for n in ("dapo", "aime", "gsm8k", "sft")},
    }


def _ckpt(env, fam, run):
    """CKPT_ARGS: --hf-checkpoint, --save / --load under the test's dir."""
    save = str(env["root"] / run / "ckpt")
    return ["--hf-checkpoint", env["ckpt"][fam], "--save", save, "--load", save, "--save-interval", "20"]


def _rollout(env, n=2, rm=("--rm-type", "deepscaler"), extra=()):
    return [
        "--prompt-data", env["data"]["dapo"], "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rollout-shuffle", *rm, "--num-rollout", "2",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", str(n), "--rollout-max-response-len", "8",
        "--rollout-temperature", "1", "--global-batch-size", str(2 * n), "--balance-data", *extra,
    ]  # fmt: skip


def _eval(env):
    return ["--eval-interval", "20", "--eval-prompt-data", "aime", env["data"]["aime"],
            "--n-samples-per-eval-prompt", "2", "--eval-max-response-len", "8", "--eval-top-p", "1"]  # fmt: skip


def _storage(env, run):
    return ["--storage-root", str(env["root"] / run / "root"), "--run-name", run]


def qwen3_4b_grpo(env):  # scripts/run_qwen3_4b.py
    return [*MODEL_ARGS["qwen3"], *_ckpt(env, "qwen3", "grpo"), "--save-retain-interval", "20",
            *_rollout(env), *OPTIMIZER_ARGS, *GRPO_ARGS, *WANDB_ARGS,
            "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216", *_eval(env), *MISC_ARGS,
            "--colocate", *_storage(env, "grpo")]  # fmt: skip


def qwen25_gsm8k(env):  # examples/experimental/reproducibility/run-qwen2.5-0.5B-gsm8k.sh
    return [
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--calculate-per-token-loss",
        *MODEL_ARGS["qwen2"], "--hf-checkpoint", env["ckpt"]["qwen2"],
        "--prompt-data", env["data"]["gsm8k"], "--input-key", "messages", "--label-key", "label",
        "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math", "--num-rollout", "2",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
        "--rollout-temperature", "1", "--global-batch-size", "4", "--optimizer", "adam", "--lr", "1e-6",
        "--lr-decay-style", "constant", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.98",
        *GRPO_ARGS, "--kl-coef", "0.00", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        "--context-parallel-size", "1", "--expert-model-parallel-size", "1", "--use-dynamic-batch-size",
        "--max-tokens-per-gpu", "9216", "--rollout-num-gpus-per-engine", "1", "--sglang-max-running-requests", "8",
        "--deterministic-mode", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--attention-backend",
        "flash", "--num-cpus-per-actor", "0.5", *_storage(env, "gsm8k"),
    ]  # fmt: skip


def qwen3_30b_a3b_r3(env):  # scripts/run_qwen3_30b_a3b.py with routing replay
    return [*MODEL_ARGS["qwen3_moe"], *_ckpt(env, "qwen3_moe", "moe"), *_rollout(env), *OPTIMIZER_ARGS,
            *GRPO_ARGS, "--use-rollout-routing-replay", "--moe-router-load-balancing-type", "seq_aux_loss",
            "--moe-router-bias-update-rate", "0", *_eval(env), *MISC_ARGS, *_storage(env, "moe")]  # fmt: skip


def qwen3_4b_fp8(env):  # examples/infra_features/low_precision/run-qwen3-4b-fp8.sh
    return ["--colocate", *MODEL_ARGS["qwen3"], *_ckpt(env, "qwen3_fp8", "fp8"), *_rollout(env),
            *OPTIMIZER_ARGS, *GRPO_ARGS, *_eval(env), *MISC_ARGS, *_storage(env, "fp8")]  # fmt: skip


def qwen3_30b_a3b_int4(env):  # examples/infra_features/low_precision/run-qwen3-30B-A3B-int4.sh
    return ["--colocate", *MODEL_ARGS["qwen3_moe"], *_ckpt(env, "qwen3_moe_int4", "int4"), *_rollout(env),
            *OPTIMIZER_ARGS, *GRPO_ARGS, "--use-tis", "--eval-interval", "10", "--eval-prompt-data",
            env["data"]["aime"], "--n-samples-per-eval-prompt", "8", "--eval-top-p", "0.7", *MISC_ARGS,
            *_storage(env, "int4")]  # fmt: skip


def qwen3_sglang_fully_async(env):  # train_async.py on SGLang engines (the --sglang-* flags as Miles')
    return [*MODEL_ARGS["qwen3"], *_ckpt(env, "qwen3", "async"), *_rollout(env), *OPTIMIZER_ARGS, *GRPO_ARGS,
            "--rollout-engine", "sglang", "--update-weight-transfer-mode", "broadcast", "--fully-async",
            "--max-weight-staleness", "2",
            "--sglang-mem-fraction-static", "0.7", "--sglang-cuda-graph-bs", "1", "2", "4", "8",
            "--sglang-quantization", "fp8", *MISC_ARGS, *_storage(env, "async")]  # fmt: skip


def qwen3_8b_opd(env):  # examples/on_policy_distillation/run-qwen3-8B-opd.sh
    return [*MODEL_ARGS["qwen3"], *_ckpt(env, "qwen3", "opd"), *_rollout(env, rm=()), *OPTIMIZER_ARGS,
            "--advantage-estimator", "grpo", "--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "1.0",
            "--opd-log-prob-top-k", "16", "--opd-top-k-strategy", "only-student", "--opd-reward-weight-mode",
            "student_p", "--custom-rm-path", "miles.rollout.on_policy_distillation.reward_func",
            "--custom-reward-post-process-path", "miles.rollout.on_policy_distillation.post_process_rewards",
            "--rm-url", "http://127.0.0.1:13141/generate", *MISC_ARGS, *_storage(env, "opd")]  # fmt: skip


def qwen3_tool_use(env):  # multi-turn tool calls with Miles' built-in multi-turn generate
    return [*MODEL_ARGS["qwen3"], *_ckpt(env, "qwen3", "tools"), *_rollout(env), *OPTIMIZER_ARGS, *GRPO_ARGS,
            "--custom-generate-function-path", "miles.rollout.generate_hub.multi_turn.generate",
            "--generate-tool-specs-path", "miles_platform.data.tool_use.TOOL_SPECS", "--generate-tool-call-parser",
            "qwen25", "--generate-execute-tool-function-path", "miles_platform.data.tool_use.execute_tool",
            "--generate-max-turns", "2", "--dynamic-sampling-filter-path",
            "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
            "--over-sampling-batch-size", "4", *MISC_ARGS, *_storage(env, "tools")]  # fmt: skip


def qwen3_4b_lora(env):  # examples/lora/run-qwen3-4B-megatron-lora.sh (LoRA trains on the fsdp backend here)
    return [*MODEL_ARGS["qwen3"], *_ckpt(env, "qwen3", "lora"), *_rollout(env), *OPTIMIZER_ARGS, *GRPO_ARGS,
            "--lora-rank", "32", "--lora-alpha", "32", "--lora-dropout", "0.0", "--target-modules", "all-linear",
            *MISC_ARGS, *_storage(env, "lora")]  # fmt: skip


def qwen3_eval_only(env):  # the v0 eval, no training (Miles' legacy one-path --eval-prompt-data)
    return [*MODEL_ARGS["qwen3"], "--hf-checkpoint", env["ckpt"]["qwen3"], *_rollout(env)[:-1],
            "--num-rollout", "0", "--eval-interval", "1", "--eval-prompt-data", env["data"]["aime"],
            "--n-samples-per-eval-prompt", "2", "--eval-max-response-len", "8", *MISC_ARGS,
            *_storage(env, "eval")]  # fmt: skip


def qwen3_sft(env):  # scripts/run_qwen3_sft.py (train_async.py, Miles' SFT rollout function)
    return [*MODEL_ARGS["qwen3"], *_ckpt(env, "qwen3", "sft"),
            "--rollout-function-path", "miles.rollout.sft_rollout.generate_rollout", "--prompt-data",
            env["data"]["sft"], "--input-key", "messages", "--rollout-shuffle", "--num-epoch", "3",
            "--rollout-batch-size", "4", "--global-batch-size", "4", "--loss-type", "sft_loss",
            "--calculate-per-token-loss", "--disable-compute-advantages-and-returns", "--debug-train-only",
            "--optimizer", "adam", "--lr", "1e-5", "--lr-decay-style", "cosine", "--min-lr", "1e-6",
            "--lr-warmup-fraction", "0.1", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            *WANDB_ARGS, *MISC_ARGS, *_storage(env, "sft")]  # fmt: skip


RECIPES = {  # name -> (argv builder, the entry it runs under: train.py or train_async.py)
    "qwen3-4b-grpo": (qwen3_4b_grpo, False),
    "qwen2.5-0.5b-gsm8k": (qwen25_gsm8k, False),
    "qwen3-30b-a3b-r3": (qwen3_30b_a3b_r3, False),
    "qwen3-4b-fp8": (qwen3_4b_fp8, False),
    "qwen3-30b-a3b-int4": (qwen3_30b_a3b_int4, False),
    "fully-async-sglang": (qwen3_sglang_fully_async, True),
    "qwen3-8b-opd": (qwen3_8b_opd, False),
    "multi-turn-tools": (qwen3_tool_use, False),
    "qwen3-4b-lora": (qwen3_4b_lora, False),
    "eval-only": (qwen3_eval_only, False),
    "qwen3-sft": (qwen3_sft, True),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_miles_recipe_parses_and_validates(env, name):
    build, train_async = RECIPES[name]
    cfg = parse_run_config(build(env), train_async=train_async)
    validate_before_start(cfg)
    if name == "fully-async-sglang":
        assert cfg.fully_async and cfg.sglang_args["cuda-graph-bs"] == ["1", "2", "4", "8"]
    if name == "qwen3-sft":
        assert not (cfg.fully_async or cfg.train_async) and cfg.uses_sft_rollout  # SFT: nothing to overlap
    if name == "eval-only":
        assert cfg.eval_datasets() == [("aime", env["data"]["aime"])]
    if name == "qwen3-8b-opd":
        assert cfg.reward_settings().pure_opd  # Miles' OPD reward function is --use-opd's own scoring
    assert not list(env["root"].glob(f"**/{cfg.run_name}/root/*")), "validation wrote under the storage root"


def test_a_wrong_hidden_size_names_flag_values_and_key(env):
    argv = qwen3_4b_grpo(env)
    argv[argv.index("--hidden-size") + 1] = "2560"
    with pytest.raises(ConfigError) as e:
        validate_before_start(parse_run_config(argv))
    assert str(e.value).startswith("--hidden-size 2560: the checkpoint's config.json hidden_size is 32 (")
    assert f"{env['ckpt']['qwen3']}/config.json" in str(e.value)


def test_miles_refusals_name_the_flag(env):
    base = ["--rollout-batch-size", "2"]
    with pytest.raises(ConfigError, match=r"^--update-weight-transfer-mode p2p: Miles' point-to-point"):
        parse_run_config([*base, "--update-weight-transfer-mode", "p2p"])
    with pytest.raises(ConfigError, match=r"^--moe-latent-size 4: latent MoE \(Nemotron-3\)"):
        parse_run_config([*base, "--moe-latent-size", "4"])
    with pytest.raises(
        ConfigError, match=r"^--apply-layernorm-1p set: the checkpoint's config.json model_type is 'qwen3'"
    ):
        validate_before_start(parse_run_config([*base, "--apply-layernorm-1p", "--hf-checkpoint", env["ckpt"]["qwen3"],
                                                "--prompt-data", env["data"]["dapo"], "--input-key", "prompt", "--rm-type", "math"]))  # fmt: skip
    with pytest.raises(ConfigError, match=r"^--attention-dropout 0.1: .*0 only"):
        parse_run_config([*base, "--attention-dropout", "0.1"])
    with pytest.raises(
        ConfigError, match=r"^--rollout-function-path 'miles.rollout.fully_async_rollout.x': a built-in"
    ):
        validate_before_start(parse_run_config(
            [*base, "--hf-checkpoint", env["ckpt"]["qwen3"], "--prompt-data", env["data"]["dapo"], "--input-key",
             "prompt", "--rm-type", "math", "--rollout-function-path", "miles.rollout.fully_async_rollout.x",
             "--storage-root", str(env["root"] / "refused")]
        ))  # fmt: skip
    with pytest.raises(SystemExit):  # no prefix matching: a Miles flag never binds to one of ours
        parse_run_config([*base, "--rollout-external", "h:1"])


def test_custom_config_path_applies_after_the_cli_as_miles(env, tmp_path):
    mis = tmp_path / "mis.yaml"  # examples/infra_features/train_infer_mismatch_helper/mis.yaml's shape
    mis.write_text("use_tis: true\ntis_mode: truncate\ntis_upper_bound: 2.0\nmy_function_knob: 3\n")
    cfg = parse_run_config(
        ["--rollout-batch-size", "2", "--tis-upper-bound", "5", "--custom-config-path", str(mis)]
    )
    assert (cfg.use_tis, cfg.tis_upper_bound, cfg.custom_function_args) == (
        True,
        2.0,
        {"my_function_knob": 3},
    )
    inline = "base64:" + base64.b64encode(b"lr: 0.5\n").decode()
    assert parse_run_config(["--rollout-batch-size", "2", "--custom-config-path", inline]).lr == 0.5


def test_the_gsm8k_recipe_runs_two_rollouts_through_miles_platform_train(env, capsys):
    """Miles' reproducibility recipe, its argv as is (tiny Qwen2.5, --deterministic-mode), through the CLI."""
    from miles_platform.startup import PHASES
    from miles_platform.store.catalog import Catalog
    from miles_platform.store.paths import StoragePaths

    argv = qwen25_gsm8k(env)
    assert miles_platform(["train", *argv]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    out = json.loads(printed[-1])
    assert (out["last_rollout_id"], out["final_version"]) == (1, 2)
    assert out["final_hf_path"].endswith("v000002")
    # where start-up went (miles_platform/startup.py): every phase, the CLI's launch included, once
    (line,) = [x for x in printed if x.startswith("[startup]")]
    assert [w for w in line.split(":", 1)[1].split() if w.isalpha()] == list(PHASES)
    root = argv[argv.index("--storage-root") + 1]
    _, rows = Catalog(StoragePaths(root)).query(
        "select rollout_id, name, value from metrics where name like 'perf/startup%' order by name"
    )
    assert {r[0] for r in rows} == {0} and len(rows) == len(PHASES) + 1  # the first rollout's only
    total = next(v for _, n, v in rows if n == "perf/startup_time")
    assert total == pytest.approx(sum(v for _, n, v in rows if n != "perf/startup_time"))
    assert float(line.split()[1]) == pytest.approx(total, abs=0.01)


def test_the_moe_recipe_with_routing_replay_runs_two_rollouts_through_miles_platform_train(env, capsys):
    """Miles' Qwen3-30B-A3B recipe with --use-rollout-routing-replay, its argv as is (tiny
    Qwen3-MoE, the MoE flags of scripts/models checked against its config), through the CLI: the
    rollouts record each token's routed experts and the trainer replays them."""
    from miles_platform.store.catalog import Catalog
    from miles_platform.store.paths import StoragePaths

    argv = qwen3_30b_a3b_r3(env)
    assert miles_platform(["train", *argv]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["last_rollout_id"], out["final_version"]) == (1, 2)
    root = argv[argv.index("--storage-root") + 1]
    _, rows = Catalog(StoragePaths(root)).query(
        "select rollout_id, response_tokens, rollout_routed_experts from rollouts order by rollout_id"
    )
    assert {r[0] for r in rows} == {0, 1} and len(rows) == 8  # 2 rollouts x 2 prompts x 2 samples
    for _, resp, routes in rows:  # per token: one top-2 choice per MoE layer (2 layers)
        assert (
            routes
            and len(routes) >= len(resp)
            and all(len(t) == 2 and all(len(e) == 2 for e in t) for t in routes)
        )
