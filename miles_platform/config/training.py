"""How the trainer trains: optimizer and LR schedule, micro-batching and parallelism, and the
precision of the trainer's forward, gradients and optimizer (which the engine's must match)."""

from __future__ import annotations

from dataclasses import dataclass

from miles_platform.config.flags import NON_NEGATIVE, POSITIVE, flag
from miles_platform.errors import ConfigError

RANGES: dict[str, tuple] = {
    **dict.fromkeys(("lr_decay_iters", "micro_batch_size", "max_tokens_per_gpu"), POSITIVE),
    **dict.fromkeys(("lr_warmup_iters", "lr", "min_lr", "weight_decay", "lr_warmup_init"), NON_NEGATIVE),
    "lr_wsd_decay_iters": POSITIVE,
    "lr_warmup_fraction": (0, 1, False, "in [0, 1]"),
    "adam_beta1": (0, 1, False, "in [0, 1)"),
    "adam_beta2": (0, 1, False, "in [0, 1)"),
    "adam_eps": (0, None, True, "> 0"),
    "clip_grad": (0, None, True, "> 0"),
}

# Miles flags this build does not implement. Set to anything but the default they are an error, never
# silently ignored (tests/unit/config/test_config_flags.py fails on any field that nothing reads and nothing refuses).
REFUSED: dict[str, str] = {}


@dataclass
class OptimizerFlags:
    optimizer: str = flag("adam", "optimizer", "optimizer", choices=("adam", "sgd"))
    lr: float = flag(
        1e-6, "optimizer", "learning rate (fit to model size: 1e-6 is for billion-parameter models)"
    )
    lr_decay_style: str = flag(
        "constant",
        "optimizer",
        "schedule after warmup (megatron-core's formulas; training/schedule.py)",
        choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    )
    lr_warmup_iters: int = flag(0, "optimizer", "warmup steps")
    lr_warmup_init: float = flag(0.0, "optimizer", "lr at the start of warmup (warmup goes from it to --lr)")
    lr_warmup_fraction: float | None = flag(
        None,
        "optimizer",
        "warmup steps as a fraction of the decay steps (megatron's; instead of --lr-warmup-iters)",
    )
    lr_decay_iters: int | None = flag(None, "optimizer", "decay steps (defaults to total steps)")
    min_lr: float = flag(0.0, "optimizer", "lower LR bound for decay")
    lr_wsd_decay_iters: int | None = flag(
        None, "optimizer", "--lr-decay-style WSD: the annealing steps at the end of --lr-decay-iters"
    )
    lr_wsd_decay_style: str = flag(
        "exponential",
        "optimizer",
        "--lr-decay-style WSD: the annealing shape",
        choices=("exponential", "linear", "cosine", "minus_sqrt"),
    )
    use_checkpoint_lr_scheduler: bool = flag(
        False, "optimizer", "resume: keep the checkpoint's schedule values (lr, warmup, decay) over the flags"
    )
    override_lr_scheduler: bool = flag(
        False,
        "optimizer",
        "resume: take the flags' schedule values over the checkpoint's (the step count stays; implied by "
        "--allow-config-change unless --use-checkpoint-lr-scheduler is given)",
    )
    weight_decay: float = flag(0.1, "optimizer", "decoupled weight decay")
    adam_beta1: float = flag(0.9, "optimizer", "Adam beta1")
    adam_beta2: float = flag(0.98, "optimizer", "Adam beta2")
    adam_eps: float = flag(1e-8, "optimizer", "Adam epsilon")
    clip_grad: float = flag(1.0, "optimizer", "grad-norm clip")

    def _check_optimizer_flags(self) -> None:
        if self.lr_warmup_fraction is not None and self.lr_warmup_iters:
            raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters: give one (megatron takes one too)")
        if self.use_checkpoint_lr_scheduler and self.override_lr_scheduler:
            raise ConfigError(
                "--override-lr-scheduler and --use-checkpoint-lr-scheduler: give one (megatron's rule)"
            )
        if self.lr_decay_style == "WSD" and not self.lr_wsd_decay_iters:
            raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters (the annealing steps)")
        if self.lr_wsd_decay_iters and self.lr_decay_style != "WSD":
            raise ConfigError(
                f"--lr-wsd-decay-iters: only --lr-decay-style WSD anneals; it has no effect with {self.lr_decay_style}"
            )
        if self.lr_warmup_init and not (self.lr_warmup_iters or self.lr_warmup_fraction):
            raise ConfigError(
                "--lr-warmup-init: no effect without warmup (--lr-warmup-iters or --lr-warmup-fraction)"
            )
        decay = self.lr_decay_iters or (
            self.num_rollout * self.num_steps_per_rollout
            if self.num_rollout and self.num_steps_per_rollout
            else None
        )
        if decay:  # the schedule's own checks (WSD within the decay, warmup before it), before Ray starts
            from miles_platform.training.schedule import schedule_of

            schedule_of(self, decay)
        if self.lr_wsd_decay_iters and decay and self.lr_wsd_decay_iters > decay:
            raise ConfigError(f"--lr-wsd-decay-iters {self.lr_wsd_decay_iters} > the decay steps {decay}")


