"""RunConfig: Miles flag names and defaults, argument groups, YAML loading, validation.

One dataclass holds every knob of a run. Each field carries its argparse group, help and
choices in `metadata`, so `miles-platform train --help` is generated from this file alone
and the same object is the Dagster run config of the `rl_training` job.

Defaults follow Miles except where the CPU embedded default needs something else; those
fields say so in their help text.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_platform.errors import ConfigError, MilesError  # noqa: F401 (ConfigError re-exported)

GROUPS = (
    "cluster",
    "checkpoint",
    "rollout",
    "sampling",
    "reward",
    "eval",
    "algorithm",
    "opd",
    "optimizer",
    "perf",
    "precision",
    "weight-update",
    "lora",
    "async",
    "storage",
    "logging",
    "debug",
)


def _f(
    default: Any,
    group: str,
    help: str,
    choices: tuple | None = None,
    nargs: str | None = None,
    const: Any = None,
):
    meta = {"group": group, "help": help, "choices": choices, "nargs": nargs, "const": const}
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


_POSITIVE = (1, None, False, "an integer >= 1")
_NON_NEGATIVE = (0, None, False, ">= 0")
_FRACTION = (0, 1, True, "in (0, 1]")
_UNIT = (0, 1, False, "in [0, 1]")
_FINITE = (-math.inf, None, True, "a finite number")
# flag -> (low, high, low excluded, what the error says); None values are skipped
_RANGES: dict[str, tuple] = {
    **dict.fromkeys(
        (
            "actor_num_nodes",
            "actor_num_gpus_per_node",
            "rollout_num_gpus_per_engine",
            "save_interval",
            "num_epoch",
            "rollout_batch_size",
            "n_samples_per_prompt",
            "global_batch_size",
            "num_steps_per_rollout",
            "over_sampling_batch_size",
            "rollout_max_prompt_len",
            "rollout_max_concurrency",
            "eval_interval",
            "n_samples_per_eval_prompt",
            "eval_max_response_len",
            "micro_batch_size",
            "max_tokens_per_gpu",
            "update_weights_interval",
            "log_interval",
            "async_buffer_capacity",
            "lr_decay_iters",
            "generate_max_turns",
        ),
        _POSITIVE,
    ),  # fmt: skip
    **dict.fromkeys(
        (
            "num_rollout",
            "rollout_num_gpus",
            "lr_warmup_iters",
            "max_weight_staleness",
            "num_cpus_per_actor",
            "lr",
            "min_lr",
            "weight_decay",
            "eps_clip",
            "eps_clip_high",
            "critic_lr",
            "eval_temperature",
            "lora_rank",
            "moe_aux_loss_coeff",
            "moe_z_loss_coeff",
        ),
        _NON_NEGATIVE,
    ),  # fmt: skip
    **dict.fromkeys(("rollout_top_p", "eval_top_p"), _FRACTION),
    **dict.fromkeys(("gamma", "lambd"), _UNIT),
    **dict.fromkeys(
        ("kl_loss_coef", "kl_coef", "entropy_coef", "rollout_temperature", "opd_kl_coef"), _FINITE
    ),
    "opd_log_prob_top_k": _NON_NEGATIVE,
    "adam_beta1": (0, 1, False, "in [0, 1)"),
    "adam_beta2": (0, 1, False, "in [0, 1)"),
    "adam_eps": (0, None, True, "> 0"),
    "lora_alpha": (0, None, True, "> 0"),
    "lora_dropout": (0, 1, False, "in [0, 1)"),
    "clip_grad": (0, None, True, "> 0"),
    "tis_lower_bound": (0, None, False, ">= 0"),
    "tis_upper_bound": (0, None, True, "> 0"),
    "tis_clip": (0, None, True, "> 0"),
    "tis_clip_low": (0, None, False, ">= 0"),
    "rs_lower_bound": (0, None, False, ">= 0"),
    "rs_upper_bound": (0, None, True, "> 0"),
    "rs_veto_threshold": (0, 1, True, "in (0, 1]"),
    "opsm_delta": _FINITE,
    "value_clip": (0, None, True, "> 0"),
    "max_nonfinite_steps": _NON_NEGATIVE,
    "train_timeout_s": (0, None, False, ">= 0 (seconds; 0 = no bound)"),
    "generate_tool_timeout": (0, None, True, "> 0 (seconds)"),
    "custom_agent_function_timeout": (0, None, True, "> 0 (seconds)"),
    "custom_generate_function_timeout": (0, None, False, ">= 0 (seconds; 0 = no bound)"),
    "rollout_health_check_interval": (0, None, True, "> 0 (seconds)"),
    "rollout_health_check_timeout": (0, None, True, "> 0 (seconds)"),
    "rollout_health_check_first_wait": (0, None, False, ">= 0 (seconds)"),
    "pause_wait_timeout_s": (0, None, True, "> 0 (seconds)"),
    "pause_max_queued_requests": _POSITIVE,
    "max_seq_len": _POSITIVE,
    "session_server_port": (0, 65535, False, "a port in [0, 65535] (0: a free one)"),
}


WANDB_MODES = ("online", "offline", "disabled")
OPD_TYPES = ("sglang", "megatron")
OPD_TOP_K_STRATEGIES = ("only-student", "only-teacher", "intersection", "union", "xor")
OPD_REWARD_WEIGHT_MODES = ("student_p", "teacher_p", "none")


@dataclass
class RunConfig:
    """Every flag of `miles-platform train`, under Miles' names and defaults (snake_case), in
    argparse groups (`_f(default, group, help, choices)`). `validate()` range-checks every number,
    derives the batch knobs and refuses contradictions before anything starts; `config_hash()` is
    what is trained (outputs, secrets, logging and fault hooks excluded); `RESUMABLE` lists the
    flags a resume may change, `REFUSED` the flags refused with a reason."""

    # --- cluster ---
    ray_address: str | None = _f(
        None, "cluster", "join an existing Ray cluster (else RAY_ADDRESS, else start a local one)"
    )
    actor_num_nodes: int = _f(1, "cluster", "nodes for actor training")
    actor_num_gpus_per_node: int = _f(
        1, "cluster", "trainer ranks per node (GPUs on GPU, CPU gloo ranks on CPU; Miles default 8)"
    )
    rollout_num_gpus: int | None = _f(
        None, "cluster", "devices for rollout engines (derived; ignored with --colocate)"
    )
    rollout_num_gpus_per_engine: int = _f(1, "cluster", "TP size of each engine")
    colocate: bool = _f(False, "cluster", "share devices between actor and rollout")
    num_cpus_per_actor: float = _f(1.0, "cluster", "Ray CPUs reserved per trainer rank / engine on CPU")
    rollout_engine: str = _f("embedded", "cluster", "rollout engine kind", choices=("embedded", "sglang"))
    rollout_external_engine_addrs: list[str] = _f(
        [], "cluster", "attach engines started elsewhere (host:port ...)", nargs="*"
    )
    sglang_router_port: int | None = _f(None, "cluster", "pin the router port (else a free one)")
    use_fault_tolerance: bool = _f(
        False,
        "cluster",
        "health-check every engine (/health_generate); one that fails or hangs is killed, restarted on "
        "its bundle, loaded with the current version and put back behind the router",
    )
    rollout_health_check_interval: float = _f(30.0, "cluster", "seconds between engine health checks")
    rollout_health_check_timeout: float = _f(
        30.0, "cluster", "seconds an engine has to answer a health check before it is replaced"
    )
    rollout_health_check_first_wait: float = _f(
        0.0, "cluster", "grace period in seconds before the first health check"
    )
    # defaults: rollout.engine_core.DEFAULT_PAUSE_* (not imported here: it loads torch)
    pause_wait_timeout_s: float = _f(
        600.0, "cluster", "embedded engines: a request /pause_generation holds longer than this gets 503"
    )
    pause_max_queued_requests: int = _f(
        16384, "cluster", "embedded engines: while paused, a request beyond this many queued gets 503 at once"
    )
    api_key: str | None = _f(
        None,
        "cluster",
        "bearer token for engines, router and weight updates (default: $MILES_API_KEY, "
        "--api-key-file, else a fresh secret per run)",
    )
    api_key_file: str | None = _f(None, "cluster", "read --api-key from this file (keeps it out of argv)")
    allow_config_change: bool = _f(
        False, "checkpoint", "resume a run whose saved config differs in what is trained (logged)"
    )
    object_store_backend: str = _f("ray", "cluster", "rollout data handoff", choices=("ray", "mooncake"))
    mooncake_store_init_kwargs: str | None = _f(
        None, "cluster", "JSON kwargs for the Mooncake store (env fallbacks apply)"
    )

    # --- checkpoint ---
    train_backend: str = _f(
        "fsdp",
        "checkpoint",
        "trainer backend (fsdp = torch-native, FSDP2 when >1 rank)",
        choices=("fsdp", "megatron"),
    )
    hf_checkpoint: str | None = _f(None, "checkpoint", "HF model dir: tokenizer, config, initial weights")
    ref_load: str | None = _f(
        None, "checkpoint", "reference model (torch_dist for megatron, HF dir otherwise)"
    )
    load: str | None = _f(None, "checkpoint", "actor checkpoint dir to resume from (defaults to --save)")
    save: str | None = _f(None, "checkpoint", "actor checkpoint write dir")
    save_interval: int | None = _f(None, "checkpoint", "rollouts between saves")
    save_hf: str | None = _f(
        None, "checkpoint", "also export HF weights at each save (path template with {rollout_id})"
    )
    seed: int = _f(1234, "checkpoint", "random seed")

    # --- rollout data and batching ---
    prompt_data: str | None = _f(None, "rollout", "prompt dataset (JSONL or Parquet, any fsspec URI)")
    input_key: str = _f("input", "rollout", "dataset key for Sample.prompt")
    label_key: str | None = _f(None, "rollout", "dataset key for Sample.label")
    metadata_key: str = _f("metadata", "rollout", "dataset key for Sample.metadata")
    apply_chat_template: bool = _f(False, "rollout", "apply the tokenizer's chat template")
    rollout_shuffle: bool = _f(False, "rollout", "shuffle prompts each epoch")
    rollout_seed: int = _f(42, "rollout", "seed of the data-source shuffle")
    num_rollout: int | None = _f(
        None, "rollout", "total rollout iterations (derived from dataset and --num-epoch if unset)"
    )
    num_epoch: int | None = _f(None, "rollout", "epochs over the prompt data when --num-rollout is unset")
    rollout_batch_size: int | None = _f(None, "rollout", "prompts per rollout (required)")
    n_samples_per_prompt: int = _f(1, "rollout", "responses per prompt (GRPO group size)")
    global_batch_size: int | None = _f(None, "rollout", "samples per optimizer step (derived)")
    num_steps_per_rollout: int | None = _f(None, "rollout", "optimizer steps per rollout (derived)")
    over_sampling_batch_size: int | None = _f(None, "rollout", "prompts to sample per dynamic-sampling round")
    rollout_max_prompt_len: int | None = _f(None, "rollout", "drop prompts longer than this many tokens")
    rollout_function_path: str | None = _f(
        None,
        "rollout",
        "replace the whole rollout: <module>.<fn>(args, rollout_id, data_source, evaluation=False) -> "
        "RolloutFnTrainOutput | list[list[Sample]] (or a class, as Miles); see docs/rollout.md",
    )
    custom_generate_function_path: str | None = _f(
        None,
        "rollout",
        "per-sample generate <module>.<fn>: async fn(input: GenerateFnInput) -> GenerateFnOutput, or the "
        "old form async fn(args, sample, sampling_params) -> Sample; built-ins: "
        "miles_platform.rollout.generate_hub.{single_turn,multi_turn}.generate",
    )
    rollout_max_concurrency: int = _f(
        64, "rollout", "max in-flight generate requests (per-sample generate functions: samples in flight)"
    )
    generate_max_turns: int = _f(16, "rollout", "multi_turn: max model turns per episode")
    generate_tool_specs_path: str | None = _f(
        None, "rollout", "multi_turn: <module>.<attr>, a list of OpenAI tool specs (or a fn returning one)"
    )
    generate_tool_call_parser: str | None = _f(
        None,
        "rollout",
        "multi_turn: tool-call format in model text (SGLang parser names)",
        choices=("qwen25", "qwen"),
    )
    generate_execute_tool_function_path: str | None = _f(
        None, "rollout", "multi_turn: async <module>.<fn>(name: str, params: dict) -> str"
    )
    generate_tool_timeout: float = _f(
        60.0, "rollout", "multi_turn: seconds one tool call may take; past it the episode ends as failed"
    )
    # agentic sessions (docs/rollout.md): generate_hub.agentic_tool_call + the TITO session server
    custom_agent_function_path: str | None = _f(
        None,
        "rollout",
        "agentic_tool_call: async <module>.<fn>(base_url, prompt, request_kwargs, metadata, **kwargs) -> dict | None",
    )
    custom_agent_function_mode: str = _f(
        "subproc",
        "rollout",
        "agentic_tool_call: run each agent call in a child process of its own (subproc) or on the rollout's loop",
        choices=("subproc", "inline"),
    )
    custom_generate_function_timeout: float = _f(
        1800.0,
        "rollout",
        "seconds one --custom-generate-function-path call may take; past it it is cancelled and its "
        "sample failed (rollout/failed); 0 = no bound",
    )
    custom_agent_function_timeout: float = _f(
        600.0,
        "rollout",
        "agentic_tool_call: seconds one agent call may take; past it it is stopped, the sample failed",
    )
    use_session_server: str | None = _f(
        None,
        "rollout",
        "start the TITO session server: bare or v1 (linear, append-only); v2 (tree) is refused",
        choices=("v1", "v2"),
        nargs="?",
        const="v1",
    )
    tito_model: str = _f(
        "default",
        "rollout",
        "TITO family: its end-of-turn token joins turns (default: the tokenizer's EOS)",
        choices=("default", "qwen3", "qwen25", "qwen2", "llama3"),
    )
    max_seq_len: int | None = _f(
        None, "rollout", "session server: max tokens per session (prompt + all turns)"
    )
    session_server_ip: str = _f("127.0.0.1", "rollout", "session server bind address")
    session_server_port: int = _f(0, "rollout", "session server port (0: a free one)")

    # --- sampling ---
    rollout_max_response_len: int = _f(
        32, "sampling", "max tokens per response (Miles: required; small CPU default)"
    )
    rollout_temperature: float = _f(1.0, "sampling", "sampling temperature")
    rollout_top_p: float = _f(1.0, "sampling", "top-p truncation")
    rollout_top_k: int = _f(-1, "sampling", "top-k truncation (-1 disables)")
    rollout_stop: list[str] = _f([], "sampling", "stop strings", nargs="*")
    rollout_stop_token_ids: list[int] = _f([], "sampling", "stop token ids (EOS is always a stop)", nargs="*")

    # --- reward and filters ---
    rm_type: str | None = _f(
        None,
        "reward",
        "built-in reward: math, dapo, deepscaler, f1, final_answer, random, remote_rm, boxed_<type> "
        "(required unless --custom-rm-path or per-sample metadata.rm_type gives the reward)",
    )
    rm_url: str | None = _f(None, "reward", "endpoint for --rm-type remote_rm")
    group_rm: bool = _f(False, "reward", "reward computed per group by --custom-rm-path")
    custom_rm_path: str | None = _f(
        None, "reward", "custom reward <module>.<fn> (this or --rm-type is required)"
    )
    reward_key: str | None = _f(None, "reward", "key of a dict reward used for training")
    eval_reward_key: str | None = _f(
        None, "reward", "key of a dict reward used for eval (defaults to --reward-key)"
    )
    dynamic_sampling_filter_path: str | None = _f(
        None, "reward", "group filter <module>.<fn> (e.g. check_reward_nonzero_std)"
    )
    rollout_sample_filter_path: str | None = _f(None, "reward", "per-sample filter setting remove_sample")
    buffer_filter_path: str | None = _f(None, "reward", "buffer dequeue filter <module>.<fn>")

    # --- eval ---
    eval_prompt_data: list[str] = _f([], "eval", "one or more `name path` pairs", nargs="*")
    eval_interval: int | None = _f(None, "eval", "rollouts between evals")
    n_samples_per_eval_prompt: int = _f(1, "eval", "responses per eval prompt (the n of pass@<n>(T=..))")
    eval_max_response_len: int | None = _f(None, "eval", "inherits --rollout-max-response-len")
    eval_temperature: float | None = _f(None, "eval", "inherits --rollout-temperature (pass@1 greedy uses 0)")
    eval_top_p: float | None = _f(None, "eval", "inherits --rollout-top-p")
    eval_top_k: int | None = _f(None, "eval", "inherits --rollout-top-k")
    skip_eval_before_train: bool = _f(
        False, "eval", "skip the eval of the initial policy (v0) before the first rollout of a fresh run"
    )

    # --- algorithm ---
    loss_type: str = _f(
        "policy_loss",
        "algorithm",
        "loss",
        choices=("policy_loss", "sft_loss", "custom_loss", "score_centering"),
    )
    custom_loss_function_path: str | None = _f(None, "algorithm", "custom loss <module>.<fn>")
    advantage_estimator: str = _f(
        "grpo",
        "algorithm",
        "advantage estimator",
        choices=("grpo", "gspo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    )
    disable_grpo_std_normalization: bool = _f(False, "algorithm", "GRPO: subtract group mean only")
    use_kl_loss: bool = _f(False, "algorithm", "KL against the frozen reference")
    kl_loss_coef: float = _f(0.0, "algorithm", "KL weight in the loss (0 = monitor only)")
    kl_loss_type: str = _f("k1", "algorithm", "KL estimator", choices=("k1", "k2", "k3", "low_var_kl"))
    kl_coef: float = _f(0.0, "algorithm", "KL penalty folded into rewards (reinforce++)")
    entropy_coef: float = _f(0.0, "algorithm", "entropy bonus weight")
    eps_clip: float = _f(0.2, "algorithm", "PPO/GRPO low clip")
    eps_clip_high: float | None = _f(None, "algorithm", "asymmetric high clip (defaults to --eps-clip)")
    eps_clip_c: float | None = _f(None, "algorithm", "dual-clip constant (>1) for negative advantages")
    gamma: float = _f(1.0, "algorithm", "discount (ppo / reinforce++)")
    lambd: float = _f(1.0, "algorithm", "GAE lambda (ppo)")
    calculate_per_token_loss: bool = _f(
        False, "algorithm", "token-mean over the batch instead of per-sample mean"
    )
    use_rollout_logprobs: bool = _f(False, "algorithm", "use engine log-probs as old log-probs")
    use_rollout_routing_replay: bool = _f(
        False, "algorithm",
        "R3 (MoE): the engine returns each token's top-k experts, the trainer replays them in every forward",
    )  # fmt: skip
    # MoE (docs/moe.md): Miles' --moe-* flags that mean something for HF's MoE blocks at EP=1
    moe_aux_loss_coeff: float = _f(
        0.0,
        "algorithm",
        "MoE: coefficient of the load-balancing loss (Switch / megatron's aux_loss) added to the policy loss",
    )
    moe_z_loss_coeff: float = _f(
        0.0,
        "algorithm",
        "MoE: coefficient of the router z-loss (megatron's: mean logsumexp(router logits)^2)",
    )
    moe_router_freeze_gate: bool = _f(False, "algorithm", "MoE: the routers' weights are not trained")
    moe_router_dtype: str | None = _f(
        None, "algorithm", "MoE: router weights and compute in fp32 (with an fp32 forward; any --fsdp-master-dtype)",
        choices=("fp32",),
    )  # fmt: skip
    use_tis: bool = _f(
        False, "algorithm", "importance sampling for the train/rollout mismatch (docs/algorithms.md)"
    )
    tis_clip: float = _f(2.0, "algorithm", "built-in TIS: upper clamp of exp(old - rollout)")
    tis_clip_low: float = _f(0.0, "algorithm", "built-in TIS: lower clamp of exp(old - rollout)")
    custom_tis_function_path: str | None = _f(
        None, "algorithm", "TIS/RS <module>.<fn> with Miles' signature; Miles' mis.py path selects MIS"
    )
    get_mismatch_metrics: bool = _f(False, "algorithm", "log the mis_* train/rollout mismatch metrics only")
    # MIS (Miles' mis.py, training/mis.py): setting any of these selects it
    tis_level: str = _f("token", "algorithm", "MIS: IS level", choices=("token", "sequence", "geometric"))
    tis_mode: str = _f("truncate", "algorithm", "MIS: IS mode", choices=("truncate", "clip", "mask"))
    tis_lower_bound: float | None = _f(0.5, "algorithm", "MIS: IS lower bound (unset: 1 / upper)")
    tis_upper_bound: float = _f(2.0, "algorithm", "MIS: IS upper bound")
    use_rs: bool = _f(False, "algorithm", "MIS: rejection sampling of tokens / sequences out of bounds")
    rs_level: str = _f("token", "algorithm", "MIS: RS level", choices=("token", "sequence", "geometric"))
    rs_lower_bound: float | None = _f(None, "algorithm", "MIS: RS lower bound (unset: the IS one)")
    rs_upper_bound: float | None = _f(None, "algorithm", "MIS: RS upper bound (unset: the IS one)")
    rs_veto_threshold: float | None = _f(
        None, "algorithm", "MIS: reject a sequence with a token ratio below it"
    )
    tis_batch_normalize: bool = _f(False, "algorithm", "MIS: divide IS weights by their batch mean")
    use_opsm: bool = _f(False, "algorithm", "off-policy sequence masking of negative-advantage tokens")
    opsm_delta: float = _f(1e-4, "algorithm", "OPSM: masked mean of (old - new) log-prob above which to mask")
    use_unbiased_kl: bool = _f(False, "algorithm", "KL loss weighted by pi / pi_old (DeepSeek-V3.2)")
    normalize_advantages: bool = _f(
        False, "algorithm", "whiten advantages over the batch (after OPD); needed by reinforce_plus_plus*"
    )
    disable_rewards_normalization: bool = _f(
        False, "algorithm", "grpo / gspo / reinforce_plus_plus_baseline: no group mean (or std) removed"
    )
    critic_lr: float | None = _f(None, "algorithm", "critic LR for ppo (defaults to --lr)")
    value_clip: float = _f(0.2, "algorithm", "ppo critic: clip of v - v_old in the value loss")
    train_timeout_s: float = _f(
        3600.0,
        "algorithm",
        "bound of one call on the trainer ranks (a rollout's train, a save, an export); 0 = none",
    )
    max_nonfinite_steps: int = _f(
        3, "algorithm", "optimizer steps skipped for a NaN / inf loss or gradient before the run stops"
    )
    # score centering (--loss-type score_centering, docs/algorithms.md; training/score_centering.py)
    rollout_top_logprobs_num: int = _f(
        0,
        "sampling",
        "K candidate log-probs the engine records per generated token (rollout_topk_*); 0 = off. "
        "Read by --loss-type score_centering: the sampler's top K (unfiltered) or its whole support (top-k/p)",
    )
    score_centering_is: str = _f(
        "none", "algorithm", "score centering importance weight f: none (1), tis (clipped), mis (masked)",
        choices=("none", "tis", "mis"),
    )  # fmt: skip
    score_centering_tis_clip: float = _f(2.0, "algorithm", "score centering tis: f(x) = min(x, clip)")
    score_centering_mis_low: float = _f(
        0.5, "algorithm", "score centering mis: f(x) = x on [low, high], else 0"
    )
    score_centering_mis_high: float = _f(
        5.0, "algorithm", "score centering mis: upper end of the kept ratios"
    )

    # --- on-policy distillation (docs/opd.md) ---
    use_opd: bool = _f(
        False, "opd", "on-policy distillation: a teacher's reverse KL is subtracted from advantages"
    )
    opd_type: str | None = _f(
        None,
        "opd",
        "where the teacher runs: sglang = an engine scoring rollouts (--opd-teacher-urls / --rm-url / "
        "--opd-teacher-hf-checkpoint), megatron = frozen in the trainer (--opd-teacher-load; FSDP too)",
        choices=OPD_TYPES,
    )
    opd_kl_coef: float = _f(1.0, "opd", "A_t - opd_kl_coef * reverse_KL_t")
    opd_log_prob_top_k: int = _f(
        0, "opd", "0 = sampled-token OPD; k > 0 = Rethinking-OPD top-k reverse KL (sglang only; paper: 16)"
    )
    opd_top_k_strategy: str = _f(
        "only-student", "opd", "top-k token set per position", choices=OPD_TOP_K_STRATEGIES
    )
    opd_reward_weight_mode: str = _f(
        "student_p", "opd", "weights of the top-k set's tokens", choices=OPD_REWARD_WEIGHT_MODES
    )
    opd_teacher_urls: list[str] = _f(
        [],
        "opd",
        "NAME=URL ... teachers routed by sample.metadata[--opd-teacher-key]; `default` is the fallback "
        "(without it an unknown name is an error); unset = one teacher at --rm-url",
        nargs="*",
    )
    opd_teacher_key: str = _f("opd_teacher", "opd", "metadata key holding a sample's teacher name")
    opd_teacher_load: str | None = _f(
        None,
        "opd",
        "in-trainer teacher (required with --opd-type megatron): an HF dir, or a checkpoint dir of the "
        "--train-backend's save layout (the student's architecture)",
    )
    opd_teacher_ckpt_step: int | None = _f(None, "opd", "checkpoint step of the teacher (Miles)")
    opd_teacher_hf_checkpoint: str | None = _f(
        None,
        "opd",
        "ours: the run starts an embedded teacher engine from this HF dir (sglang mode, one command)",
    )

    # --- optimizer ---
    optimizer: str = _f("adam", "optimizer", "optimizer", choices=("adam", "sgd"))
    lr: float = _f(
        1e-6, "optimizer", "learning rate (fit to model size: 1e-6 is for billion-parameter models)"
    )
    lr_decay_style: str = _f("constant", "optimizer", "schedule", choices=("constant", "linear", "cosine"))
    lr_warmup_iters: int = _f(0, "optimizer", "warmup steps")
    lr_decay_iters: int | None = _f(None, "optimizer", "decay steps (defaults to total steps)")
    min_lr: float = _f(0.0, "optimizer", "lower LR bound for decay")
    weight_decay: float = _f(0.1, "optimizer", "decoupled weight decay")
    adam_beta1: float = _f(0.9, "optimizer", "Adam beta1")
    adam_beta2: float = _f(0.98, "optimizer", "Adam beta2")
    adam_eps: float = _f(1e-8, "optimizer", "Adam epsilon")
    clip_grad: float = _f(1.0, "optimizer", "grad-norm clip")

    # --- perf ---
    micro_batch_size: int = _f(1, "perf", "samples per micro-batch (ignored with dynamic batching)")
    use_dynamic_batch_size: bool = _f(False, "perf", "pack varlen samples into micro-batches by token budget")
    max_tokens_per_gpu: int | None = _f(
        None, "perf", "token budget per micro-batch (required with dynamic batching)"
    )
    tensor_model_parallel_size: int = _f(1, "perf", "megatron TP")
    pipeline_model_parallel_size: int = _f(1, "perf", "megatron PP")
    context_parallel_size: int = _f(1, "perf", "CP")
    expert_model_parallel_size: int = _f(1, "perf", "megatron EP (MoE)")
    gradient_checkpointing: bool = _f(False, "perf", "activation recompute (FSDP)")

    # --- precision ---
    fsdp_master_dtype: str = _f("fp32", "precision", "dtype the optimizer steps on", choices=("fp32", "bf16"))
    train_forward_dtype: str = _f(
        "fp32",
        "precision",
        "autocast / gather dtype of the trainer forward",
        choices=("fp32", "bf16", "fp16"),
    )
    fsdp_reduce_dtype: str = _f(
        "fp32", "precision", "gradient reduce-scatter dtype", choices=("fp32", "bf16")
    )
    fsdp_precision_rules: str | None = _f(
        None, "precision", "per-module/param rules, e.g. 'module:*norm*=fp32;param:lm_head.weight=fp32'"
    )
    rollout_dtype: str = _f(
        "fp32",
        "precision",
        "engine serving dtype; must equal --train-forward-dtype",
        choices=("fp32", "bf16", "fp16"),
    )

    # --- weight update ---
    update_weight_transfer_mode: str = _f(
        "tensor",
        "weight-update",
        "transport",
        choices=("tensor", "disk-delta", "mooncake", "broadcast", "disk"),
    )
    update_weights_interval: int = _f(1, "weight-update", "rollouts between weight updates")
    update_weight_disk_dir: str | None = _f(None, "weight-update", "publication dir for disk-delta")
    update_weight_local_checkpoint_dir: str | None = _f(
        None, "weight-update", "engine-local checkpoint dir for disk-delta"
    )
    disk_delta_encoding: str = _f("xor", "weight-update", "delta encoding", choices=("xor", "overwrite"))
    disk_delta_checksum: str = _f(
        "xxh3-128", "weight-update", "checksum", choices=("xxh3-128", "blake3", "adler32")
    )
    disk_delta_keyframe_interval: int = _f(10, "weight-update", "full snapshot every N versions")
    disk_delta_encode_workers: int = _f(
        1, "weight-update", "threads encoding tensors in parallel (XOR, planes, zstd, checksums)"
    )
    custom_update_weight_post_write_path: str | None = _f(
        None,
        "weight-update",
        "disk-delta: <module>.<fn>(args, version_dir, engines) called once a version is written, before "
        "engines pull it (e.g. commit an object-store-backed mount)",
    )
    pause_generation_mode: str = _f(
        "retract",
        "weight-update",
        "in-flight requests during the update",
        choices=("abort", "retract", "in_place"),
    )
    check_weight_update_equal: bool = _f(
        False, "weight-update", "verify engine weights equal trainer weights after sync"
    )

    # --- lora (docs/lora.md; PEFT adapters on the fsdp backend, Miles' flag names and defaults) ---
    lora_rank: int = _f(0, "lora", "adapter rank; 0 = off (full fine-tuning), > 0 trains a LoRA adapter")
    lora_alpha: int = _f(16, "lora", "adapter scaling factor (scale = alpha / rank)")
    lora_dropout: float = _f(0.0, "lora", "dropout on the adapter path (RL normally uses 0)")
    target_modules: str | None = _f(
        None,
        "lora",
        "comma-separated: all-linear (alone), groups attn / mlp / unembed, HF leaf names (q_proj) or "
        "scoped HF paths (model.layers.0.self_attn.q_proj), globs allowed; default attention + MLP",
    )
    exclude_modules: str | None = _f(
        None, "lora", "comma-separated HF leaf names or scoped paths removed after --target-modules"
    )
    lora_adapter_path: str | None = _f(
        None, "lora", "start from this PEFT adapter dir (its rank, alpha and targets must match the flags)"
    )
    lora_train_only: bool = _f(
        False, "lora", "train the adapter, keep the rollout engines on the frozen base (no adapter sync)"
    )
    check_lora_weight_equal: bool = _f(
        False, "lora", "after every adapter sync verify each engine-side adapter tensor by SHA-256"
    )

    # --- async ---
    fully_async: bool = _f(False, "async", "background generation with a bounded buffer")
    async_unused_samples_handler: str = _f(
        "drop",
        "async",
        "a group too stale to train: drop it, or retry (its prompt goes back to the data source)",
        choices=("drop", "retry"),
    )
    max_weight_staleness: int | None = _f(
        None, "async", "drop groups whose oldest version lags the engine by more"
    )
    async_buffer_capacity: int | None = _f(
        None, "async", "max finished groups buffered (default 2x rollout batch)"
    )

    # --- storage ---
    run_name: str = _f("run", "storage", "run name: partition keys are <run>.v<NNNNNN>")
    storage_root: str = _f(".miles", "storage", "storage root (local dir or any fsspec URI)")

    # --- logging: experiment trackers (miles_platform/trackers.py) ---
    use_wandb: bool = _f(False, "logging", "log each rollout's metrics to wandb (the `trackers` extra)")
    wandb_project: str | None = _f(None, "logging", "wandb project")
    wandb_group: str | None = _f(None, "logging", "wandb group and run name (default: --run-name)")
    wandb_mode: str | None = _f(
        None,
        "logging",
        "overrides WANDB_MODE; offline writes under --wandb-dir with no network",
        choices=WANDB_MODES,
    )
    wandb_dir: str | None = _f(None, "logging", "dir wandb writes into (default: ./wandb)")
    wandb_run_id: str | None = _f(None, "logging", "wandb run id: a relaunch with it continues that run")
    disable_wandb_random_suffix: bool = _f(
        False, "logging", "wandb group and name get a random suffix by default; this disables it"
    )
    use_tensorboard: bool = _f(False, "logging", "log each rollout's metrics as TensorBoard scalars")
    tensorboard_dir: str | None = _f(
        None, "logging", "TensorBoard event dir (default: <storage-root>/runs/<run>/tensorboard)"
    )
    custom_rollout_log_function_path: str | None = _f(
        None,
        "logging",
        "<module>.<fn>(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool, "
        "per rollout; True skips the default logging of its rollout metrics",
    )
    custom_eval_rollout_log_function_path: str | None = _f(
        None,
        "logging",
        "<module>.<fn>(rollout_id, args, data, extra_metrics) -> bool, per eval; True skips its default logging",
    )

    # --- debug ---
    debug_rollout_only: bool = _f(False, "debug", "generate and store rollouts, no training")
    debug_train_only: bool = _f(
        False, "debug", "train on loaded rollouts, no engines (needs --load-debug-rollout-data)"
    )
    save_debug_rollout_data: str | None = _f(
        None, "debug", "Parquet path template with {rollout_id}, one file per rollout"
    )
    load_debug_rollout_data: str | None = _f(
        None, "debug", "replay Parquet rollouts (implies --debug-train-only)"
    )
    debug_skip_optimizer_step: bool = _f(
        False, "debug", "freeze weights: any log-prob gap is forward-path difference"
    )
    ci_test: bool = _f(False, "debug", "assert step-0 KL/clipfrac, log-prob agreement, weight equality")
    ci_disable_weight_update_checker: bool = _f(
        False, "debug", "--ci-test without the weight check (for SGLang models lacking get_weights_by_name)"
    )
    ci_logprob_abs_diff_threshold: float = _f(
        0.03, "debug", "--ci-test bound on trainer-vs-engine log-prob diff"
    )
    ci_fault_hooks: str | None = _f(
        None,
        "debug",
        "JSON array of fault requests ({hook_name, action: {kind}, rollout_id}); "
        "miles_platform/fault_hooks.py lists the hooks and actions",
    )
    log_interval: int = _f(1, "debug", "print metrics every N rollouts")

    # passthrough: --sglang-<flag> value, prefix stripped when launching SGLang
    sglang_args: dict[str, Any] = field(
        default_factory=dict, metadata={"group": "cluster", "help": "", "choices": None, "nargs": None}
    )
    # the flags a custom generate / rollout function registers with Miles' `fn.add_arguments(parser)`
    # hook: parsed from the CLI (or YAML) and shown to the function as args.<name>
    custom_function_args: dict[str, Any] = field(
        default_factory=dict, metadata={"group": "rollout", "help": "", "choices": None, "nargs": None}
    )

    # ------------------------------------------------------------------
    def validate(self) -> RunConfig:
        """Derive the unset batch knob and reject contradictions. Returns self."""
        check_run_name(self.run_name)
        check_seeds(self)
        if isinstance(self.use_session_server, bool):  # YAML `use_session_server: true` is the bare flag
            self.use_session_server = "v1" if self.use_session_server else None
        self._check_ranges()
        derive_batch_knobs(self)
        if self.load_debug_rollout_data:
            self.debug_train_only = True
        if self.debug_rollout_only and self.debug_train_only:
            raise ConfigError("--debug-rollout-only and --debug-train-only exclude each other")
        if self.debug_train_only and not self.load_debug_rollout_data:
            raise ConfigError(
                "--debug-train-only needs --load-debug-rollout-data (the Parquet path template that "
                "--save-debug-rollout-data wrote): no engines start, so there is nothing else to train on"
            )
        if self.save_debug_rollout_data:
            _check_rollout_template("--save-debug-rollout-data", self.save_debug_rollout_data)
        if self.use_dynamic_batch_size and not self.max_tokens_per_gpu:
            raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu")
        if self.rollout_max_response_len is not None and self.rollout_max_response_len <= 0:
            raise ConfigError(f"--rollout-max-response-len must be > 0, got {self.rollout_max_response_len}")
        if self.eval_prompt_data and len(self.eval_prompt_data) % 2:
            raise ConfigError(f"--eval-prompt-data takes `name path` pairs, got {self.eval_prompt_data}")
        if self.train_forward_dtype != self.rollout_dtype:
            raise ConfigError(
                f"--train-forward-dtype {self.train_forward_dtype} != --rollout-dtype {self.rollout_dtype}: "
                "the trainer must see the same forward as the engine (PPO ratio would be rounding noise)"
            )
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            raise ConfigError(f"--eps-clip-c must be > 1.0, got {self.eps_clip_c}")
        if self.async_unused_samples_handler != "drop" and not (
            self.fully_async and self.max_weight_staleness is not None
        ):
            raise ConfigError(
                f"--async-unused-samples-handler {self.async_unused_samples_handler} acts on groups "
                "--max-weight-staleness filters in a --fully-async run; set both or drop the flag"
            )
        if self.fully_async and self.pause_generation_mode == "abort":
            raise ConfigError("--fully-async rejects --pause-generation-mode abort (use retract or in_place)")
        if self.update_weight_transfer_mode == "disk-delta" and not self.update_weight_disk_dir:
            raise ConfigError("--update-weight-transfer-mode disk-delta needs --update-weight-disk-dir")
        for name in ("disk_delta_keyframe_interval", "disk_delta_encode_workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name, why in REFUSED.items():
            if getattr(self, name) != _default(name):
                raise ConfigError(f"{_flag(name)} {getattr(self, name)!r}: {why}")
        self._check_fault_tolerance()
        pause = [_flag(n) for n in ("pause_wait_timeout_s", "pause_max_queued_requests")
                 if getattr(self, n) != _default(n)]  # fmt: skip
        if pause and (self.rollout_engine != "embedded" or self.rollout_external_engine_addrs):
            raise ConfigError(f"{', '.join(pause)}: bounds of the embedded engine's pause (SGLang has "
                              "none); use --rollout-engine embedded or drop the flag")  # fmt: skip
        from miles_platform.fault_hooks import parse_fault_hooks

        parse_fault_hooks(self.ci_fault_hooks)  # where each request can fire: preflight._check_fault_targets
        self._check_routing_replay()
        self._check_moe_flags()
        self._check_generate_flags()
        self._check_lora_flags()
        self._check_score_centering()
        self._check_opd_flags()
        self._check_algorithm_flags()
        if self.train_backend == "megatron":
            # the megatron backend trains an fp32 GPTModel without recompute; say so, never ignore
            unsupported = [
                (f"--train-forward-dtype {self.train_forward_dtype}", self.train_forward_dtype != "fp32"),
                (f"--fsdp-master-dtype {self.fsdp_master_dtype}", self.fsdp_master_dtype != "fp32"),
                (f"--fsdp-reduce-dtype {self.fsdp_reduce_dtype}", self.fsdp_reduce_dtype != "fp32"),
                ("--fsdp-precision-rules", bool(self.fsdp_precision_rules)),
                ("--gradient-checkpointing", self.gradient_checkpointing),
            ]
            bad = [flag for flag, on in unsupported if on]
            if bad:
                raise ConfigError(
                    f"{', '.join(bad)}: not supported by --train-backend megatron (it trains in fp32, "
                    "without activation recompute); use --train-backend fsdp for mixed precision and "
                    "recompute, or drop the flag"
                )
        if not self.rollout_temperature > 0:
            raise ConfigError(
                f"--rollout-temperature {self.rollout_temperature}: training samples need a positive "
                "temperature (the trainer scores log_softmax(logits / T)); greedy decoding is for eval "
                "(--eval-temperature 0)"
            )
        if self.rollout_top_p < 1 and self.rollout_top_k <= 0:
            raise ConfigError(
                f"--rollout-top-p {self.rollout_top_p} needs a positive --rollout-top-k: sampling-support "
                "replay records each token's support, which must be bounded (e.g. --rollout-top-k 64)"
            )
        if self.sampling_support_replay():
            clash = [f for f, on in (("--use-kl-loss", self.use_kl_loss), (f"--kl-coef {self.kl_coef}", self.kl_coef != 0)) if on]  # fmt: skip
            if clash:
                raise ConfigError(
                    f"{' and '.join(clash)} with sampling-support replay (--rollout-top-k "
                    f"{self.rollout_top_k}, --rollout-top-p {self.rollout_top_p}): reference KL needs a "
                    "full-vocabulary actor score and replay gives a support-normalized one; Miles rejects "
                    "the combination too. Drop the KL or sample with --rollout-top-k -1 --rollout-top-p 1"
                )
        if self.wandb_mode is not None and self.wandb_mode not in WANDB_MODES:
            raise ConfigError(f"--wandb-mode {self.wandb_mode!r}: must be one of {', '.join(WANDB_MODES)}")
        if self.loss_type == "custom_loss" and not self.custom_loss_function_path:
            raise ConfigError("--loss-type custom_loss needs --custom-loss-function-path")
        return self

    def _check_algorithm_flags(self) -> None:
        """Miles' rules for estimators and corrections (docs/algorithms.md), and no flag that would
        be accepted without effect."""
        if self.advantage_estimator.startswith("reinforce_plus_plus") and not self.normalize_advantages:
            raise ConfigError(
                f"--advantage-estimator {self.advantage_estimator} needs --normalize-advantages (Miles "
                "requires advantage whitening for both REINFORCE++ estimators)"
            )
        if self.use_rollout_logprobs and self.use_tis:
            raise ConfigError(
                "--use-rollout-logprobs with --use-tis: the ratio's old policy is already the rollout's, "
                "so there is no mismatch left to weight (Miles refuses the pair); drop one"
            )
        mis = [_flag(n) for n in MIS_FLAGS if getattr(self, n) != _default(n)]
        vanilla = [_flag(n) for n in ("tis_clip", "tis_clip_low") if getattr(self, n) != _default(n)]
        unused = [
            (vanilla + mis + ([_flag("custom_tis_function_path")] if self.custom_tis_function_path else []),
             not (self.use_tis or self.get_mismatch_metrics), "act only with --use-tis (or --get-mismatch-metrics)"),
            (mis, self.get_mismatch_metrics and not self.use_tis, "weight the loss: they need --use-tis"),
            (vanilla, bool(mis or self.custom_tis_function_path),
             "bound the built-in TIS, which the MIS flags or --custom-tis-function-path replace"),
            ([_flag(n) for n in ("rs_level", "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold")
              if getattr(self, n) != _default(n)], not self.use_rs, "are bounds of --use-rs"),
            (["--use-unbiased-kl"], self.use_unbiased_kl and not self.use_kl_loss, "weights the KL loss: add --use-kl-loss"),
            (["--opsm-delta"], self.opsm_delta != _default("opsm_delta") and not self.use_opsm, "needs --use-opsm"),
            (["--value-clip"], self.value_clip != _default("value_clip") and self.advantage_estimator != "ppo",
             "clips the PPO critic: only with --advantage-estimator ppo"),
            (["--tis-batch-normalize"], self.tis_batch_normalize and self.tis_level == "geometric",
             "normalizes token or sequence weights (as Miles), not --tis-level geometric"),
        ]  # fmt: skip
        for flags, bad, why in unused:
            if flags and bad:
                raise ConfigError(f"{', '.join(flags)}: {why}")

    def _check_routing_replay(self) -> None:
        """R3 (docs/moe.md): what can be checked without the checkpoint; preflight checks it is MoE."""
        if not self.use_rollout_routing_replay:
            return
        why = None
        if self.use_rollout_logprobs or self.lora_rank > 0:
            why = "--use-rollout-logprobs / LoRA with routing replay is not built"
        if why:
            raise ConfigError(f"--use-rollout-routing-replay: {why}")

    def moe_flags(self) -> list[str]:
        """The --moe-* flags set (they need an MoE --hf-checkpoint: preflight checks it)."""
        return [_flag(n) for n in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_freeze_gate", "moe_router_dtype")
                if getattr(self, n) != _default(n)]  # fmt: skip

    def _check_moe_flags(self) -> None:
        if self.moe_router_dtype and (self.train_forward_dtype, self.rollout_dtype) != ("fp32", "fp32"):
            raise ConfigError(
                f"--moe-router-dtype {self.moe_router_dtype} with --train-forward-dtype {self.train_forward_dtype} / "
                f"--rollout-dtype {self.rollout_dtype}: routers compute in the forward's dtype, in trainer and "
                "engine alike; only an fp32 forward has fp32 routers"
            )
        if self.moe_flags() and self.lora_rank > 0:
            raise ConfigError(f"{', '.join(self.moe_flags())} with LoRA: MoE + LoRA is not built")

    def _check_lora_flags(self) -> None:
        """LoRA (docs/lora.md): the LoRA flags need --lora-rank > 0; the adapter trains on the fsdp backend
        and reaches engines through SGLang's LoRA API. (Target names are resolved against the model at start.)"""
        given = [_flag(n) for n in LORA_FLAGS if getattr(self, n) != _default(n)]
        if self.lora_rank == 0:
            if given:
                raise ConfigError(
                    f"{', '.join(given)}: LoRA flags, but --lora-rank is 0 (LoRA off); set --lora-rank > 0 "
                    "(e.g. --lora-rank 8) or drop them"
                )
            return
        if self.lora_dropout >= 1:
            raise ConfigError(f"--lora-dropout {self.lora_dropout}: must be in [0, 1)")
        if self.train_backend != "fsdp":
            raise ConfigError(
                f"--lora-rank {self.lora_rank} with --train-backend {self.train_backend}: LoRA is built on the "
                "fsdp backend (PEFT adapters) only; use --train-backend fsdp or --lora-rank 0"
            )
        mode = self.update_weight_transfer_mode
        if mode not in ("tensor", "disk"):
            raise ConfigError(
                f"--update-weight-transfer-mode {mode} with --lora-rank {self.lora_rank}: adapters sync through "
                "SGLang's /load_lora_adapter only (tensor: in-process to embedded engines; disk: the adapter "
                "dir); as in Miles, disk-delta, mooncake and broadcast do not carry LoRA weights"
            )
        if self.check_lora_weight_equal and (
            self.rollout_engine != "embedded" or self.rollout_external_engine_addrs
        ):
            raise ConfigError(
                "--check-lora-weight-equal reads adapter checksums from the embedded engine "
                "(/get_lora_adapter_checksums, not part of SGLang's API); use --rollout-engine embedded"
            )
        if self.check_lora_weight_equal and self.lora_train_only:
            raise ConfigError(
                "--check-lora-weight-equal with --lora-train-only: no adapter is synced to check"
            )
        if self.target_modules is not None and not self.target_modules.strip(" ,"):
            raise ConfigError("--target-modules is empty; omit it for the default (attention + MLP)")
        if self.lora_adapter_path and not os.path.isfile(
            os.path.join(self.lora_adapter_path, "adapter_config.json")
        ):
            raise ConfigError(
                f"--lora-adapter-path {self.lora_adapter_path}: no adapter_config.json there (a PEFT adapter dir)"
            )

    def _check_opd_flags(self) -> None:
        """Miles' OPD rules (docs/opd.md): every --opd-* flag needs --use-opd; the teacher is an engine
        (sglang) or frozen in the trainer (megatron), never both; top-k OPD is sglang only."""
        opd = [f.name for f in dataclasses.fields(self) if f.name.startswith("opd_")]
        set_ = [_flag(n) for n in opd if getattr(self, n) != _default(n)]
        if not self.use_opd:
            if set_:
                raise ConfigError(
                    f"{', '.join(set_)}: on-policy distillation flags; add --use-opd (or drop them)"
                )
            return
        if self.opd_type is None:
            raise ConfigError(
                "--use-opd needs --opd-type sglang (a teacher engine) or megatron (in the trainer)"
            )
        if self.loss_type != "policy_loss":
            raise ConfigError(
                f"--use-opd shapes policy-loss advantages; --loss-type {self.loss_type} has none"
            )
        if self.sampling_support_replay():
            raise ConfigError(
                f"--use-opd with sampling-support replay (--rollout-top-k {self.rollout_top_k}, --rollout-top-p "
                f"{self.rollout_top_p}): the reverse KL compares full-vocabulary log-probs and replay gives the "
                "student a support-normalized one; sample with --rollout-top-k -1 --rollout-top-p 1"
            )
        from miles_platform.rollout.opd import parse_teacher_urls

        urls = parse_teacher_urls(self.opd_teacher_urls)
        if self.opd_type == "megatron":
            wrong = [(f, on) for f, on in (("--opd-teacher-urls", bool(urls)), ("--opd-teacher-hf-checkpoint",
                     bool(self.opd_teacher_hf_checkpoint)), (f"--opd-log-prob-top-k {self.opd_log_prob_top_k}",
                     self.opd_log_prob_top_k > 0)) if on]  # fmt: skip
            if wrong:
                raise ConfigError(
                    f"{', '.join(f for f, _ in wrong)}: sglang-mode OPD only (a teacher engine); "
                    "--opd-type megatron loads the teacher in the trainer from --opd-teacher-load"
                )
            if not self.opd_teacher_load:
                raise ConfigError("--opd-type megatron needs --opd-teacher-load (the teacher checkpoint)")
            return
        if self.opd_teacher_load:
            raise ConfigError(
                "--opd-teacher-load must not be set with --opd-type sglang (the teacher is an engine: "
                "--opd-teacher-urls, --rm-url or --opd-teacher-hf-checkpoint); use --opd-type megatron"
            )
        sources = [f for f, on in (("--opd-teacher-urls", bool(urls)), ("--opd-teacher-hf-checkpoint",
                   bool(self.opd_teacher_hf_checkpoint))) if on]  # fmt: skip
        if len(sources) > 1:
            raise ConfigError(f"{' and '.join(sources)}: give one teacher source")
        if not sources and not self.rm_url:
            raise ConfigError(
                "--opd-type sglang needs a teacher: --rm-url http://HOST:PORT/generate (Miles), "
                "--opd-teacher-urls NAME=URL ..., or --opd-teacher-hf-checkpoint DIR (started by the run)"
            )
        if not sources and self.rm_type == "remote_rm":
            raise ConfigError(
                "--rm-type remote_rm and --use-opd both read --rm-url: name the teacher with "
                "--opd-teacher-urls default=URL"
            )

    def _check_score_centering(self) -> None:
        """Score centering (docs/algorithms.md, Miles' rules): its flags only with --loss-type
        score_centering; what it cannot be combined with is refused before anything starts."""
        names = ("rollout_top_logprobs_num", "score_centering_is", "score_centering_tis_clip",
                 "score_centering_mis_low", "score_centering_mis_high")  # fmt: skip
        given = [_flag(n) for n in names if getattr(self, n) != _default(n)]
        if self.loss_type != "score_centering":
            if given:
                raise ConfigError(
                    f"{', '.join(given)}: score centering flags (the candidates are read by that loss "
                    "only); add --loss-type score_centering or drop them"
                )
            return
        sc, k = "--loss-type score_centering", self.rollout_top_logprobs_num
        if k <= 0:
            raise ConfigError(
                f"{sc} needs --rollout-top-logprobs-num K > 0 (got {k}): the engine's K candidate "
                "log-probs per token are H, what the score is centered over (Miles' recipe: 128)"
            )
        if not self.use_rollout_logprobs:
            raise ConfigError(
                f"{sc} needs --use-rollout-logprobs: q, the distribution that sampled, is what the "
                "engine recorded (rollout log-probs and top-K), never a trainer recomputation"
            )
        if self.advantage_estimator != "grpo":
            raise ConfigError(
                f"{sc} with --advantage-estimator {self.advantage_estimator}: the initial advantage "
                "estimator must be grpo (as in Miles); use --advantage-estimator grpo"
            )
        refused = (
            ("--use-opd", self.use_opd, "OPD shapes advantages with a full-vocabulary reverse KL"),
            ("--use-tis", self.use_tis, "use --score-centering-is tis or mis (weights centered with the score)"),
            ("--use-opsm", getattr(self, "use_opsm", False), "sequence masking is not part of the centered loss"),
            ("--use-session-server", bool(self.use_session_server),
             "session requests do not record candidate log-probs here; use the default or multi_turn generate"),
        )  # fmt: skip
        for flag, on, why in refused:
            if on:
                raise ConfigError(f"{flag} with {sc}: {why}")
        if self.sampling_support_replay() and k < self.rollout_top_k:
            raise ConfigError(
                f"--rollout-top-logprobs-num {k} < --rollout-top-k {self.rollout_top_k}: filtered sampling "
                "records each token's whole support (support mode), so K must hold --rollout-top-k ids"
            )
        if not (math.isfinite(self.score_centering_tis_clip) and self.score_centering_tis_clip > 0):
            raise ConfigError(f"--score-centering-tis-clip {self.score_centering_tis_clip}: must be > 0")
        lo, hi = self.score_centering_mis_low, self.score_centering_mis_high
        if not (math.isfinite(lo) and math.isfinite(hi) and 0 <= lo <= hi):
            raise ConfigError(
                f"--score-centering-mis-low {lo} / --score-centering-mis-high {hi}: need 0 <= low <= high"
            )

    def _check_generate_flags(self) -> None:
        """The multi-turn flags act through a generate function; a rollout function owns the whole
        rollout, which the fully async worker would bypass. (Imports are checked before start.)"""
        tool_flags = (
            "generate_tool_specs_path",
            "generate_tool_call_parser",
            "generate_execute_tool_function_path",
        )
        given = [_flag(n) for n in tool_flags if getattr(self, n)]
        if given and not self.custom_generate_function_path:
            raise ConfigError(
                f"{', '.join(given)}: read by a generate function; set --custom-generate-function-path "
                "miles_platform.rollout.generate_hub.multi_turn.generate (or your own)"
            )
        self._check_agentic_flags()
        if self.rollout_function_path and self.fully_async:
            raise ConfigError(
                "--rollout-function-path with --fully-async: the rollout function replaces the rollout the "
                "fully async worker runs; drop one (a per-sample --custom-generate-function-path works with both)"
            )

    def _check_agentic_flags(self) -> None:
        """--use-session-server (bare/v1; v2 refused), the agent flags only with the agentic wrapper,
        the session flags only with the session server."""
        from miles_platform.plugins import AGENTIC, MILES_BUILTINS

        if self.use_session_server not in (None, "v1"):
            raise ConfigError(
                f"--use-session-server {self.use_session_server}: only v1 (the linear, append-only server; "
                "pass the bare flag) is implemented; Miles' experimental v2 tree server is not"
            )
        path = self.custom_generate_function_path
        agentic = MILES_BUILTINS.get(path, path) == AGENTIC
        if agentic and not self.custom_agent_function_path:
            raise ConfigError(f"--custom-generate-function-path {path} needs --custom-agent-function-path")
        if agentic and not self.use_session_server:
            raise ConfigError(f"--custom-generate-function-path {path} needs --use-session-server (v1)")
        if agentic and self.apply_chat_template:
            raise ConfigError(
                "--apply-chat-template with agentic_tool_call: the session server renders the template; "
                "Sample.prompt must stay a messages list (drop --apply-chat-template)"
            )
        agent_flags = (
            "custom_agent_function_path",
            "custom_agent_function_mode",
            "custom_agent_function_timeout",
        )
        given = [_flag(n) for n in agent_flags if getattr(self, n) != _default(n)]
        if given and not agentic:
            raise ConfigError(
                f"{', '.join(given)}: read by --custom-generate-function-path "
                "miles.rollout.generate_hub.agentic_tool_call.generate; set it"
            )
        session_flags = ("tito_model", "max_seq_len", "session_server_ip", "session_server_port")
        given = [_flag(n) for n in session_flags if getattr(self, n) != _default(n)]
        if given and not self.use_session_server:
            raise ConfigError(f"{', '.join(given)}: session server flags; set --use-session-server")

    def _check_fault_tolerance(self) -> None:
        if not self.use_fault_tolerance:
            return
        why = None
        if self.debug_train_only:
            why = "--debug-train-only starts no engines"
        elif self.rollout_engine != "embedded" or self.rollout_external_engine_addrs:
            why = "restarting an SGLang or external engine is not built (embedded engines only)"
        elif self.lora_rank > 0:
            why = "a restarted engine would need the run's adapters re-loaded (not built)"
        if why:
            raise ConfigError(f"--use-fault-tolerance: {why}")

    def _check_ranges(self) -> None:
        """Every numeric flag in its range (NaN and inf included), with the flag named."""
        for name, (lo, hi, lo_open, what) in _RANGES.items():
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ConfigError(f"{_flag(name)} {v!r}: expected a number")
            ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
            if not ok:
                raise ConfigError(f"{_flag(name)} {v}: must be {what}")
        for f in dataclasses.fields(self):  # choices hold for YAML, Dagster and Python callers too
            choices, v = f.metadata.get("choices"), getattr(self, f.name)
            if (
                choices
                and v is not None
                and not (v in choices if not isinstance(v, list) else set(v) <= set(choices))
            ):
                raise ConfigError(f"{_flag(f.name)} {v!r}: must be one of {', '.join(map(str, choices))}")
        for name in ("adam_beta1", "adam_beta2"):
            if getattr(self, name) >= 1:
                raise ConfigError(f"{_flag(name)} {getattr(self, name)}: must be in [0, 1)")
        if self.rollout_top_k != -1 and self.rollout_top_k < 1:
            raise ConfigError(f"--rollout-top-k {self.rollout_top_k}: must be -1 (off) or >= 1")
        if self.eval_top_k is not None and self.eval_top_k != -1 and self.eval_top_k < 1:
            raise ConfigError(f"--eval-top-k {self.eval_top_k}: must be -1 (off) or >= 1")
        for lo, hi in (("tis_lower_bound", "tis_upper_bound"), ("rs_lower_bound", "rs_upper_bound"),
                       ("tis_clip_low", "tis_clip")):  # fmt: skip
            a, b = getattr(self, lo), getattr(self, hi)
            if a is not None and b is not None and a > b:
                raise ConfigError(f"{_flag(lo)} {a} > {_flag(hi)} {b}")

    def resolve_api_key(self) -> str:
        """The run's secret, set on `api_key`: --api-key, else --api-key-file, else $MILES_API_KEY,
        else a fresh random one. Every engine, router and weight-update call of the run carries it."""
        if self.api_key and self.api_key_file:
            raise ConfigError("--api-key and --api-key-file: give one")
        if self.api_key_file:
            try:
                key = Path(self.api_key_file).read_text().strip()
            except OSError as e:
                raise ConfigError(
                    f"--api-key-file {self.api_key_file}: cannot read it ({e.strerror})"
                ) from None
            if not key:
                raise ConfigError(f"--api-key-file {self.api_key_file}: the file is empty")
            self.api_key = key
        elif not self.api_key:
            self.api_key = os.environ.get("MILES_API_KEY") or secrets.token_urlsafe(32)
        return self.api_key

    def sampling_support_replay(self) -> bool:
        """Miles' sampling-support replay: on whenever rollouts sample from a truncated distribution."""
        return self.rollout_top_p < 1 or self.rollout_top_k > 0

    # eval sampling inherits from rollout sampling, as in Miles
    def eval_sampling(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.eval_max_response_len or self.rollout_max_response_len,
            "temperature": self.rollout_temperature
            if self.eval_temperature is None
            else self.eval_temperature,
            "top_p": self.rollout_top_p if self.eval_top_p is None else self.eval_top_p,
            "top_k": self.rollout_top_k if self.eval_top_k is None else self.eval_top_k,
        }

    def eval_datasets(self) -> list[tuple[str, str]]:
        it = iter(self.eval_prompt_data)
        return list(zip(it, it))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """Content hash of the settings that change what is trained (paths of outputs excluded)."""
        skip = {
            "save",
            "load",
            "storage_root",
            "log_interval",
            "ray_address",
            "api_key",
            "api_key_file",
            "run_name",
            "ci_fault_hooks",
            *LOGGING,
        }
        payload = {k: v for k, v in self.to_dict().items() if k not in skip}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        clean = {k.replace("-", "_"): v for k, v in data.items()}
        for alias, name in ALIASES.items():
            if alias in clean:
                if name in clean and clean[name] != clean[alias]:
                    raise ConfigError(
                        f"{_flag(alias)} and {_flag(name)} are the same flag with different values"
                    )
                clean[name] = clean.pop(alias)
        unknown = sorted(set(clean) - names)
        if unknown:
            raise ConfigError(
                f"unknown config keys {unknown}; see `miles-platform train --help` for valid flags"
            )
        return cls(**clean)


