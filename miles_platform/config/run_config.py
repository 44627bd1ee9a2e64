"""RunConfig: every flag of `miles-platform train`, assembled from the capability modules of this
package (each owns its fields, ranges and checks), flattened into one dataclass under Miles' flag
names and defaults: the CLI (`cli.build_parser`), YAML files and the Dagster Launchpad all read it.

Defaults follow Miles except where the CPU embedded default needs something else; those fields say
so in their help text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from miles_platform.config import (
    agentic,
    algorithm,
    checkpoint,
    cluster,
    debug,
    evaluation,
    lora,
    megatron,
    model_args,
    moe,
    opd,
    outputs,
    rollout,
    training,
    weights,
)
from miles_platform.config.agentic import AgenticFlags
from miles_platform.config.algorithm import AlgorithmFlags, CorrectionFlags
from miles_platform.config.checkpoint import CheckpointFlags, check_seeds
from miles_platform.config.cluster import ClusterFlags
from miles_platform.config.compat import COMPAT, accepted_compat_flags, check_compat_flags
from miles_platform.config.debug import DebugFlags
from miles_platform.config.evaluation import EvalFlags
from miles_platform.config.flags import check_choices, check_ranges, field_default, flag_name
from miles_platform.config.hooks import HookFlags
from miles_platform.config.lora import LoraFlags
from miles_platform.config.megatron import MegatronFlags
from miles_platform.config.model_args import MODEL_ARGS, ModelArgsFlags
from miles_platform.config.moe import MoeFlags
from miles_platform.config.opd import OpdFlags
from miles_platform.config.outputs import LoggingFlags, StorageFlags, check_run_name
from miles_platform.config.partial_rollout import PartialRolloutFlags
from miles_platform.config.reward import RewardFlags
from miles_platform.config.rollout import AsyncFlags, RolloutFlags, SamplingFlags, derive_batch_knobs
from miles_platform.config.score_centering import ScoreCenteringFlags
from miles_platform.config.training import OptimizerFlags, PerfFlags, PrecisionFlags
from miles_platform.config.vision import VisionFlags
from miles_platform.config.weights import ALIASES, WeightUpdateFlags
from miles_platform.errors import ConfigError

# the argparse groups, in `--help` order
GROUPS = (
    "cluster",
    "checkpoint",
    "model",
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
    "hooks",
)

# The capabilities, in field order (which is `--help` order within a group, and the Launchpad's).
CAPABILITIES = (
    ClusterFlags, CheckpointFlags, ModelArgsFlags, RolloutFlags, AgenticFlags, SamplingFlags, RewardFlags, EvalFlags,
    AlgorithmFlags, MoeFlags, CorrectionFlags, ScoreCenteringFlags, OpdFlags, OptimizerFlags, PerfFlags,
    MegatronFlags, PrecisionFlags, WeightUpdateFlags, LoraFlags, AsyncFlags, PartialRolloutFlags, StorageFlags, LoggingFlags, DebugFlags,
    HookFlags, VisionFlags,
)  # fmt: skip

# flag -> (low, high, low excluded, what the error says), checked by validate(); None values are skipped
RANGES: dict[str, tuple] = {
    **cluster.RANGES, **checkpoint.RANGES, **rollout.RANGES, **agentic.RANGES, **evaluation.RANGES,
    **algorithm.RANGES, **moe.RANGES, **opd.RANGES, **training.RANGES, **weights.RANGES, **lora.RANGES,
    **debug.RANGES, **megatron.RANGES, **model_args.RANGES, **outputs.RANGES,
}  # fmt: skip

# Miles flags this build does not implement, with the reason. Set to anything but the default they are
# an error, never silently ignored (tests/unit/config/test_config_flags.py fails on any field that
# nothing reads and nothing refuses).
REFUSED: dict[str, str] = {**opd.REFUSED, **training.REFUSED, **megatron.REFUSED}


# dataclass fields follow the reversed MRO: the bases are listed last capability first
@dataclass
class RunConfig(*reversed(CAPABILITIES)):
    """Every flag of `miles-platform train`, under Miles' names and defaults (snake_case), in
    argparse groups (`flag(default, group, help, choices)`). `validate()` range-checks every number,
    derives the batch knobs and refuses contradictions before anything starts; `config_hash()` is
    what is trained (outputs, secrets, logging and fault hooks excluded); `RESUMABLE` lists the
    flags a resume may change, `REFUSED` the flags refused with a reason."""

    # passthrough: --sglang-<flag> value, prefix stripped when launching SGLang
    sglang_args: dict[str, Any] = field(
        default_factory=dict, metadata={"group": "cluster", "help": "", "choices": None, "nargs": None}
    )
    # the flags a custom generate / rollout function registers with Miles' `fn.add_arguments(parser)`
    # hook: parsed from the CLI (or YAML) and shown to the function as args.<name>
    custom_function_args: dict[str, Any] = field(
        default_factory=dict, metadata={"group": "rollout", "help": "", "choices": None, "nargs": None}
    )
    # the Miles / megatron flags with no field of their own (config/compat.py): {name: value given}
    compat_flags: dict[str, Any] = field(
        default_factory=dict, metadata={"group": "cluster", "help": "", "choices": None, "nargs": None}
    )

    def validate(self) -> RunConfig:
        """Derive the unset batch knob and reject contradictions. Returns self."""
        check_run_name(self.run_name)
        check_seeds(self)
        self._check_checkpoint_flags()
        self._normalize_session_server()
        self._check_ranges()
        self._check_model_args()
        derive_batch_knobs(self)
        self._check_debug_flags()
        self._check_perf_flags()
        self._check_optimizer_flags()
        self._check_sampling_flags()
        self._check_eval_flags()
        self._derive_megatron_precision()
        self._check_precision_flags()
        self._check_async_flags()
        self._check_partial_rollout()
        self._check_weight_update_flags()
        for name, why in REFUSED.items():
            if getattr(self, name) != field_default(RunConfig, name):
                raise ConfigError(f"{flag_name(name)} {getattr(self, name)!r}: {why}")
        self._check_cluster_flags()
        self._check_megatron_layout()
        self._check_routing_replay()
        self._check_moe_flags()
        self._check_generate_flags()
        self._check_sft_rollout()
        self._check_chat_template_kwargs()
        self._check_data_source_flags()
        self._check_lora_flags()
        self._check_score_centering()
        self._check_opd_flags()
        self._check_algorithm_flags()
        self._check_logging_flags()
        self._check_hook_flags()
        self._check_vision_flags()
        check_compat_flags(self)
        return self

    def _check_ranges(self) -> None:
        """Every numeric flag in its range (NaN and inf included), with the flag named."""
        check_ranges(self, RANGES)
        check_choices(self)
        for name in ("adam_beta1", "adam_beta2"):
            if getattr(self, name) >= 1:
                raise ConfigError(f"{flag_name(name)} {getattr(self, name)}: must be in [0, 1)")
        if self.rollout_top_k != -1 and self.rollout_top_k < 1:
            raise ConfigError(f"--rollout-top-k {self.rollout_top_k}: must be -1 (off) or >= 1")
        if self.eval_top_k is not None and self.eval_top_k != -1 and self.eval_top_k < 1:
            raise ConfigError(f"--eval-top-k {self.eval_top_k}: must be -1 (off) or >= 1")
        for lo, hi in (("tis_lower_bound", "tis_upper_bound"), ("rs_lower_bound", "rs_upper_bound"),
                       ("tis_clip_low", "tis_clip")):  # fmt: skip
            a, b = getattr(self, lo), getattr(self, hi)
            if a is not None and b is not None and a > b:
                raise ConfigError(f"{flag_name(lo)} {a} > {flag_name(hi)} {b}")

    def miles_flags_taken(self) -> list[str]:
        """The Miles flags of config/compat.py taken with the same result here, each as `--flag: what
        this build does instead` (the run logs them at start)."""
        return accepted_compat_flags(self.compat_flags)

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
            "save_debug_train_data",
            *LOGGING,
            *MODEL_ARGS,  # they describe --hf-checkpoint (checked equal), which is in the hash
            "compat_flags",  # kernel and speed choices with the same result (others are refused)
        }
        payload = {k: v for k, v in self.to_dict().items() if k not in skip}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        clean = {k.replace("-", "_"): v for k, v in data.items()}
        compat = {k: clean.pop(k) for k in list(clean) if k in COMPAT and k not in names}
        if compat:
            clean["compat_flags"] = {**compat, **(clean.get("compat_flags") or {})}
        for alias, name in ALIASES.items():
            if alias in clean:
                if name in clean and clean[name] != clean[alias]:
                    raise ConfigError(
                        f"{flag_name(alias)} and {flag_name(name)} are the same flag with different values"
                    )
                clean[name] = clean.pop(alias)
        unknown = sorted(set(clean) - names)
        if unknown:
            raise ConfigError(
                f"unknown config keys {unknown}; see `miles-platform train --help` for valid flags"
            )
        return cls(**clean)


# The tracker flags: where metrics go, never what is trained (outside config_hash, resumable)
LOGGING = frozenset(f.name for f in dataclasses.fields(RunConfig) if f.metadata["group"] == "logging")
# What a resumed run may change without --allow-config-change: how long it runs, when it saves /
# evaluates / logs, where its processes run, debug and CI switches. Anything else changes what
# is trained (data, model, algorithm, batch, optimizer, sampling, precision, weight transport).
RESUMABLE = frozenset(
    {"ray_address", "actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus", "rollout_num_gpus_per_engine",
     "colocate", "num_cpus_per_actor", "pin_trainer_cpus", "rollout_engine", "rollout_external_engine_addrs", "sglang_router_port",
     "use_fault_tolerance", "rollout_health_check_interval", "rollout_health_check_timeout",
     "rollout_health_check_first_wait", "pause_wait_timeout_s", "pause_max_queued_requests", "api_key", "api_key_file", "allow_config_change", "object_store_backend", "mooncake_store_init_kwargs",
     "load", "save", "save_interval", "no_save_optim", "no_load_optim", "no_load_rng", "async_save",
     "save_trigger_sentinel", "use_checkpoint_lr_scheduler", "override_lr_scheduler", "save_retain_interval", "save_hf", "train_env_vars", "distributed_timeout_minutes", "num_rollout", "num_epoch", "rollout_max_concurrency",
     "eval_prompt_data", "eval_interval", "eval_input_key", "n_samples_per_eval_prompt", "eval_max_response_len",
     "eval_temperature", "eval_top_p", "eval_top_k", "eval_reward_key", "skip_eval_before_train",
     "update_weight_disk_dir", "update_weight_local_checkpoint_dir", "custom_update_weight_post_write_path",
     "disk_delta_encode_workers", "check_weight_update_equal", "check_lora_weight_equal", "storage_root", "save_debug_rollout_data", "save_debug_train_data",
     "ci_test", "ci_logprob_abs_diff_threshold", "ci_fault_hooks", "ci_disable_weight_update_checker",
     "ci_disable_kl_checker", "ci_disable_logprobs_checker", "ci_entropy_max", "ci_metric_checker_key",
     "ci_metric_checker_threshold", "ci_metric_checker_expect_num", "ci_save_grad_norm", "ci_load_grad_norm",
     "ci_save_model_hash", "ci_check_model_hash", "observe_training_entropy", "use_rollout_entropy",
     "log_interval", "sglang_args", "compat_flags",
     "max_nonfinite_steps", "train_timeout_s", "custom_generate_function_timeout"} | LOGGING | set(MODEL_ARGS)
)  # fmt: skip


# the schedule's values: a resume with --override-lr-scheduler may change them (the flag's purpose)
LR_SCHEDULE = frozenset(
    {"lr", "min_lr", "lr_warmup_init", "lr_warmup_iters", "lr_warmup_fraction", "lr_decay_iters", "lr_decay_style",
     "lr_wsd_decay_iters", "lr_wsd_decay_style"}
)  # fmt: skip


def config_changes(saved: dict, now, resumable: frozenset[str] = RESUMABLE) -> list[str]:
    """The flags that differ from a saved run's config in what is trained, as `--flag old -> new`
    (`now`: a RunConfig or a DiffusionRunConfig with its own `resumable` set)."""
    cur = json.loads(json.dumps(now.to_dict(), default=str))
    if getattr(now, "override_lr_scheduler", False):
        resumable = resumable | LR_SCHEDULE
    return [
        f"{flag_name(k)} {saved[k]!r} -> {cur[k]!r}"
        for k in sorted(cur)
        if k in saved and k not in resumable and saved[k] != cur[k]
    ]


def saved_config(cfg) -> str:
    """The config a checkpoint dir records (`run_config.json`), without the secret."""
    d = {k: v for k, v in cfg.to_dict().items() if k not in ("api_key", "wandb_key")}
    return json.dumps(d, default=str, sort_keys=True, indent=1)
