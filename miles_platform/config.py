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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_platform.errors import MilesError

GROUPS = (
    "cluster",
    "checkpoint",
    "rollout",
    "sampling",
    "reward",
    "eval",
    "algorithm",
    "optimizer",
    "perf",
    "precision",
    "weight-update",
    "async",
    "storage",
    "debug",
)


class ConfigError(MilesError, ValueError):
    """A user mistake in the configuration: message names the flag and what is allowed."""


def _f(default: Any, group: str, help: str, choices: tuple | None = None, nargs: str | None = None):
    meta = {"group": group, "help": help, "choices": choices, "nargs": nargs}
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunConfig:
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
    api_key: str | None = _f(None, "cluster", "bearer token for engines and router")
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
    rollout_function_path: str | None = _f(None, "rollout", "custom rollout function <module>.<fn>")
    custom_generate_function_path: str | None = _f(
        None, "rollout", "custom per-sample generate <module>.<fn>"
    )
    rollout_max_concurrency: int = _f(
        64, "rollout", "max in-flight generate requests from the rollout manager"
    )

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
        None, "reward", "built-in reward: math, dapo, deepscaler, f1, random, remote_rm, boxed_<type>"
    )
    rm_url: str | None = _f(None, "reward", "endpoint for --rm-type remote_rm")
    group_rm: bool = _f(False, "reward", "reward computed per group by --custom-rm-path")
    custom_rm_path: str | None = _f(None, "reward", "custom reward <module>.<fn>")
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
    n_samples_per_eval_prompt: int = _f(1, "eval", "responses per eval prompt (pass@k)")
    eval_max_response_len: int | None = _f(None, "eval", "inherits --rollout-max-response-len")
    eval_temperature: float | None = _f(None, "eval", "inherits --rollout-temperature (pass@1 greedy uses 0)")
    eval_top_p: float | None = _f(None, "eval", "inherits --rollout-top-p")
    eval_top_k: int | None = _f(None, "eval", "inherits --rollout-top-k")
    skip_eval_before_train: bool = _f(False, "eval", "skip the eval of the initial policy")

    # --- algorithm ---
    loss_type: str = _f(
        "policy_loss", "algorithm", "loss", choices=("policy_loss", "sft_loss", "custom_loss")
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
    use_tis: bool = _f(False, "algorithm", "truncated importance sampling for train/rollout mismatch")
    tis_level: str = _f("token", "algorithm", "IS level", choices=("token", "sequence", "geometric"))
    tis_mode: str = _f("truncate", "algorithm", "IS mode", choices=("truncate", "clip", "mask"))
    tis_lower_bound: float = _f(0.5, "algorithm", "IS lower bound")
    tis_upper_bound: float = _f(2.0, "algorithm", "IS upper bound")
    critic_lr: float | None = _f(None, "algorithm", "critic LR for ppo (defaults to --lr)")

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

    # --- async ---
    fully_async: bool = _f(False, "async", "background generation with a bounded buffer")
    max_weight_staleness: int | None = _f(
        None, "async", "drop groups whose oldest version lags the engine by more"
    )
    async_buffer_capacity: int | None = _f(
        None, "async", "max finished groups buffered (default 2x rollout batch)"
    )

    # --- storage ---
    run_name: str = _f("run", "storage", "run name: partition keys are <run>.v<NNNNNN>")
    storage_root: str = _f(".miles", "storage", "storage root (local dir or any fsspec URI)")

    # --- debug ---
    debug_rollout_only: bool = _f(False, "debug", "generate and store rollouts, no training")
    debug_train_only: bool = _f(False, "debug", "train on loaded rollouts, no engines")
    save_debug_rollout_data: str | None = _f(None, "debug", "Parquet path template with {rollout_id}")
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
    log_interval: int = _f(1, "debug", "print metrics every N rollouts")

    # passthrough: --sglang-<flag> value, prefix stripped when launching SGLang
    sglang_args: dict[str, Any] = field(
        default_factory=dict, metadata={"group": "cluster", "help": "", "choices": None, "nargs": None}
    )

    # ------------------------------------------------------------------
    def validate(self) -> RunConfig:
        """Derive the unset batch knob and reject contradictions. Returns self."""
        derive_batch_knobs(self)
        if self.load_debug_rollout_data:
            self.debug_train_only = True
        if self.debug_rollout_only and self.debug_train_only:
            raise ConfigError("--debug-rollout-only and --debug-train-only exclude each other")
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
        if self.fully_async and self.pause_generation_mode == "abort":
            raise ConfigError("--fully-async rejects --pause-generation-mode abort (use retract or in_place)")
        if self.update_weight_transfer_mode == "disk-delta" and not self.update_weight_disk_dir:
            raise ConfigError("--update-weight-transfer-mode disk-delta needs --update-weight-disk-dir")
        for name in ("disk_delta_keyframe_interval", "disk_delta_encode_workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{_flag(name)} must be >= 1, got {getattr(self, name)}")
        not_built = {
            "rollout_function_path": "--rollout-function-path",
            "custom_generate_function_path": "--custom-generate-function-path",
        }
        for name, flag in not_built.items():
            if getattr(self, name):
                raise ConfigError(
                    f"{flag} is not supported by this build yet (use --custom-rm-path, the filter hooks and --custom-loss-function-path)"
                )
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            if getattr(self, name) != 1:
                raise ConfigError(
                    f"--{name.replace('_', '-')} {getattr(self, name)}: the trainer runs data-parallel only "
                    "(TP > 1 is supported by `miles-platform convert`, not by training yet)"
                )
        if self.loss_type == "custom_loss" and not self.custom_loss_function_path:
            raise ConfigError("--loss-type custom_loss needs --custom-loss-function-path")
        return self

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
        skip = {"save", "load", "storage_root", "log_interval", "ray_address", "api_key", "run_name"}
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


def build_parser(prog: str = "miles-platform train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Miles-style RL training (GRPO and friends).")
    parser.add_argument(
        "--config", help="YAML file of flags (snake_case or kebab-case keys); CLI overrides it"
    )
    groups = {g: parser.add_argument_group(f"{g} arguments") for g in GROUPS}
    for f in dataclasses.fields(RunConfig):
        if f.name == "sglang_args":
            continue
        meta, g = f.metadata, groups[f.metadata["group"]]
        kw: dict[str, Any] = {"help": meta["help"], "dest": f.name, "default": argparse.SUPPRESS}
        if f.type in ("bool", bool):
            g.add_argument(_flag(f.name), action="store_true", **kw)
            continue
        if meta["nargs"]:
            kw["nargs"] = meta["nargs"]
            kw["type"] = int if "int" in str(f.type) else str
        else:
            kw["type"] = _scalar_type(str(f.type))
        if meta["choices"]:
            kw["choices"] = meta["choices"]
        g.add_argument(_flag(f.name), *[_flag(a) for a, n in ALIASES.items() if n == f.name], **kw)
    return parser


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
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag -> value, got {type(data).__name__}")
    return data


def parse_run_config(argv: list[str] | None = None, prog: str = "miles-platform train") -> RunConfig:
    """Parse CLI flags (YAML via --config first, CLI overrides) into a validated RunConfig."""
    parser = build_parser(prog)
    args, rest = parser.parse_known_args(argv)
    sglang, leftover = _split_passthrough(rest)
    if leftover:
        parser.error(f"unrecognized arguments: {' '.join(leftover)}")
    data: dict[str, Any] = {}
    if getattr(args, "config", None):
        data.update({k.replace("-", "_"): v for k, v in load_yaml(args.config).items()})
    data.update({k: v for k, v in vars(args).items() if k != "config"})
    data.setdefault("sglang_args", {}).update(sglang)
    return RunConfig.from_dict(data).validate()


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