# Miles flags this build does not implement. Set to anything but the default they are an error, never
# silently ignored (tests/unit/config/test_config_flags.py fails on any field that nothing reads and nothing refuses).
_DP_ONLY = "the trainer runs data-parallel only"
# The tracker flags: where metrics go, never what is trained (outside config_hash, resumable)
LOGGING = frozenset(f.name for f in dataclasses.fields(RunConfig) if f.metadata["group"] == "logging")
# What a resumed run may change without --allow-config-change: how long it runs, when it saves /
# evaluates / logs, where its processes run, debug and CI switches. Anything else changes what
# is trained (data, model, algorithm, batch, optimizer, sampling, precision, weight transport).
RESUMABLE = frozenset(
    {"ray_address", "actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus", "rollout_num_gpus_per_engine",
     "colocate", "num_cpus_per_actor", "rollout_engine", "rollout_external_engine_addrs", "sglang_router_port",
     "use_fault_tolerance", "rollout_health_check_interval", "rollout_health_check_timeout",
     "rollout_health_check_first_wait", "pause_wait_timeout_s", "pause_max_queued_requests", "api_key", "api_key_file", "allow_config_change", "object_store_backend", "mooncake_store_init_kwargs",
     "load", "save", "save_interval", "save_hf", "num_rollout", "num_epoch", "rollout_max_concurrency",
     "eval_prompt_data", "eval_interval", "n_samples_per_eval_prompt", "eval_max_response_len",
     "eval_temperature", "eval_top_p", "eval_top_k", "eval_reward_key", "skip_eval_before_train",
     "update_weight_disk_dir", "update_weight_local_checkpoint_dir", "custom_update_weight_post_write_path",
     "disk_delta_encode_workers", "check_weight_update_equal", "check_lora_weight_equal", "storage_root", "save_debug_rollout_data",
     "ci_test", "ci_logprob_abs_diff_threshold", "ci_fault_hooks", "log_interval", "sglang_args",
     "max_nonfinite_steps", "train_timeout_s", "custom_generate_function_timeout"} | LOGGING
)  # fmt: skip


