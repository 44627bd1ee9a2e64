"""The rest of a Miles launch script: Miles and megatron flags with no field of their own here, each
with what it means in this build (docs/miles_flags.md has the table with the reasons).

  same     a kernel, layout or speed choice whose result this build computes its own way (the text
           says how); accepted, and a value that would change the result is refused (`allowed`,
           `when`)
  refused  a feature this build does not have: refused by name with the reason and what to do

The parser takes each as Miles does (same name, same arity); what was given lands in
`RunConfig.compat_flags` ({field name: value}) and `validate()` applies the verdicts. The model
flags are config/model_args.py's (checked against the checkpoint); megatron's parallelism and
precision flags are the megatron backend's (training.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles_platform.config.flags import flag_name
from miles_platform.errors import ConfigError

SAME, REFUSED = "same", "refused"


@dataclass(frozen=True)
class MilesFlag:
    kind: str  # bool | int | float | str | list: how the parser takes it (Miles' arity)
    verdict: str  # SAME | REFUSED
    why: str  # SAME: what this build does instead; REFUSED: the reason and what to do
    allowed: tuple = ()  # SAME: the values accepted (empty: any)
    when: Callable[[Any, Any], bool] | None = None  # SAME: (cfg, value) -> accepted


def _same(kind: str, why: str, allowed: tuple = (), when=None) -> MilesFlag:
    return MilesFlag(kind, SAME, why, allowed, when)


def _refused(kind: str, why: str) -> MilesFlag:
    return MilesFlag(kind, REFUSED, why)


_UNFUSED = "an unfused kernel: what the trainer here runs anyway (torch ops, megatron-core's local spec)"
_FAMILY = (
    "a megatron layer this build's megatron backend does not build from flags (its bridges build each model "
    "from config.json: Qwen3, Qwen2/2.5, Llama 3, Qwen3-MoE, Qwen3.5 / -MoE, Qwen3-Next, DeepSeek-V3, GLM-4.7-Flash, "
    "DeepSeek-V3.2, GLM-4.5, GPT-OSS, MiniMax-M2); Gemma-4 trains on "
    "--train-backend fsdp, built from config.json (models/families.py): drop the flag; other models: run them with Miles"
)
_DSA = (
    "a DSA kernel choice: DeepSeek-V3.2's sparse attention runs megatron-core's unfused DSAttention here, its "
    "indexer frozen as at Miles' default --dsa-indexer-loss-coeff 0 (training/megatron_dsa.py), built from "
    "config.json: drop the flag; V4's and GLM-5's sparse attention are not built (run them with Miles)"
)
_MTP = "multi-token prediction (MTP) heads are not built: train without them (drop the MTP flags)"
_FP8 = (
    "FP8 training (transformer-engine) is not built: the trainer computes in fp32 / bf16 "
    "(--train-forward-dtype); an fp8 / int4 --hf-checkpoint is taken (the trainer starts from its dequantized "
    "weights, every update re-quantizes for the engines: docs/weights.md), and SGLang engines quantize online "
    "with --sglang-quantization fp8"
)

_MEMORY = (
    "CUDA memory-history snapshots (Miles' --record-memory-history, torch or memray) are not built: "
    "--use-pytorch-profiler's trace records the allocations (profile_memory) and each rollout logs "
    "perf/actor_peak_device_mem_mb; drop the memory snapshot flags"
)

COMPAT: dict[str, MilesFlag] = {
    # ---- kernels, layouts and speed: the same result here
    "attention_backend": _same("str", "attention kernel (TE flash / fused / unfused): the trainer runs torch's attention, same math"),
    "attn_implementation": _same("str", "HF attention kernel of Miles' FSDP backend: the trainer runs HF's sdpa / eager, same math"),
    "transformer_impl": _same("str", "transformer-engine vs local layers: the megatron backend runs megatron-core's local spec, same math"),
    "qkv_format": _same("str", "packed-sequence tensor layout (bshd / thd): an internal layout, same math"),
    "moe_grouped_gemm": _same("bool", "experts as one grouped GEMM: the experts here run one by one (SequentialMLP / HF's blocks), same math"),
    "moe_permute_fusion": _same("bool", "a fused token-permute kernel: " + _UNFUSED),
    "moe_token_dispatcher_type": _same("str", "how tokens reach experts on other expert-parallel ranks (allgather / alltoall / flex): megatron-core's allgather dispatcher at EP 1 and its alltoall one at EP > 1 here; every dispatcher sends the same tokens to the same experts: the same result"),
    "moe_enable_deepep": _same("bool", "DeepEP's all-to-all kernels (CUDA): at EP > 1 megatron-core's alltoall dispatcher moves the same tokens over gloo / nccl here: the same result"),
    "moe_token_drop_policy": _same("str", "which tokens an expert over capacity drops: no capacity factor is set (dropless, megatron's default), so none is dropped"),
    "moe_router_load_balancing_type": _same(
        "str", "the load-balancing loss kind: at --moe-aux-loss-coeff 0 there is none; a non-zero coefficient takes aux_loss (Switch) only",
        when=lambda cfg, v: v == "aux_loss" or not cfg.moe_aux_loss_coeff,
    ),
    "moe_router_bias_update_rate": _same(
        "float", "the aux-loss-free expert-bias update rate: 0 (no update) only; the routers here have no expert bias",
        allowed=(0, 0.0),
    ),
    "no_rope_fusion": _same("bool", _UNFUSED),
    "no_bias_swiglu_fusion": _same("bool", _UNFUSED),
    "no_masked_softmax_fusion": _same("bool", _UNFUSED),
    "no_bias_dropout_fusion": _same("bool", _UNFUSED),
    "no_gradient_accumulation_fusion": _same("bool", _UNFUSED),
    "attention_dropout": _same("float", "dropout in attention: the trainer runs without dropout, as RL recipes do; 0 only", allowed=(0, 0.0)),
    "hidden_dropout": _same("float", "dropout on hidden states: the trainer runs without dropout, as RL recipes do; 0 only", allowed=(0, 0.0)),
    "balance_data": _same("bool", "which data-parallel rank trains which micro-batch of a step (Karmarkar-Karp token balance, for speed; Miles' DP schedule keeps each optimizer step's samples): ranks take samples round-robin here and the step is the same for any split (the loss is normalized over the global batch)"),
    "log_probs_chunk_size": _same("int", "chunking of the log-prob computation to save memory: log-probs are computed per micro-batch here, same values"),
    "data_pad_size_multiplier": _same("int", "padding of packed batches for the kernels: padding is masked out of the loss, same values"),
    "train_memory_margin_bytes": _same("int", "GPU memory kept free by dynamic batching: the token budget per micro-batch is --max-tokens-per-gpu"),
    "num_gpus_per_node": _same("int", "GPUs per node for placing engines: Ray places trainer ranks and engines on the devices each node reports"),
    "megatron_to_hf_mode": _same("str", "how megatron weights get HF names for the engines (raw / megatron-bridge): this build's bridges (models/bridge/) do it, same HF weights"),
    "enable_experimental": _same("bool", "megatron's gate for experimental features: nothing here is behind it"),
    "no_check_for_nan_in_loss_and_grad": _same("bool", "megatron stops at the first NaN loss or gradient unless this is set: here a non-finite step is skipped, logged, and the run stops only past --max-nonfinite-steps"),
    "loss_mask_type": _same(
        "str", "how Miles' SFT rollout cuts a Qwen chat into loss-masked turns: the SFT rollout here walks the "
        "tokenizer's own chat template turn by turn, which gives qwen's masks (assistant content + end of turn); "
        "qwen3's and distill_qwen's rules are not built: qwen only, with the SFT rollout function (Miles reads it nowhere else)",
        when=lambda cfg, v: v == "qwen" and cfg.uses_sft_rollout,
    ),
    "disable_compute_advantages_and_returns": _same(
        "bool", "SFT computes no advantages (--loss-type sft_loss); the policy losses need them, so with any other loss it is refused",
        when=lambda cfg, v: cfg.loss_type == "sft_loss",
    ),
    # companions of megatron's context parallelism: a no-op where it is off
    "allgather_cp": _same(
        "bool", "context parallelism's contiguous (instead of zigzag) token layout: a no-op at "
        "--context-parallel-size 1; above it this build's CP attention (training/megatron_cp.py) keeps megatron's "
        "zigzag layout, and the scores are gathered back into sequence order either way: the same result",
    ),
    "cp_comm_type": _same(
        "str", "context parallelism's attention communication (p2p / a2a / allgather): a no-op at "
        "--context-parallel-size 1; above it this build's CP attention all-gathers keys and values "
        "(training/megatron_cp.py), which computes the same attention as any of them",
    ),
    # ---- refused: not built here
    "custom_model_provider_path": _refused("str", "a custom megatron model provider (miles_plugins) is " + _FAMILY),
    "dsa_attention_backend": _refused("str", _DSA),
    **{f"dsv4_{k}": _refused("list" if k == "compress_ratios" else "int", "DeepSeek-V4 attention is " + _FAMILY)
       for k in ("compress_ratios", "compress_rope_theta", "hc_mult", "hc_sinkhorn_iters", "n_hash_layers",
                 "o_groups", "o_lora_rank", "window_size")},
    "moe_latent_size": _refused("int", "latent MoE (Nemotron-3) is " + _FAMILY),
    "freeze_e_score_correction_bias": _refused("bool", "the expert score-correction bias (DeepSeek-V3) is " + _FAMILY),
    "no_activation_func_clamp_shared_expert": _refused("bool", "an unclamped shared expert beside clamped routed ones (DeepSeek-V4) is " + _FAMILY),
    "mtp_num_layers": _refused("int", _MTP),
    "enable_mtp_training": _refused("bool", _MTP),
    "mtp_loss_scaling_factor": _refused("float", _MTP),
    "fp8_format": _refused("str", _FP8),
    "fp8_recipe": _refused("str", _FP8),
    "te_precision_config_file": _refused("str", _FP8),
    "rematerialize_param_from_master_weight": _refused("bool", "rebuilding low-precision params from the fp32 master copy is a megatron precision option this build does not have; drop it"),
    **{name: _same(
        "str", f"{what}: fp32 only. Megatron-LM's fp32 default is what this build runs; any other dtype megatron-core "
        "takes only with --use-precision-aware-optimizer into transformer-engine's FusedAdam (not installed), and with "
        "--optimizer-cpu-offload its HybridDeviceOptimizer keeps fp32 masters and fp32 Adam state whatever is asked "
        "(accepted there and ignored): drop it or give fp32",
        allowed=("fp32",),
    ) for name, what in (("main_grads_dtype", "the optimizer's main gradients"),
                         ("main_params_dtype", "the optimizer's master parameters"),
                         ("exp_avg_dtype", "Adam's first moment"), ("exp_avg_sq_dtype", "Adam's second moment"))},
    "offload_train_target": _same(
        "str", "where --offload-train parks the trainer's state: host memory (cpu) here; disk is not built",
        allowed=("cpu",),
    ),
    "offload_train_disk_dir": _refused("str", "--offload-train parks the trainer's state in host memory here; a disk target (--offload-train-target disk) is not built"),
    "fsdp_cpu_offload": _refused("bool", "FSDP CPU offload of parameters and optimizer is not built: the fsdp backend keeps them on the rank's device; drop it"),
    "use_dynamic_global_batch_size": _refused("bool", "a global batch that varies with dynamic sampling is not built: each step trains --global-batch-size samples"),
    "finetune": _refused("bool", "megatron's --finetune (load weights, reset iteration and optimizer) is not built: start a new run from the weights as --hf-checkpoint"),
    "lora_base_cpu_backup": _refused("bool", "an SGLang-side CPU copy of the base weights for LoRA + colocate: LoRA here syncs adapters only and the base never changes; drop it"),
    "experts_shared_outer_loras": _refused("bool", "the shared-outer expert LoRA layout is not built: expert adapters here are per expert (Miles' default layout, PEFT's target_parameters); drop it"),
    "eval_config": _refused("str", "an eval config file (per-dataset sampling and rewards) is not built: give the datasets as --eval-prompt-data NAME PATH ... with one set of --eval-* flags"),
    **{name: _refused(kind, _MEMORY) for name, kind in (("record_memory_history", "bool"), ("memory_snapshot_path", "str"),
       ("memory_snapshot_dir", "str"), ("memory_snapshot_num_steps", "int"), ("memory_recorder", "str"))},
    "ci_ft_test_actions": _refused("str", "Miles' trainer-cell fault-tolerance test actions (stop / start a cell, crash before the all-reduce): trainer cells are not built; --ci-fault-hooks injects a rank's crash (kill_process / exit_process at trainer_step_before_allreduce, target {\"rank\": N})"),
    "log_reward_category": _refused("str", "statistics of a reward-dict category are not logged; log them from --custom-rollout-log-function-path"),
    "filter_zero_reward_samples": _refused("bool", "use --dynamic-sampling-filter-path miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"),
    "rollout_max_context_len": _refused("int", "the engine's context here is the model's (max_position_embeddings); bound prompts and responses with --rollout-max-prompt-len and --rollout-max-response-len"),
    "true_on_policy_mode": _refused("bool", "bitwise-equal engine and trainer log-probs (Miles' batch-invariant SGLang and trainer kernels) are not built: the gap is measured (train/train_rollout_logprob_abs_diff) and --ci-test bounds it by --ci-logprob-abs-diff-threshold; drop it"),
    "dump_details": _refused("str", "use --save-debug-rollout-data DIR/rollout_{rollout_id}.parquet and --save-debug-train-data DIR/train_{rollout_id}_{rank}.parquet; every rollout and its train_samples rows are also in the catalog (miles-platform query)"),
    "use_miles_dashboard": _refused("bool", "Miles' dashboard is not part of this build: the Dagster UI, `miles-platform query` (DuckDB) and --use-wandb / --use-tensorboard show a run"),
    "router_health_check_interval_secs": _refused("int", "the SGLang router's own health checks: engines here are checked by --use-fault-tolerance with --rollout-health-check-interval / -timeout"),
    "router_health_success_threshold": _refused("int", "the SGLang router's own health checks: engines here are checked by --use-fault-tolerance with --rollout-health-check-interval / -timeout"),
    "router_health_failure_threshold": _refused("int", "the SGLang router's own health checks: engines here are checked by --use-fault-tolerance with --rollout-health-check-interval / -timeout"),
}  # fmt: skip


def add_compat_flags(group) -> None:
    """Each COMPAT flag on `group` as Miles takes it; given flags land under `compat:<name>`."""
    for name, f in COMPAT.items():
        kw: dict[str, Any] = {"dest": f"compat:{name}", "default": None, "help": _help(f)}
        if f.kind == "bool":
            group.add_argument(flag_name(name), action="store_true", **kw)
            continue
        kw["type"] = {"int": int, "float": float}.get(f.kind, str)
        if f.kind == "list":
            kw["nargs"] = "+"
        group.add_argument(flag_name(name), **kw)


def _help(f: MilesFlag) -> str:
    return f"[Miles; {'same result here' if f.verdict == SAME else 'refused here'}] {f.why}".replace(
        "%", "%%"
    )


def check_compat_flags(cfg) -> None:
    """The verdicts of the COMPAT flags given (`cfg.compat_flags`)."""
    for name, value in cfg.compat_flags.items():
        f = COMPAT.get(name)
        if f is None:
            raise ConfigError(f"compat_flags: {name!r} is not a Miles flag this build knows")
        shown = flag_name(name) + (
            "" if value is True else f" {' '.join(map(str, value)) if isinstance(value, list) else value}"
        )
        if f.verdict == REFUSED:
            raise ConfigError(f"{shown}: {f.why}")
        if (f.allowed and value not in f.allowed) or (f.when is not None and not f.when(cfg, value)):
            raise ConfigError(f"{shown}: {f.why}")


def accepted_compat_flags(given: dict[str, Any]) -> list[str]:
    """The same-result flags among `given`, as `--flag: what this build does instead`."""
    return [f"{flag_name(n)}: {COMPAT[n].why}" for n in given if COMPAT[n].verdict == SAME]
