"""Megatron as Miles runs it (docs/megatron.md): the model-parallel layout beyond TP / PP / CP / EP
sizes (PerfFlags), bucketed weight updates, and Megatron-LM's precision and memory flags, with the
checks that need no checkpoint (the model's shapes: preflight, `training.megatron_parallel`).

Data parallel = trainer ranks / (TP x PP x CP). What megatron-core cannot run here is refused by
name with the reason measured on CPU with megatron-core 0.16 (`REFUSED`)."""

from __future__ import annotations

from dataclasses import dataclass

from miles_platform.config.flags import POSITIVE, changed_flags, flag, flag_name
from miles_platform.errors import ConfigError

RANGES: dict[str, tuple] = dict.fromkeys(
    ("num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
     "decoder_last_pipeline_num_layers", "expert_tensor_parallel_size", "update_weight_buffer_size",
     "recompute_num_layers"),
    POSITIVE,
) | {
    "loss_scale": (0, None, True, "> 0"), "initial_loss_scale": (0, None, True, "> 0"),
    "min_loss_scale": (0, None, True, "> 0"), "loss_scale_window": POSITIVE, "hysteresis": POSITIVE,
}  # fmt: skip

REFUSED: dict[str, str] = {}

LAYOUT = ("tensor_model_parallel_size", "sequence_parallel", "pipeline_model_parallel_size", "context_parallel_size",
          "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
          "decoder_last_pipeline_num_layers", "expert_model_parallel_size", "expert_tensor_parallel_size")  # fmt: skip
# --fp16's loss scaling (megatron-core's grad scaler; training/megatron_precision.py)
LOSS_SCALE = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
PRECISION = ("bf16", *LOSS_SCALE, "accumulate_allreduce_grads_in_fp32", "attention_softmax_in_fp32",
             "recompute_granularity", "recompute_method", "recompute_num_layers")  # fmt: skip