def config_changes(saved: dict, now, resumable: frozenset[str] = RESUMABLE) -> list[str]:
    """The flags that differ from a saved run's config in what is trained, as `--flag old -> new`
    (`now`: a RunConfig or a DiffusionRunConfig with its own `resumable` set)."""
    cur = json.loads(json.dumps(now.to_dict(), default=str))
    return [
        f"{_flag(k)} {saved[k]!r} -> {cur[k]!r}"
        for k in sorted(cur)
        if k in saved and k not in resumable and saved[k] != cur[k]
    ]


def saved_config(cfg) -> str:
    """The config a checkpoint dir records (`run_config.json`), without the secret."""
    d = {k: v for k, v in cfg.to_dict().items() if k not in ("api_key",)}
    return json.dumps(d, default=str, sort_keys=True, indent=1)


# every LoRA flag but the rank: set while --lora-rank is 0 they are an error
LORA_FLAGS = ("lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "lora_adapter_path",
              "lora_train_only", "check_lora_weight_equal")  # fmt: skip

# Miles' mis.py flags (training/mis.py): any of them set selects the MIS correction
MIS_FLAGS = ("tis_level", "tis_mode", "tis_lower_bound", "tis_upper_bound", "use_rs", "rs_level",
             "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold", "tis_batch_normalize")  # fmt: skip