@dataclass
class PerfFlags:
    micro_batch_size: int = flag(1, "perf", "samples per micro-batch (ignored with dynamic batching)")
    use_dynamic_batch_size: bool = flag(
        False, "perf", "pack varlen samples into micro-batches by token budget"
    )
    max_tokens_per_gpu: int | None = flag(
        None, "perf", "token budget per micro-batch (required with dynamic batching)"
    )
    # megatron model parallelism (the rest of the layout: config/megatron.py; docs/megatron.md)
    tensor_model_parallel_size: int = flag(
        1, "perf", "megatron TP: each layer's matrices split over this many ranks"
    )
    pipeline_model_parallel_size: int = flag(
        1, "perf", "megatron PP: layers split into this many stages (1F1B)"
    )
    context_parallel_size: int = flag(
        1,
        "perf",
        "megatron CP: each sample's tokens split over N ranks (zigzag chunks), attention over gathered K/V",
    )
    expert_model_parallel_size: int = flag(1, "perf", "megatron EP: MoE experts split over this many ranks")
    gradient_checkpointing: bool = flag(False, "perf", "activation recompute (FSDP)")
    deterministic_mode: bool = flag(
        False, "perf", "deterministic kernels in the trainer (torch.use_deterministic_algorithms, and "
        "CUBLAS_WORKSPACE_CONFIG on GPU): same inputs, same gradients bit for bit"
    )  # fmt: skip

    def _check_perf_flags(self) -> None:
        if self.use_dynamic_batch_size and not self.max_tokens_per_gpu:
            raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu")


@dataclass
class PrecisionFlags:
    fsdp_master_dtype: str = flag(
        "fp32", "precision", "dtype the optimizer steps on", choices=("fp32", "bf16")
    )
    train_forward_dtype: str | None = flag(
        None,
        "precision",
        "autocast / gather dtype of the trainer forward (default: --rollout-dtype when given, else bf16 "
        "on CUDA with --train-backend fsdp, fp32 on the CPU and with megatron)",
        choices=("fp32", "bf16", "fp16"),
    )
    fsdp_reduce_dtype: str = flag(
        "fp32", "precision", "gradient reduce-scatter dtype", choices=("fp32", "bf16")
    )
    fsdp_precision_rules: str | None = flag(
        None, "precision", "per-module/param rules, e.g. 'module:*norm*=fp32;param:lm_head.weight=fp32'"
    )
    rollout_dtype: str | None = flag(
        None,
        "precision",
        "engine serving dtype; must equal --train-forward-dtype (default: --train-forward-dtype when "
        "given, else bf16 on CUDA with --train-backend fsdp, fp32 on the CPU and with megatron)",
        choices=("fp32", "bf16", "fp16"),
    )

    def _check_precision_flags(self) -> None:
        if self.train_forward_dtype and self.rollout_dtype and self.train_forward_dtype != self.rollout_dtype:
            raise ConfigError(
                f"--train-forward-dtype {self.train_forward_dtype} != --rollout-dtype {self.rollout_dtype}: "
                "the trainer must see the same forward as the engine (PPO ratio would be rounding noise)"
            )
        if self.train_backend == "megatron":
            # the fsdp backend's precision and recompute flags; megatron has Megatron's (--bf16, ...)
            forward = "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"
            unsupported = [
                (
                    f"--train-forward-dtype {self.train_forward_dtype}",
                    self.train_forward_dtype not in (None, forward),
                ),
                (f"--fsdp-master-dtype {self.fsdp_master_dtype}", self.fsdp_master_dtype != "fp32"),
                (f"--fsdp-reduce-dtype {self.fsdp_reduce_dtype}", self.fsdp_reduce_dtype != "fp32"),
                ("--fsdp-precision-rules", bool(self.fsdp_precision_rules)),
                ("--gradient-checkpointing", self.gradient_checkpointing),
            ]
            bad = [name for name, on in unsupported if on]
            if bad:
                raise ConfigError(
                    f"{', '.join(bad)}: not supported by --train-backend megatron, which takes Megatron's flags: "
                    "--bf16 / --fp16 (bf16 / fp16 forward, fp32 main parameters; the forward dtype follows it), "
                    "--accumulate-allreduce-grads-in-fp32, --recompute-granularity full|selective"
                )