@dataclass
class MegatronFlags:
    sequence_parallel: bool = flag(
        False,
        "perf",
        "megatron SP: norms and residuals split the sequence over the TP ranks (no effect at TP 1)",
    )
    num_layers_per_virtual_pipeline_stage: int | None = flag(
        None, "perf", "interleaved PP: layers per virtual pipeline stage (each stage holds several chunks)"
    )
    decoder_first_pipeline_num_layers: int | None = flag(None, "perf", "uneven PP: layers of the first stage")
    decoder_last_pipeline_num_layers: int | None = flag(None, "perf", "uneven PP: layers of the last stage")
    expert_tensor_parallel_size: int | None = flag(
        None, "perf", "megatron ETP: TP of the MoE experts (default TP)"
    )
    update_weight_buffer_size: int = flag(
        512 * 1024**2, "weight-update", "bytes of full (gathered) weights per weight-update bucket (megatron)"
    )
    bf16: bool = flag(
        False, "precision", "megatron: bf16 parameters and forward, fp32 main parameters for the optimizer "
        "(sets --train-forward-dtype and --rollout-dtype to bf16 when they are not given)",
    )  # fmt: skip
    fp16: bool = flag(
        False, "precision", "fp16 parameters and forward; megatron: fp32 main parameters and loss scaling "
        "(sets --train-forward-dtype and --rollout-dtype to fp16 when they are not given)",
    )  # fmt: skip
    loss_scale: float | None = flag(
        None,
        "precision",
        "megatron --fp16: a constant loss scale (megatron's ConstantGradScaler); unset: dynamic",
    )
    initial_loss_scale: float = flag(2.0**32, "precision", "megatron --fp16: the dynamic loss scale's start")
    min_loss_scale: float = flag(1.0, "precision", "megatron --fp16: the dynamic loss scale's floor")
    loss_scale_window: int = flag(
        1000, "precision", "megatron --fp16: steps without an overflow before the dynamic loss scale doubles"
    )
    hysteresis: int = flag(
        2, "precision", "megatron --fp16: overflows in a row before the dynamic loss scale halves"
    )
    accumulate_allreduce_grads_in_fp32: bool = flag(
        False,
        "precision",
        "megatron: accumulate and all-reduce gradients in fp32 (main_grad buffers) under --bf16",
    )
    attention_softmax_in_fp32: bool = flag(
        False, "precision", "megatron: attention softmax in fp32 under --bf16"
    )
    use_distributed_optimizer: bool = flag(
        False, "perf", "megatron: shard optimizer state over data-parallel ranks"
    )
    optimizer_cpu_offload: bool = flag(
        False, "perf", "megatron --use-distributed-optimizer: optimizer state and step on the host "
        "(megatron-core's HybridDeviceOptimizer)",
    )  # fmt: skip
    overlap_cpu_optimizer_d2h_h2d: bool = flag(
        False, "perf", "--optimizer-cpu-offload: one host optimizer per parameter, its copies on their own "
        "CUDA streams, overlapping the step",
    )  # fmt: skip
    use_precision_aware_optimizer: bool = flag(
        False, "perf", "megatron --optimizer-cpu-offload: the fp32 master parameters live in the host optimizer "
        "only (megatron-core's HybridDeviceOptimizer with param_update_in_fp32); without offload TE's FusedAdam",
    )  # fmt: skip
    recompute_granularity: str | None = flag(
        None, "perf", "megatron activation recompute: full layers or selective (attention core)",
        choices=("full", "selective"),
    )  # fmt: skip
    recompute_method: str | None = flag(
        None, "perf", "full recompute: uniform (every N layers a unit) or block (the first N layers per stage)",
        choices=("uniform", "block"),
    )  # fmt: skip
    recompute_num_layers: int | None = flag(None, "perf", "full recompute: N of --recompute-method")

    def _check_distributed_optimizer(self) -> None:
        if self.use_precision_aware_optimizer and not self.optimizer_cpu_offload:
            raise ConfigError(
                "--use-precision-aware-optimizer without --optimizer-cpu-offload: megatron-core steps it with "
                "transformer-engine's FusedAdam (its master weights and reduced-precision state), and "
                "transformer-engine is not installed (megatron-core: 'requires FusedAdam from "
                "TransformerEngine, but not found', measured); add --optimizer-cpu-offload (its host optimizer "
                "holds the fp32 master weights) or drop the flag"
            )
        if self.overlap_cpu_optimizer_d2h_h2d and not self.optimizer_cpu_offload:
            raise ConfigError(
                "--overlap-cpu-optimizer-d2h-h2d overlaps the offloaded optimizer's copies: add --optimizer-cpu-offload"
            )
        if self.optimizer_cpu_offload and not self.use_distributed_optimizer:
            raise ConfigError(
                "--optimizer-cpu-offload: megatron-core's HybridDeviceOptimizer, built here under megatron's "
                "DistributedOptimizer (without it the actor steps torch's AdamW on the trainer's device); add "
                "--use-distributed-optimizer"
            )
        if self.optimizer_cpu_offload and not self.bf16:
            raise ConfigError(
                "--optimizer-cpu-offload needs --bf16: megatron-core 0.16's HybridDeviceOptimizer steps the fp32 "
                "main parameters that --bf16 makes (its docs: 'supports bf16 mixed-precision'; --fp16 with it is "
                "not run here); with fp32 parameters the distributed optimizer hands it views of the model's "
                'parameters, which it refuses ("can\'t optimize a non-leaf Tensor", measured); add --bf16'
            )
        if not self.use_distributed_optimizer:
            return
        if self.train_backend != "megatron":
            raise ConfigError(
                "--use-distributed-optimizer: megatron-core's DistributedOptimizer, for --train-backend megatron "
                "(the fsdp backend shards the optimizer state already)"
            )
        if self.optimizer != "adam":
            raise ConfigError(
                f"--use-distributed-optimizer with --optimizer {self.optimizer}: megatron-core's DistributedOptimizer "
                "steps Adam only (it asserts so, for its checkpoint format); Miles turns it on for adam only"
            )
        if self.uses_lora:
            raise ConfigError(
                "--use-distributed-optimizer with LoRA: the adapter is stepped by the actor's optimizer outside "
                "megatron DDP (as Miles turns the distributed optimizer off for LoRA); drop the flag"
            )
        if self.async_save:
            raise ConfigError(
                "--use-distributed-optimizer with --async-save: the save of megatron's sharded optimizer state "
                "gathers over the data-parallel group at the save point, which the async path (host copies "
                "written later) does not do; not built: drop --async-save"
            )
        # --offload-train with it: the policy's storages are parked in place (training/offload.py `park`)

    def megatron_layout_flags(self) -> list[str]:
        """The model-parallel flags set to anything but their default, as `--flag`s."""
        return changed_flags(self, LAYOUT)

    def data_parallel_size(self) -> int:
        """Trainer ranks / (TP x PP x CP): the ranks that take different samples."""
        world = self.actor_num_nodes * self.actor_num_gpus_per_node
        mp = self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        return max(1, world // mp)

    def _check_fp16(self) -> None:
        """--fp16: megatron's fp16 with loss scaling; on fsdp Miles' (fp16 forward, fp32 master
        parameters, no loss scaling): --train-forward-dtype fp16."""
        scaling = changed_flags(self, LOSS_SCALE)
        if scaling and not self.fp16:
            raise ConfigError(
                f"{', '.join(scaling)}: megatron's loss scaling, which only --fp16 does (bf16 and fp32 need none); "
                "add --fp16 or drop them"
            )
        if not self.fp16:
            return
        if self.bf16:
            raise ConfigError("--fp16 with --bf16: one parameter dtype; choose one")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(
                f"--min-loss-scale {self.min_loss_scale} > --initial-loss-scale {self.initial_loss_scale}: "
                "megatron's DynamicGradScaler asserts min <= initial"
            )
        if self.train_backend == "megatron" and self.uses_lora:
            raise ConfigError(
                "--fp16 with LoRA: the adapter trains outside megatron's optimizer, without its loss scaling "
                "(Miles' LoRA optimizers assert bf16 too); use --bf16"
            )
        other = {self.train_forward_dtype, self.rollout_dtype} - {None, "fp16"}
        if other:
            raise ConfigError(
                f"--fp16 with --train-forward-dtype / --rollout-dtype {other.pop()}: --fp16 sets both to fp16; drop them"
            )
        if not self.train_forward_dtype and not self.rollout_dtype:
            self.train_forward_dtype = self.rollout_dtype = "fp16"

    def _derive_megatron_precision(self) -> None:
        """--bf16 / --fp16 on megatron: the forward is bf16 / fp16, so the engines' must be (set when
        not given)."""
        given = changed_flags(self, PRECISION)
        if given and self.train_backend != "megatron":
            raise ConfigError(
                f"{', '.join(given)}: Megatron's precision / recompute flags, for --train-backend megatron; the "
                "fsdp backend takes --train-forward-dtype, --fsdp-master-dtype, --gradient-checkpointing"
            )
        self._check_fp16()
        self._check_distributed_optimizer()
        if self.bf16 and not self.train_forward_dtype and not self.rollout_dtype:
            self.train_forward_dtype = self.rollout_dtype = "bf16"
        if (self.recompute_method or self.recompute_num_layers) and self.recompute_granularity != "full":
            raise ConfigError(
                "--recompute-method / --recompute-num-layers: they choose layers of --recompute-granularity full"
            )
        if self.recompute_granularity == "full" and not (self.recompute_method and self.recompute_num_layers):
            raise ConfigError(
                "--recompute-granularity full needs --recompute-method uniform|block and --recompute-num-layers N "
                "(as megatron-core)"
            )

    def _check_megatron_layout(self) -> None:
        given = self.megatron_layout_flags()
        if not given:
            return
        if self.train_backend != "megatron":
            raise ConfigError(f"{', '.join(given)}: megatron model parallelism; use --train-backend megatron")
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag_name(name)} must be >= 1, got {getattr(self, name)}")
        pp = self.pipeline_model_parallel_size
        for name in ("num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
                     "decoder_last_pipeline_num_layers"):  # fmt: skip
            v = getattr(self, name)
            if v is not None and pp == 1:
                raise ConfigError(f"{flag_name(name)} {v}: needs --pipeline-model-parallel-size > 1")
        if self.num_layers_per_virtual_pipeline_stage and (
            self.decoder_first_pipeline_num_layers or self.decoder_last_pipeline_num_layers
        ):
            raise ConfigError(
                "--num-layers-per-virtual-pipeline-stage with --decoder-first/last-pipeline-num-layers: "
                "megatron-core splits interleaved stages evenly; use one or the other"
            )
        world = self.actor_num_nodes * self.actor_num_gpus_per_node
        tp, ep = self.tensor_model_parallel_size, self.expert_model_parallel_size
        mp = tp * pp * self.context_parallel_size
        if world % mp:
            raise ConfigError(
                f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} x --context-parallel-size "
                f"{self.context_parallel_size} = {mp} ranks per model "
                f"replica: the {world} trainer ranks (--actor-num-nodes x --actor-num-gpus-per-node) must be a "
                "multiple of it"
            )
        etp = self.expert_tensor_parallel_size or tp
        if world % (etp * ep * pp):
            raise ConfigError(
                f"--expert-model-parallel-size {ep}: the {world} trainer ranks must be a multiple of expert TP x "
                f"EP x PP = {etp} x {ep} x {pp} (megatron's expert layout; expert TP is "
                "--expert-tensor-parallel-size, default --tensor-model-parallel-size)"
            )
        if self.expert_tensor_parallel_size is not None and tp > 1 and not self.sequence_parallel:
            raise ConfigError(
                f"--expert-tensor-parallel-size {etp} at --tensor-model-parallel-size {tp}: megatron-core's MoE "
                "layer trains at TP > 1 only with --sequence-parallel (MoELayer: 'performance may degrade if MoE "
                "and tensor parallelism are enabled without also enabling sequence parallelism'); add it"
            )