REFUSED: dict[str, str] = {
    "opd_teacher_ckpt_step": "pass the checkpoint's iter_NNNNNNN dir itself as --opd-teacher-load",
    "tensor_model_parallel_size": f"{_DP_ONLY} (TP > 1 is supported by `miles-platform convert`, not by training yet)",
    "pipeline_model_parallel_size": _DP_ONLY,
    "context_parallel_size": _DP_ONLY,
    "expert_model_parallel_size": "MoE experts train at expert parallel 1, every rank holding every expert (docs/moe.md)",
}


def _default(name: str) -> Any:
    f = RunConfig.__dataclass_fields__[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_seeds(cfg) -> None:
    """--seed and --rollout-seed: whole numbers numpy, torch and random all take, [0, 2^32 - 1)
    (a seed of 2^70 passed validation and failed in every trainer rank)."""
    for name in ("seed", "rollout_seed"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**32 - 1024:
            raise ConfigError(f"{_flag(name)} {v!r}: must be a whole number in [0, 2^32 - 1024)")


def check_run_name(name: str) -> None:
    """A run name becomes a directory (`run=<name>`) and a partition key: letters, digits, '.',
    '_' and '-', starting with a letter or digit, at most 128 characters (no '/', no '..')."""
    if not isinstance(name, str) or not RUN_NAME.fullmatch(name):
        raise ConfigError(
            f"--run-name {name!r}: use letters, digits, '.', '_' and '-' (starting with a letter or digit, "
            "at most 128 characters): it names directories under the storage root and partition keys"
        )


def _check_rollout_template(flag: str, template: str) -> None:
    """A per-rollout path template: must name {rollout_id} (else every rollout overwrites one file)
    and nothing else (str.format would fail on it mid-run)."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        raise ConfigError(f"{flag} {template!r}: not a valid path template ({e})") from None
    if "rollout_id" not in names or names - {"rollout_id"}:
        raise ConfigError(
            f"{flag} {template!r} must contain {{rollout_id}} and no other {{field}}: one file per rollout, "
            "e.g. /tmp/rollout_{rollout_id}.parquet (a fixed path would be overwritten every rollout)"
        )


def derive_batch_knobs(cfg: RunConfig) -> None:
    """rollout_batch_size * n_samples_per_prompt = global_batch_size * num_steps_per_rollout."""
    rbs, n, gbs, steps = (
        cfg.rollout_batch_size,
        cfg.n_samples_per_prompt,
        cfg.global_batch_size,
        cfg.num_steps_per_rollout,
    )

    def state() -> str:
        return (
            f"--rollout-batch-size={rbs} x --n-samples-per-prompt={n} must equal "
            f"--global-batch-size={gbs} x --num-steps-per-rollout={steps}"
        )

    if rbs is None:
        raise ConfigError(f"--rollout-batch-size is required ({state()})")
    if rbs <= 0 or n <= 0 or (gbs is not None and gbs <= 0) or (steps is not None and steps <= 0):
        raise ConfigError(f"batch knobs must be positive: {state()}")
    total = rbs * n
    if gbs is None and steps is None:
        steps = 1
    if gbs is None:
        if total % steps:
            raise ConfigError(
                f"cannot derive --global-batch-size: {total} not divisible by {steps}: {state()}"
            )
        gbs = total // steps
    elif steps is None:
        if total % gbs:
            raise ConfigError(
                f"cannot derive --num-steps-per-rollout: {total} not divisible by {gbs}: {state()}"
            )
        steps = total // gbs
    if gbs * steps != total:
        raise ConfigError(f"contradictory batch knobs: {state()} ({total} != {gbs * steps})")
    cfg.global_batch_size, cfg.num_steps_per_rollout = gbs, steps


# ---------------------------------------------------------------------------- argparse


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# Miles' own names for flags this project spelled differently first: both are accepted (CLI and YAML)
ALIASES = {
    "update_weight_delta_encoding": "disk_delta_encoding",
    "update_weight_delta_checksum": "disk_delta_checksum",
}


_DICT_FIELDS = ("sglang_args", "custom_function_args")  # filled by parse_run_config, not flags


def build_parser(prog: str = "miles-platform train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Miles-style RL training (GRPO and friends).")
    parser.add_argument(
        "--config", help="YAML file of flags (snake_case or kebab-case keys); CLI overrides it"
    )
    groups = {g: parser.add_argument_group(f"{g} arguments") for g in GROUPS}
    for f in dataclasses.fields(RunConfig):
        if f.name not in _DICT_FIELDS:
            _add_flag(groups[f.metadata["group"]], f, argparse.SUPPRESS)
    return parser


# The flags other commands share with `train` (one definition each, see `add_flags`)
DATASET_FLAGS = ("input_key", "label_key", "metadata_key", "apply_chat_template")
REWARD_FLAGS = ("rm_type", "rm_url", "custom_rm_path", "group_rm", "reward_key", "eval_reward_key")


def add_flags(parser: argparse.ArgumentParser, names: Sequence[str], **defaults: Any) -> None:
    """Add RunConfig fields `names` to another command's parser with train's flag name, type,
    choices and help. `defaults` replaces a field's default for that command; help then shows it."""
    for name in names:
        f = RunConfig.__dataclass_fields__[name]
        _add_flag(parser, f, defaults.get(name, _default(name)), shown=name in defaults)


def _add_flag(group, f: dataclasses.Field, default: Any, shown: bool = False) -> None:
    """One RunConfig field as an argparse flag (its Miles name plus any ALIASES)."""
    meta, text = f.metadata, f.metadata["help"]
    text += " [not supported by this build: refused if set]" if f.name in REFUSED else ""
    text += " (default: %(default)s)" if shown else ""
    kw: dict[str, Any] = {"help": text, "dest": f.name, "default": default}
    if f.type in ("bool", bool):
        group.add_argument(_flag(f.name), action="store_true", **kw)
        return
    if meta["nargs"]:
        kw["nargs"] = meta["nargs"]
        if meta.get("const") is not None:  # a bare `--flag` (nargs "?") means this value
            kw["const"] = meta["const"]
        kw["type"] = int if "int" in str(f.type) else str
    else:
        kw["type"] = _scalar_type(str(f.type))
    if meta["choices"]:
        kw["choices"] = meta["choices"]
    group.add_argument(_flag(f.name), *[_flag(a) for a, n in ALIASES.items() if n == f.name], **kw)


def _scalar_type(t: str):
    if t.startswith("int"):
        return int
    if t.startswith("float"):
        return float
    return str


def load_yaml(path: str) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--config {path}: file not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag -> value, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    for key, value in data.items():
        name = ALIASES.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        f = fields.get(name)
        if f is None or value is None:
            continue  # unknown keys: RunConfig.from_dict names them
        t = str(f.type)
        want = (
            bool if t.startswith("bool")
            else (int,) if t.startswith("int")
            else (int, float) if t.startswith("float")
            else None
        )  # fmt: skip
        bad = want is not None and (
            not isinstance(value, want) or (want is not bool and isinstance(value, bool))
        )
        if bad:
            kind = {bool: "true/false", (int,): "an integer", (int, float): "a number"}[want]
            raise ConfigError(f"--config {path}: {key}: expected {kind}, got {value!r}")
    return data


def parse_run_config(argv: list[str] | None = None, prog: str = "miles-platform train") -> RunConfig:
    """Parse CLI flags (YAML via --config first, CLI overrides) into a validated RunConfig."""
    parser = build_parser(prog)
    args, rest = parser.parse_known_args(argv)
    sglang, leftover = _split_passthrough(rest)
    data: dict[str, Any] = {}
    if getattr(args, "config", None):
        data.update({k.replace("-", "_"): v for k, v in load_yaml(args.config).items()})
    data.update({k: v for k, v in vars(args).items() if k != "config"})
    extra, leftover = _function_flags(data, leftover)
    if leftover:
        parser.error(f"unrecognized arguments: {' '.join(leftover)}")
    data.setdefault("sglang_args", {}).update(sglang)
    data.setdefault("custom_function_args", {}).update(extra)
    return RunConfig.from_dict(data).validate()


def _function_flags(data: dict[str, Any], argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Miles' `add_arguments` hook: flags that --custom-generate-function-path / --rollout-function-path
    register, from `argv` (CLI) or `data` (YAML keys, popped), CLI first. Returns (values, argv left).
    A flag that is already a RunConfig field stays that field (a copy of Miles' multi_turn registering
    --generate-max-turns means ours)."""
    from miles_platform.plugins import GENERATE_FLAG, ROLLOUT_FLAG, function_flags_parser

    paths = {
        GENERATE_FLAG: data.get("custom_generate_function_path"),
        ROLLOUT_FLAG: data.get("rollout_function_path"),
    }
    extra = function_flags_parser(paths)
    if extra is None:
        return {}, argv
    actions = [a for a in extra._actions if a.dest not in RunConfig.__dataclass_fields__]
    defaults = {a.dest: a.default for a in actions}
    for a in extra._actions:  # tell given flags from defaults
        a.default = argparse.SUPPRESS
    given, left = extra.parse_known_args(argv)
    values = {}
    for dest, default in defaults.items():
        values[dest] = getattr(given, dest) if hasattr(given, dest) else data.pop(dest, default)
        data.pop(dest, None)
    return values, left


def function_flag_values(data: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    """The values of a generate/rollout function's own flags given as CLI tokens (the Dagster
    Launchpad's `custom_function_flags`); a token no function registered is a ConfigError."""
    try:
        values, left = _function_flags(data, list(argv))
    except SystemExit:  # argparse's own error (a bad value), already printed to stderr
        raise ConfigError(f"custom_function_flags {argv}: a value the function's parser refuses") from None
    if left:
        raise ConfigError(
            f"custom_function_flags: {' '.join(left)} not registered by the add_arguments of "
            "--custom-generate-function-path / --rollout-function-path"
        )
    return values


def _split_passthrough(rest: list[str]) -> tuple[dict[str, Any], list[str]]:
    """`--sglang-foo-bar 1` -> {"foo-bar": "1"}; bare `--sglang-flag` -> True."""
    out: dict[str, Any] = {}
    leftover: list[str] = []
    i = 0
    while i < len(rest):
        tok = rest[i]
        if tok.startswith("--sglang-"):
            key = tok[len("--sglang-") :]
            if "=" in key:
                key, val = key.split("=", 1)
                out[key] = val
            elif i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                out[key] = rest[i + 1]
                i += 1
            else:
                out[key] = True
        else:
            leftover.append(tok)
        i += 1
    return out, leftover
