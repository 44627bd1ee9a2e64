"""DiffusionRunConfig: the flags of `miles-platform train-diffusion`, Miles-diffusion's names and defaults.

Miles-diffusion is its own entry point (`train_diffusion.py`) with its own flag set; so is this one.
Shared knobs (batch sizes, optimizer, storage, checkpoints) keep the LLM side's names. Defaults
follow the Miles-diffusion CLI reference except where the CPU tiny DiT needs otherwise; those
say so in their help. Every flag is honoured or refused at parse time, before Ray starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from typing import Any

from miles_platform.config import check_run_name, check_seeds, derive_batch_knobs
from miles_platform.config.flags import add_flag, changed_flags, flag, flag_name, load_yaml, parser_groups
from miles_platform.errors import ConfigError

GROUPS = ("cluster", "checkpoint", "rollout", "sampling", "reward", "eval", "algorithm", "optimizer",
          "precision", "storage", "logging", "debug")  # fmt: skip
SDE_TYPES = ("sde", "cps", "ode")
# the --ci-fault-hooks (fault_hooks.py's names) the diffusion loop fires, in its order; it has no
# engine pause (weight_update_paused) and no trainer ranks of its own (the rank hooks)
DIFFUSION_HOOKS = (
    "orchestrator_step_start", "rollout_end", "trainer_controller_step_start", "trainer_controller_step_end",
    "weight_update_start", "weight_update_prepared", "weight_update_activated", "version_recorded",
    "eval_start", "metrics_recorded", "save_start", "save_end", "orchestrator_step_end",
)  # fmt: skip
LOSS_TYPES = ("policy_loss", "nft")
DTYPE_CHOICES = ("fp32", "bf16", "fp16")
SDE_WINDOW = "miles.rollout.step_strategy_hub.sde_window"  # Miles' dotted names map to ours
STEP_STRATEGIES = {
    SDE_WINDOW: "miles_platform.diffusion.step_strategy.sde_window",
    "miles.rollout.step_strategy_hub.epoch_global_random_choice":
        "miles_platform.diffusion.step_strategy.epoch_global_random_choice",
    "sde_window": "miles_platform.diffusion.step_strategy.sde_window",
    "epoch_global_random_choice": "miles_platform.diffusion.step_strategy.epoch_global_random_choice",
}  # fmt: skip
NFT_STRATEGIES = {
    "drop_random_steps": "miles_platform.diffusion.step_strategy.drop_random_steps",
    "drop_final_steps": "miles_platform.diffusion.step_strategy.drop_final_steps",
}

# what a resumed run may change without --allow-config-change (as `train`'s config.RESUMABLE):
# how long it runs, when it saves / evaluates / logs, where it runs, the secret, CI switches
RESUMABLE = frozenset(
    {"ray_address", "save", "save_interval", "load", "no_save_optim", "no_load_optim", "allow_config_change",
     "num_rollout", "num_epoch", "eval_prompt_data", "eval_interval", "n_samples_per_eval_prompt",
     "diffusion_eval_num_steps", "skip_eval_before_train", "storage_root", "api_key", "log_interval", "ci_test",
     "ci_fault_hooks"}
)  # fmt: skip


@dataclass
class DiffusionRunConfig:
    # --- cluster ---
    ray_address: str | None = flag(
        None, "cluster", "join an existing Ray cluster (else RAY_ADDRESS, else local)"
    )
    # --- checkpoint ---
    hf_checkpoint: str | None = flag(None, "checkpoint", "the DiT pipeline dir to train and serve (required)")
    diffusion_task: str | None = flag(None, "checkpoint", "task of the family (required)", choices=("t2i",))
    diffusion_model_family: str | None = flag(
        None, "checkpoint", "family key (else read from model_index.json)", choices=("tiny_dit",)
    )
    save: str | None = flag(
        None, "checkpoint", "checkpoint dir (iter_NNNNNNN + latest_checkpointed_iteration.txt)"
    )
    save_interval: int | None = flag(None, "checkpoint", "save every N rollouts (and at the end)")
    load: str | None = flag(None, "checkpoint", "resume from this checkpoint dir (default: --save)")
    no_save_optim: bool = flag(False, "checkpoint", "skip AdamW state in checkpoints")
    allow_config_change: bool = flag(
        False, "checkpoint", "resume a run whose saved config differs in what is trained (logged)"
    )
    no_load_optim: bool = flag(False, "checkpoint", "resume with a fresh optimizer")
    # --- rollout ---
    prompt_data: str | None = flag(None, "rollout", "JSONL/Parquet prompts (required)")
    input_key: str = flag("prompt", "rollout", "prompt field")
    rollout_batch_size: int | None = flag(None, "rollout", "prompts per rollout (required)")
    n_samples_per_prompt: int = flag(1, "rollout", "samples per prompt (GRPO group size)")
    global_batch_size: int | None = flag(None, "rollout", "trajectories per optimizer step (derived)")
    num_steps_per_rollout: int | None = flag(None, "rollout", "optimizer steps per rollout (derived)")
    micro_batch_size: int = flag(1, "rollout", "train pairs per DiT forward")
    num_rollout: int | None = flag(None, "rollout", "rollout iterations (or --num-epoch)")
    num_epoch: int | None = flag(None, "rollout", "epochs over --prompt-data (ignored with --num-rollout)")
    rollout_seed: int = flag(42, "rollout", "seed of the prompt order and the per-sample noise")
    rollout_shuffle: bool = flag(False, "rollout", "shuffle prompts once per epoch")
    rollout_microgroup_size: int = flag(1, "rollout", "samples of one prompt per engine request")
    # --- sampling (engine stepping; the trainer reads the recorded trajectory) ---
    diffusion_num_steps: int = flag(10, "sampling", "denoising steps per sample")
    diffusion_noise_level: float = flag(0.7, "sampling", "eta of the SDE kernel")
    diffusion_sde_type: str = flag("sde", "sampling", "dynamics family (selects the train-side backend)",
                                 choices=SDE_TYPES)  # fmt: skip
    sde_step_backend_path: str | None = flag(None, "sampling", "custom SdeStepBackend subclass (dotted path)")
    diffusion_num_sde_steps: int = flag(0, "sampling", "steps the step strategy scores")
    diffusion_sde_window_range: str | None = flag(None, "sampling", "lo,hi window for sde_window")
    diffusion_sde_candidate_steps: str | None = flag(None, "sampling", "1,2,3 for epoch_global_random_choice")
    diffusion_step_strategy_path: str | None = flag(
        None,
        "sampling",
        "which steps enter training (sde_window, epoch_global_random_choice or a dotted path)",
    )
    diffusion_log_prob_no_const: bool = flag(
        False, "sampling", "drop log-prob constants (forced for cps/ode)"
    )
    diffusion_flow_shift: float | None = flag(
        None, "sampling", "generation schedule shift (else the pipeline's)"
    )
    diffusion_guidance_scale: float = flag(
        1.0, "sampling", "CFG scale (Miles default 4.0; the tiny DiT is trained without CFG: only 1.0)"
    )
    diffusion_height: int | None = flag(None, "sampling", "output height (must be the DiT's sample size)")
    diffusion_width: int | None = flag(None, "sampling", "output width (must be the DiT's sample size)")
    rollout_return_full_trajectory: bool = flag(
        False, "sampling", "record every step, not only the trained ones"
    )
    diffusion_debug_mode: bool = flag(
        False, "sampling", "engine returns per-step noise_pred: model_output_* metrics"
    )
    sglang_dit_precision: str = flag(
        "fp32",
        "sampling",
        "the engine's DiT precision (Miles default bf16; fp32 on CPU)",
        choices=DTYPE_CHOICES,
    )
    # --- reward ---
    rm_type: str = flag("image_attributes", "reward", "built-in reward", choices=("image_attributes",))
    custom_rm_path: str | None = flag(
        None, "reward", "async def rm(args, samples) -> list[float] (replaces --rm-type)"
    )
    # --- eval ---
    eval_prompt_data: list[str] = flag([], "eval", "`name path` pairs", nargs="*")
    eval_interval: int | None = flag(None, "eval", "evaluate every N rollouts")
    n_samples_per_eval_prompt: int = flag(1, "eval", "samples per eval prompt")
    diffusion_eval_num_steps: int | None = flag(
        None, "eval", "denoising steps at eval (else --diffusion-num-steps)"
    )
    skip_eval_before_train: bool = flag(False, "eval", "do not evaluate v0")
    # --- algorithm ---
    loss_type: str = flag("policy_loss", "algorithm", "policy_loss (Flow-GRPO) or nft", choices=LOSS_TYPES)
    advantage_estimator: str = flag("grpo", "algorithm", "advantage estimator", choices=("grpo",))
    disable_grpo_std_normalization: bool = flag(False, "algorithm", "subtract the group mean only")
    globalize_reward_mean: bool = flag(False, "algorithm", "batch-wide mean instead of per prompt")
    globalize_reward_std: bool = flag(False, "algorithm", "batch-wide std instead of per group")
    diffusion_clip_range: float = flag(1e-4, "algorithm", "PPO ratio clip")
    diffusion_adv_clip_max: float = flag(
        5.0, "algorithm", "advantage clamp (nft: also the advantage-to-r slope)"
    )
    diffusion_recompute_old_log_prob: bool = flag(
        False, "algorithm", "old log-probs from the trainer's forward instead of the rollout's"
    )
    diffusion_kl_beta: float = flag(0.0, "algorithm", "KL to the base model (> 0 runs a reference forward)")
    diffusion_nft_beta: float = flag(1.0, "algorithm", "NFT beta")
    diffusion_nft_timestep_strategy_path: str = flag("drop_random_steps", "algorithm", "NFT training steps")
    diffusion_nft_num_dropped_timesteps: int = flag(0, "algorithm", "steps the NFT strategies drop")
    no_diffusion_nft_adaptive_weight: bool = flag(False, "algorithm", "NFT without the adaptive x0 weight")
    use_ema: bool = flag(False, "algorithm", "keep an EMA copy as pi_old (nft needs it)")
    rollout_weights: str = flag("actor", "algorithm", "weights pushed to rollout", choices=("actor", "ema"))
    ema_decay_init: float = flag(0.001, "algorithm", "EMA decay in the flat period")
    ema_decay_ramp: float = flag(0.001, "algorithm", "EMA decay increase per optimizer step after it")
    ema_decay_max: float = flag(0.5, "algorithm", "EMA decay ceiling")
    ema_decay_flat_steps: int = flag(0, "algorithm", "optimizer steps of the flat period")
    # --- optimizer ---
    lr: float = flag(1e-6, "optimizer", "learning rate")
    adam_beta1: float = flag(0.9, "optimizer", "AdamW beta1")
    adam_beta2: float = flag(0.999, "optimizer", "AdamW beta2 (flow_grpo's)")
    adam_eps: float = flag(1e-8, "optimizer", "AdamW eps")
    weight_decay: float = flag(0.0, "optimizer", "AdamW weight decay")
    clip_grad: float = flag(1.0, "optimizer", "gradient norm clip")
    seed: int = flag(1234, "optimizer", "trainer seed (NFT noise)")
    # --- precision (the dtype-control contract) ---
    fsdp_master_dtype: str = flag(
        "fp32", "precision", "master weights + optimizer state", choices=DTYPE_CHOICES
    )
    fsdp_reduce_dtype: str = flag("fp32", "precision", "gradient reduce dtype", choices=DTYPE_CHOICES)
    diffusion_forward_dtype: str = flag(
        "fp32", "precision", "trainer DiT compute (Miles default bf16; must equal --sglang-dit-precision)",
        choices=DTYPE_CHOICES,
    )  # fmt: skip
    fsdp_precision_rules: str | None = flag(
        None, "precision", "extra gather rules: 'glob=dtype,...' (later wins)"
    )
    # --- storage ---
    storage_root: str = flag(".miles", "storage", "root of rollouts, runs, tables, catalog")
    run_name: str = flag("diffusion", "storage", "run name (partition keys <run>.vNNNNNN)")
    api_key: str | None = flag(
        None, "storage", "secret of the run's engine endpoints (else MILES_API_KEY, else random)"
    )
    # --- logging ---
    log_interval: int = flag(1, "logging", "print metrics every N rollouts")
    # --- debug ---
    debug_rollout_only: bool = flag(False, "debug", "rollout, no training")
    debug_skip_optimizer_step: bool = flag(False, "debug", "no optimizer step: weights never drift")
    ci_test: bool = flag(False, "debug", "assert the step-0 train/rollout contract (ratio 1)")
    ci_fault_hooks: str | None = flag(
        None,
        "debug",
        "JSON array of fault requests ({hook_name, action: {kind}, rollout_id}), as `train`'s; "
        "the hooks this loop fires: miles_platform/diffusion/loop.py DIFFUSION_HOOKS",
    )

    # what shared store code reads of a RunConfig
    lora_rank: int = dataclasses.field(default=0, init=False, repr=False, metadata={"internal": True})

    @property
    def uses_lora(self) -> bool:  # as RunConfig.uses_lora, for the shared store code (always False)
        return self.lora_rank > 0

    def validate(self) -> DiffusionRunConfig:
        check_run_name(self.run_name)
        check_seeds(self)
        for name in ("hf_checkpoint", "diffusion_task", "prompt_data", "rollout_batch_size"):
            if getattr(self, name) in (None, ""):
                raise ConfigError(f"{flag_name(name)} is required")
        for name in ("n_samples_per_prompt", "micro_batch_size", "rollout_microgroup_size", "diffusion_num_steps",
                     "n_samples_per_eval_prompt", "log_interval"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag_name(name)} {getattr(self, name)}: must be >= 1")
        for name in (
            "num_rollout",
            "num_epoch",
            "save_interval",
            "eval_interval",
            "diffusion_eval_num_steps",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{flag_name(name)} {getattr(self, name)}: must be >= 1")
        if self.num_rollout is None and self.num_epoch is None:
            raise ConfigError("set --num-rollout or --num-epoch")
        derive_batch_knobs(self)
        self._check_numbers()
        self._check_algorithm()
        self._check_precision()
        if self.save_interval and not self.save:
            raise ConfigError("--save-interval needs --save")
        if len(self.eval_prompt_data) % 2:
            raise ConfigError(f"--eval-prompt-data takes `name path` pairs, got {self.eval_prompt_data}")
        if self.eval_interval and not self.eval_prompt_data:
            raise ConfigError("--eval-interval needs --eval-prompt-data")
        if self.diffusion_guidance_scale != 1.0:
            raise ConfigError(
                f"--diffusion-guidance-scale {self.diffusion_guidance_scale}: the tiny DiT family is trained "
                "without classifier-free guidance (no unconditional branch); only 1.0"
            )
        self._check_fault_hooks()
        if self.debug_rollout_only and self.debug_skip_optimizer_step:
            raise ConfigError(
                "--debug-rollout-only and --debug-skip-optimizer-step: the first trains nothing"
            )
        return self

    def _check_fault_hooks(self) -> None:
        from miles_platform.fault_hooks import parse_fault_hooks

        for i, r in enumerate(parse_fault_hooks(self.ci_fault_hooks)):
            if r.hook_name not in DIFFUSION_HOOKS:
                raise ConfigError(
                    f"--ci-fault-hooks entry {i}: hook_name {r.hook_name!r} is never reached by train-diffusion "
                    f"(no trainer ranks, no weight transport); choose one of {', '.join(DIFFUSION_HOOKS)}"
                )

    def _check_numbers(self) -> None:
        import math

        for name in ("diffusion_noise_level", "diffusion_clip_range", "diffusion_adv_clip_max", "lr",
                     "diffusion_nft_beta", "clip_grad"):  # fmt: skip
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{flag_name(name)} {v}: must be a finite number > 0")
        for name in ("diffusion_kl_beta", "weight_decay", "adam_eps", "ema_decay_init", "ema_decay_ramp"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"{flag_name(name)} {v}: must be a finite number >= 0")
        if not 0 <= self.ema_decay_max < 1:
            raise ConfigError(f"--ema-decay-max {self.ema_decay_max}: must be in [0, 1)")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{flag_name(name)} {getattr(self, name)}: must be in [0, 1)")
        if self.diffusion_sde_type == "sde" and self.diffusion_noise_level > 1.5:
            raise ConfigError(
                f"--diffusion-noise-level {self.diffusion_noise_level}: the Flow-SDE eta is <= 1.5"
            )

    def _check_algorithm(self) -> None:
        grpo = self.loss_type == "policy_loss"
        if grpo and self.diffusion_sde_type == "ode" and not self.sde_step_backend_path:
            raise ConfigError(
                "--loss-type policy_loss with --diffusion-sde-type ode: Flow-GRPO needs stochastic transitions "
                "(use sde or cps, or --loss-type nft)"
            )
        if grpo and not self.diffusion_step_strategy_path:
            raise ConfigError(
                "--loss-type policy_loss needs --diffusion-step-strategy-path (e.g. sde_window with "
                "--diffusion-num-sde-steps N): it picks the transitions Flow-GRPO trains on"
            )
        if self.diffusion_step_strategy_path in (SDE_WINDOW, "sde_window") or (
            self.diffusion_step_strategy_path and "epoch_global" in self.diffusion_step_strategy_path
        ):
            if self.diffusion_num_sde_steps < 1 and "epoch_global" not in self.diffusion_step_strategy_path:
                raise ConfigError(
                    "--diffusion-step-strategy-path sde_window needs --diffusion-num-sde-steps >= 1"
                )
        if self.diffusion_sde_type in ("cps", "ode"):
            self.diffusion_log_prob_no_const = True  # forced, as in Miles
        if self.loss_type == "nft":
            if not (self.use_ema and self.rollout_weights == "ema"):
                raise ConfigError(
                    "--loss-type nft trains against the EMA: set --use-ema and --rollout-weights ema"
                )
            if self.diffusion_recompute_old_log_prob:
                raise ConfigError("--diffusion-recompute-old-log-prob: read by --loss-type policy_loss only")
        else:
            nft_given = changed_flags(
                self, ("diffusion_nft_num_dropped_timesteps", "no_diffusion_nft_adaptive_weight")
            )
            if nft_given or self.diffusion_nft_beta != 1.0:
                raise ConfigError(
                    f"{', '.join(nft_given) or '--diffusion-nft-beta'}: read by --loss-type nft only"
                )
        if self.rollout_weights == "ema" and not self.use_ema:
            raise ConfigError("--rollout-weights ema needs --use-ema")
        if self.use_ema and self.rollout_weights != "ema":
            raise ConfigError("--use-ema needs a consumer: --rollout-weights ema (or --loss-type nft)")
        if self.diffusion_nft_num_dropped_timesteps >= self.diffusion_num_steps:
            raise ConfigError(
                f"--diffusion-nft-num-dropped-timesteps {self.diffusion_nft_num_dropped_timesteps} leaves no "
                f"step of --diffusion-num-steps {self.diffusion_num_steps}"
            )

    def _check_precision(self) -> None:
        from miles_platform.training.precision import parse_precision_rules

        if self.diffusion_forward_dtype != self.sglang_dit_precision:
            raise ConfigError(
                f"--diffusion-forward-dtype {self.diffusion_forward_dtype} != --sglang-dit-precision "
                f"{self.sglang_dit_precision}: the trainer must run the engine's DiT forward, or the PPO ratio "
                "is rounding noise (set both to the same value)"
            )
        parse_precision_rules(self.fsdp_precision_rules)

    # ------------------------------------------------------------------
    def resolve_api_key(self) -> str:
        if not self.api_key:
            self.api_key = os.environ.get("MILES_API_KEY") or secrets.token_urlsafe(32)
        return self.api_key

    def eval_datasets(self) -> list[tuple[str, str]]:
        it = iter(self.eval_prompt_data)
        return list(zip(it, it))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def config_hash(self) -> str:
        skip = {"save", "load", "storage_root", "log_interval", "ray_address", "api_key", "run_name",
                "ci_fault_hooks"}  # fmt: skip
        payload = {k: v for k, v in self.to_dict().items() if k not in skip}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DiffusionRunConfig:
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        clean = {k.replace("-", "_"): v for k, v in data.items()}
        unknown = sorted(set(clean) - names)
        if unknown:
            raise ConfigError(
                f"unknown config keys {unknown}; see `miles-platform train-diffusion --help` for valid flags"
            )
        return cls(**clean)


def build_parser(prog: str = "miles-platform train-diffusion") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog=prog, description="Diffusion RL (Flow-GRPO, DiffusionNFT) on a DiT."
    )
    parser.add_argument("--config", help="YAML file of flags; CLI overrides it")
    groups = parser_groups(parser, GROUPS)
    for f in dataclasses.fields(DiffusionRunConfig):
        if f.init:
            add_flag(groups[f.metadata["group"]], f, argparse.SUPPRESS)
    return parser


def parse_diffusion_config(argv: list[str] | None = None) -> DiffusionRunConfig:
    """CLI flags (YAML via --config first, CLI overrides) into a validated DiffusionRunConfig."""
    args = build_parser().parse_args(argv)
    data: dict[str, Any] = {}
    if getattr(args, "config", None):
        data.update({k.replace("-", "_"): v for k, v in load_yaml(args.config, DiffusionRunConfig).items()})
    data.update({k: v for k, v in vars(args).items() if k != "config"})
    return DiffusionRunConfig.from_dict(data).validate()
