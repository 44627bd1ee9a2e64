"""`--train-backend megatron`: a megatron-core GPTModel behind the ModelBackend contract.

Layer spec: transformer-engine's when it imports and CUDA is available, megatron's local spec
otherwise (CPU, gloo). Weights come from the HF checkpoint through the architecture's bridge,
or from a torch_dist checkpoint (`--ref-load`, warm start). Checkpoints are Megatron's
torch_dist format (`dist_checkpointing`), resharded on load, so a TP=2 save loads at TP=1.

Data parallelism (world size > 1): the TrainerActor has joined torch.distributed (gloo on
CPU) from its `dist_init`; build() puts megatron's parallel_state on top of that group and wraps
the trained model in megatron-core's own DistributedDataParallel. Backward accumulates into its
contiguous fp32 grad buffer (`param.main_grad`); finish_grad_sync() runs `finalize_model_grads`
(one all-reduce averaging over the data-parallel group) and points `.grad` at the buffer, so the
actor's clipping and torch AdamW see the averaged gradients.

The module-level functions (build_gpt_model, load_full_state, gather_full_state,
save_torch_dist, load_torch_dist) are shared with `miles-platform convert`.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import torch

from miles_platform.errors import CheckpointError, ConfigError
from miles_platform.models.bridge import Bridge
from miles_platform.models.bridge.base import padded_vocab
from miles_platform.training import megatron_precision, megatron_shims, megatron_step, megatron_weights
from miles_platform.training.backend import ModelBackend, ScoreRequest, Scores, scores_from_logits
from miles_platform.training.megatron_parallel import Layout, to_device  # noqa: F401 (offload.py)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
# torch_dist metadata: megatron's format marker and torch.distributed.checkpoint's index
METADATA_FILES = ("metadata.json", ".metadata")


def te_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # TE raises OSError/ImportError on machines it cannot run on
        return False
    return True


def build_gpt_model(
    hf_config: dict[str, Any],
    tensor_model_parallel_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    use_te: bool | None = None,
    device: torch.device | str | None = None,
):
    """(GPTModel, bridge) for an HF config without pipeline stages, on `device` (default: CUDA's
    current device when there is one, else the CPU); parallel_state must be initialized. Logits
    are vocab-parallel ([B, T, V / TP])."""
    from miles_platform.training.megatron_parallel import Layout, build_model_chunks

    use_te = te_available() if use_te is None else use_te
    chunks, bridge = build_model_chunks(
        hf_config, Layout(tp=tensor_model_parallel_size), params_dtype, use_te, device=device
    )
    return chunks[0], bridge


def uses_fused_norms(model: torch.nn.Module) -> bool:
    """TE spec: layer norms live inside linear_qkv / linear_fc1 (MLA: the latent norms inside
    linear_kv_up_proj / linear_q_up_proj)."""
    fused = (
        "linear_qkv.layer_norm_weight",
        "linear_kv_up_proj.layer_norm_weight",
        "in_proj.layer_norm_weight",
    )
    return any(k.endswith(fused) for k in model.state_dict())


def _tp_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _chunks(model) -> list[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple, torch.nn.ModuleList)) else [model]


def load_full_state(model, full: dict[str, torch.Tensor]) -> None:
    """Copy a full (unsharded) megatron state dict into this rank's shards of `model` (a model
    or its list of pipeline chunks)."""
    megatron_weights.load_full_state(_chunks(model), full)


def gather_full_state(model) -> dict[str, torch.Tensor]:
    """Full megatron state dict (CPU, detached), gathered over TP and PP, on every rank."""
    return megatron_weights.gather_full_state(_chunks(model))


def _save_strategy():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    # one writer process per rank: the machines this runs on in tests have 2 cores
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)


def model_sharded_state(model) -> dict[str, Any]:
    """Megatron's checkpoint keys: "model", or "model0", "model1", ... per virtual pipeline chunk.
    The sharded tensors inside carry global keys (layer offsets applied), so any layout reads them."""
    chunks = _chunks(model)
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def save_torch_dist(model, ckpt_dir: str | os.PathLike, iteration: int = 0) -> None:
    """Collective: every rank calls it. Writes Megatron's torch_dist format into ckpt_dir."""
    from megatron.core import dist_checkpointing

    megatron_shims.apply_cpu_shims()
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    state = {**model_sharded_state(model), "checkpoint_version": 3.0, "iteration": iteration}
    dist_checkpointing.save(state, str(ckpt_dir), sharded_strategy=_save_strategy())


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path:
    """A torch_dist dir itself, or a save root with latest_checkpointed_iteration.txt -> its iter dir."""
    p = Path(path)
    tracker = p / TRACKER_FILE
    if tracker.exists():
        it = tracker.read_text().strip()
        if it == "release":
            return p / "release"
        if not it.isdigit():
            raise CheckpointError(f"{tracker}: expected an iteration number or 'release', got {it!r}")
        return p / f"iter_{int(it):07d}"
    return p


def check_torch_dist_dir(path: str | os.PathLike) -> Path:
    p = resolve_checkpoint_dir(path)
    if not p.is_dir():
        raise CheckpointError(f"torch_dist checkpoint {p}: not a directory")
    for name in METADATA_FILES:
        if not (p / name).exists():
            raise CheckpointError(f"torch_dist checkpoint {p}: missing {name} (incomplete or not torch_dist)")
    return p


def load_torch_dist(model, ckpt_dir: str | os.PathLike) -> Path:
    """Collective: load (resharding as needed: any TP / PP layout) a torch_dist checkpoint into
    `model` (a model or its pipeline chunks)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    megatron_shims.apply_cpu_shims()
    p = check_torch_dist_dir(ckpt_dir)
    try:
        state = dist_checkpointing.load(model_sharded_state(model), str(p))
    except (CheckpointingException, KeyError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"torch_dist checkpoint {p}: {type(e).__name__}: {e}") from e
    chunks = _chunks(model)
    for i, c in enumerate(chunks):
        c.load_state_dict(state["model" if len(chunks) == 1 else f"model{i}"], strict=True)
    return p


def wrap_data_parallel(
    model: torch.nn.Module, grad_reduce_in_fp32: bool = True, distributed_optimizer: bool = False
):
    """megatron-core DDP, configured for what runs here: the actor's torch AdamW over full
    parameters, or with `distributed_optimizer` megatron-core's DistributedOptimizer over the data-
    parallel shards (megatron_distopt), and one blocking reduction after the last micro-batch (no
    overlap: gloo on CPU has no side stream to overlap on; one bucket)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
    )
    return DistributedDataParallel(model.config, ddp_config, model)


class MegatronBackend(ModelBackend):
    name = "megatron"
    ddp: list | None = None  # megatron DDP around each model chunk (world > 1, or --bf16)
    main = None  # --bf16 / --fp16: megatron_precision.MainParams, the fp32 copies the optimizer steps
    loss_scale = None  # --fp16 without the distributed optimizer: megatron_precision.LossScale
    dist_opt = None  # --use-distributed-optimizer: megatron_distopt.ActorOptimizer (build_optimizer)
    lora = None  # --lora-rank > 0: training/megatron_lora.MegatronLora, the adapter beside the frozen model

    def build(self, hf_checkpoint: str, trainable: bool = True) -> torch.nn.Module:
        import torch.distributed as dist

        from miles_platform.models.checkpoint import validate_hf_dir
        from miles_platform.training.megatron_parallel import build_model_chunks
        from miles_platform.weights.quantize import load_dense_hf_model

        hf_config = validate_hf_dir(hf_checkpoint, need_tokenizer=False)
        self.layout = Layout.from_cfg(self.cfg)
        if self.world_size > 1 and not dist.is_initialized():
            raise RuntimeError(
                f"MegatronBackend rank {self.rank} of {self.world_size}: join torch.distributed first "
                "(TrainerActor does it from its dist_init)"
            )
        megatron_shims.init_process_group(
            self.rank, self.world_size, layout=self.layout, num_layers=hf_config["num_hidden_layers"],
            seed=int(getattr(self.cfg, "seed", 1234)), device=self.device,
        )  # fmt: skip
        self.hf_config = hf_config
        if trainable:
            from miles_platform.training.hooks import megatron_init_hook

            megatron_init_hook(self.cfg)
        # LoRA: the local spec (separate norms), so an adapter on linear_qkv / linear_fc1 sees the
        # normed input its HF projection sees (TE's fused LayerNormLinear takes the un-normed one)
        use_te = te_available() and not getattr(self.cfg, "uses_lora", False)
        self.chunks, self.bridge = build_model_chunks(
            hf_config, self.layout, megatron_precision.params_dtype(self.cfg), use_te,
            megatron_precision.config_kwargs(self.cfg), device=self.device,
        )  # fmt: skip
        self.module = self.chunks[0] if len(self.chunks) == 1 else torch.nn.ModuleList(self.chunks)
        from miles_platform.models.gdn import keep_decay_fp32

        keep_decay_fp32(
            self.module
        )  # Qwen3.5's A_log in fp32 under --bf16 / --fp16, as Miles (models/gdn.py)
        ref_load = getattr(self.cfg, "ref_load", None)
        if ref_load:
            load_torch_dist(self.chunks, ref_load)
        else:
            self.load_hf_state_dict(load_dense_hf_model(hf_checkpoint).state_dict())
        from miles_platform.training.megatron_qat import maybe_apply_megatron_int4_qat

        # Miles' INT4 QAT: actor and reference alike, before DDP wraps them
        rollout_ckpt = getattr(self.cfg, "hf_checkpoint", None) or hf_checkpoint
        self.int4_qat_modules = maybe_apply_megatron_int4_qat(self.chunks, rollout_ckpt)
        if trainable and getattr(self.cfg, "moe_router_freeze_gate", False):
            for name, p in self.module.named_parameters():  # MoE routers stay as loaded
                if name.endswith("mlp.router.weight"):
                    p.requires_grad_(False)
        if trainable and getattr(self.cfg, "uses_lora", False):
            self._attach_lora()
        low = megatron_precision.reduced_precision(self.cfg)  # --bf16 / --fp16
        distributed = trainable and bool(getattr(self.cfg, "use_distributed_optimizer", False))
        if trainable and self.lora is None and (self.world_size > 1 or low or distributed):
            # after the weights are in: DDP keeps param.data where it is (no distributed optimizer);
            # its finalize also reduces sequence-parallel norms over TP and tied embeddings over PP.
            # Under --bf16 / --fp16 its main_grad buffers accumulate in fp32 if asked to, even on one rank.
            fp32_grads = not low or bool(getattr(self.cfg, "accumulate_allreduce_grads_in_fp32", False))
            self.ddp = [wrap_data_parallel(c, fp32_grads, distributed) for c in self.chunks]
        if distributed:  # megatron's optimizer keeps the fp32 main parameters of its shard itself
            from miles_platform.training import megatron_distopt

            self.dist_opt = megatron_distopt.ActorOptimizer(megatron_distopt.build(self.cfg, self.ddp))
        elif trainable and low and self.lora is None:  # (LoRA: the adapter is fp32, its own main copy)
            self.main = megatron_precision.MainParams(self.module.named_parameters())
        if trainable and getattr(self.cfg, "fp16", False):
            self._scale_losses()
        self.module.train()
        return self.module

    def _scale_losses(self) -> None:
        """--fp16: megatron's schedule multiplies each micro-batch loss by the grad scaler's scale
        (`config.grad_scale_func`, as megatron's training loop sets it to the optimizer's scale_loss)."""
        if self.dist_opt is not None:  # megatron's own optimizer holds the grad scaler
            scale = self.dist_opt.scale_loss
        else:
            from megatron.core import parallel_state as ps

            group = ps.get_model_parallel_group() if self.world_size > 1 else None
            self.loss_scale = megatron_precision.LossScale(megatron_precision.grad_scaler(self.cfg), group)
            scale = self.loss_scale.scale_loss
        for c in self.chunks:
            c.config.grad_scale_func = scale

    def loss_scale_metrics(self) -> dict[str, float]:
        if self.dist_opt is not None and getattr(self.cfg, "fp16", False):
            scale, skipped = self.dist_opt.loss_scale(), self.dist_opt.skipped
        elif self.loss_scale is not None:
            scale, skipped = float(self.loss_scale.scaler.scale), self.loss_scale.skipped
        else:
            return {}
        return {"train/loss_scale": scale, "train/loss_scale_skipped_steps": float(skipped)}

    def _attach_lora(self) -> None:
        """The base freezes; the adapter (fresh, or --lora-adapter-path's) is what trains."""
        from miles_platform.training.lora import check_adapter_matches, read_adapter_dir
        from miles_platform.training.megatron_lora import MegatronLora

        for p in self.module.parameters():
            p.requires_grad_(False)
        if len(self.chunks) > 1:
            raise ConfigError(
                "--lora-rank with virtual pipeline stages (--num-layers-per-virtual-pipeline-stage): LoRA on "
                "megatron is built for one model chunk per stage; drop the flag or use --train-backend fsdp"
            )
        self.lora = MegatronLora(self.chunks[0], self.hf_config, self.cfg)
        if self.cfg.lora_adapter_path:
            check_adapter_matches(self.cfg.lora_adapter_path, self.cfg, self.lora.targets)
            self.lora.load_peft_state(read_adapter_dir(self.cfg.lora_adapter_path)[0])
        elif self.world_size > 1:  # the factors are replicated in a stage: its ranks start from one draw
            import torch.distributed as dist
            from megatron.core import parallel_state as ps

            # (a rank's RNG may have drawn more for its own shards); over the data x context and the tensor
            # parallel ranks of this pipeline stage (another stage holds other layers' factors)
            groups = ((ps.get_data_parallel_group(with_context_parallel=True),
                       ps.get_data_parallel_src_rank(with_context_parallel=True)),
                      (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank()))  # fmt: skip
            for group, src in groups:
                for _, p in self.lora.named_factors():
                    dist.broadcast(p.data, src=src, group=group)

    def zero_grad(self) -> None:
        for d in self.ddp or []:
            d.zero_grad_buffer()

    def finish_grad_sync(self) -> None:
        if self.lora is not None and self.world_size > 1:  # the adapter's gradients: the data-parallel mean
            from megatron.core import parallel_state as ps

            from miles_platform.training.backend import all_reduce_grads

            self.lora.reduce_grads()  # tensor parallel: the column-parallel factors' row parts, summed
            # over data x context parallel ranks, as DDP averages the base's: the schedule's CP factor makes
            # the context-parallel ranks' parts (each its own tokens) add up (megatron_cp.py)
            all_reduce_grads((p for _, p in self.lora.named_factors()),
                             group=ps.get_data_parallel_group(with_context_parallel=True),
                             mean_over=ps.get_data_parallel_world_size(with_context_parallel=True))  # fmt: skip
        if self.ddp is None:
            return
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(self.ddp)  # distributed optimizer: reduce-scattered into the shards
        if self.dist_opt is not None:  # its prepare_grads takes the shards (clip_grad_norm)
            return
        if self.main is not None:  # --bf16: the fp32 main copies take the gradients
            self.main.grads_from_model()
            return
        for p in self.module.parameters():
            if p.requires_grad:
                p.grad = p.main_grad  # a view of the averaged buffer, zeroed by zero_grad()

    def build_optimizer(self):
        return self.dist_opt

    def optimizer_stepped(self) -> None:
        if self.main is not None:
            self.main.to_model()

    def parameters(self):
        return (p for _, p in self.named_parameters())

    def named_parameters(self):
        """What the optimizer steps: the model's parameters, or under --bf16 their fp32 main copies."""
        if self.lora is not None:  # the frozen model's, then the adapter's (PEFT's parameter names)
            return itertools.chain(self.module.named_parameters(), self.lora.named_factors())
        return iter(self.main.named_parameters()) if self.main is not None else self.module.named_parameters()

    def data_parallel(self):
        from megatron.core import parallel_state as ps

        if self.world_size == 1:
            return 0, 1, None
        # megatron's data-parallel group has the world's backend (gloo; "cpu:gloo,cuda:nccl" on GPUs)
        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()

    def writes_sample_rows(self) -> bool:
        """The last pipeline stage (it runs the loss) at tensor- and context-parallel rank 0."""
        from megatron.core import parallel_state as ps

        if self.world_size == 1:
            return True
        return (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_context_parallel_rank() == 0)  # fmt: skip

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        if self.dist_opt is not None:
            return self.dist_opt.clip_grad_norm(max_norm)
        if self.loss_scale is not None and self.loss_scale.unscale_and_check(self.parameters()):
            return torch.tensor(float("inf"))  # --fp16 overflow: the actor skips the step
        if self.layout.model_parallel == 1 and self.layout.ep == 1:
            return super().clip_grad_norm(max_norm)
        # what the optimizer steps: under --bf16 the fp32 main copies hold the gradients (the model's
        # parameters have none), with the model's TP / shared / expert attributes
        params = [p for p in self.parameters() if p.grad is not None]
        total = megatron_step.global_grad_norm(params)
        megatron_step.clip_by_total_norm(params, max_norm, total)
        return total

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    # ---- forward ----
    def _seq_multiple(self) -> int:
        """What a micro-batch's width is padded to a multiple of: TP under sequence parallelism,
        times 2 x CP under context parallelism (its zigzag chunks)."""
        sp = self.layout.tp if self.layout.sp and self.layout.tp > 1 else 1
        return sp * 2 * self.layout.cp if self.layout.cp > 1 else sp

    def _scores(self, out: torch.Tensor, req: ScoreRequest) -> Scores:
        """Scores from the last stage's vocab-parallel logits [B, T', V / TP] (T' >= T: SP padding;
        under CP this rank's zigzag positions, megatron_cp)."""
        out = out[: req.input_ids.shape[0]]
        if self.layout.cp > 1:
            from miles_platform.training.megatron_cp import context_parallel_scores

            return context_parallel_scores(out, req, lambda o, r: self._position_scores(o, r, True))
        return self._position_scores(out[:, : req.input_ids.shape[1]], req)

    def _position_scores(self, out: torch.Tensor, req: ScoreRequest, following: bool = False) -> Scores:
        from miles_platform.training.megatron_logprobs import VocabShard, vocab_parallel_scores

        rank, size = _tp_rank_size()
        if size == 1:  # the full vocabulary: the loss hub's own formulas
            return scores_from_logits(out[..., : self.vocab_size], req, following)
        from megatron.core import parallel_state as ps

        shard = VocabShard(out.shape[-1], self.vocab_size, rank, size, ps.get_tensor_model_parallel_group())
        return vocab_parallel_scores(out, req, shard, following)

    def score(self, req: ScoreRequest) -> Scores:
        if len(self.chunks) > 1 or self.layout.pp > 1:
            raise RuntimeError("a pipeline-parallel model scores through run_micro_batches")
        return self._scores(megatron_step.forward_chunk(self.module, req, self._seq_multiple()), req)

    def run_micro_batches(self, reqs, consume, forward_only: bool = False) -> None:
        models = self.ddp if (self.ddp and not forward_only) else self.chunks
        megatron_step.run_micro_batches(
            models, reqs, self._scores, consume, forward_only, self._seq_multiple()
        )

    def from_last_stage(self, obj):
        return megatron_step.from_last_stage(obj)

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """[B, T, vocab] gathered over TP (one stage only). RoPE uses positions 0..T-1, which equals
        position_ids on every real token of right-padded rows."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        if len(self.chunks) > 1 or self.layout.pp > 1:
            raise RuntimeError("logits() of a pipeline-parallel model: score through run_micro_batches")
        out = megatron_step.forward_chunk(
            self.module, ScoreRequest(input_ids, position_ids), self._seq_multiple()
        )
        if self.layout.cp > 1:
            from miles_platform.training.megatron_cp import gather_positions

            out = gather_positions(out)
        if _tp_rank_size()[1] > 1:
            out = gather_from_tensor_model_parallel_region(out)
        return out[:, : input_ids.shape[1], : self.vocab_size]

    # ---- weights ----
    def hf_buckets(self):
        """HF-named weights, one `--update-weight-buffer-size` bucket at a time (collective)."""
        size = int(getattr(self.cfg, "update_weight_buffer_size", 512 * 1024**2))
        return megatron_weights.hf_buckets(self.chunks, self.bridge, self.hf_config, size)

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective. The policy under HF names (LoRA: merged, base + scale * B @ A). The full HF state on the first rank of each model replica (TP and pipeline
        rank 0, context-parallel rank 0: what call_trainers reads on rank 0), {} on the others: a rank holds its own
        shards plus one bucket besides what it returns."""
        from megatron.core import parallel_state as ps

        # a replica spans TP x PP x CP: its context-parallel ranks hold the same weights
        keep = self.world_size == 1 or (
            ps.get_model_parallel_group().rank() == 0 and ps.get_context_parallel_rank() == 0
        )
        adapter = self.export_adapter() if self.lora is not None else None  # (collective over the stages)
        out: dict[str, torch.Tensor] = {}
        for bucket in self.hf_buckets():
            if keep:
                out.update(bucket)
        if adapter is not None and out:
            from miles_platform.training.lora import merged_state_dict

            return merged_state_dict(out, *adapter)
        return out

    # ---- LoRA (training/megatron_lora.py): the fsdp backend's contract, the same PEFT files ----
    def export_base_state_dict(self) -> dict[str, torch.Tensor]:
        """The frozen base under HF names (collective; on the first rank of each replica)."""
        lora, self.lora = self.lora, None
        try:
            return self.export_hf_state_dict()
        finally:
            self.lora = lora

    def export_adapter(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(lora_A / lora_B under PEFT's file keys, adapter_config.json): the fsdp backend's, key for key."""
        from miles_platform.training.lora import config_dict, lora_config

        return self.lora.gathered_peft_state(), config_dict(
            lora_config(self.cfg, self.lora.targets), self.lora.targets
        )

    def load_adapter(self, state: dict[str, torch.Tensor]) -> None:
        self.lora.load_peft_state(state)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.lora is not None:
            raise ValueError("a LoRA trainer loads adapters (load_adapter), not full HF weights")
        bridge: Bridge = self.bridge
        full = bridge.hf_to_megatron(
            state,
            self.hf_config,
            fused_norms=uses_fused_norms(self.chunks[0]),
            padded_vocab_size=padded_vocab(self.vocab_size, self.layout.tp),
        )
        load_full_state(self.chunks, full)

    def save_model(self, ckpt_dir: str) -> None:
        if self.lora is not None:
            return self.snapshot_model(copy=False)(ckpt_dir)
        save_torch_dist(self.chunks, ckpt_dir)

    def snapshot_model(self, copy: bool = True):
        """LoRA (--async-save): the adapter dir, as the fsdp backend writes it (the base is named by
        content hash, never copied). Full weights have no snapshot: torch_dist saves in place."""
        if self.lora is None:
            raise NotImplementedError("megatron saves full weights with save_model (torch_dist)")
        from miles_platform.training.lora import adapter_writer

        return adapter_writer(*self.export_adapter(), self.cfg.hf_checkpoint, self.rank, copy)

    def load_model(self, ckpt_dir: str) -> None:
        if self.lora is not None:
            from miles_platform.training.lora import read_checkpoint_adapter

            return self.lora.load_peft_state(read_checkpoint_adapter(ckpt_dir, self.cfg.hf_checkpoint))
        load_torch_dist(self.chunks, ckpt_dir)
        if self.main is not None:  # until load_optimizer brings the saved fp32 values
            self.main.from_model()
        if self.dist_opt is not None:  # the same for megatron's optimizer (its fp32 main shards / copies)
            self.dist_opt.reload_model_params()

    # ---- the optimizer's state, resharded like the weights (training/megatron_checkpoint.py) ----
    reshards_checkpoints = True

    def _scaler(self):
        """--fp16: the grad scaler whose state a checkpoint carries (the distributed optimizer's is in
        megatron's own optimizer state)."""
        return self.loss_scale.scaler if self.loss_scale is not None else None

    def _model_param_of(self, p):
        return self.main.model_param(p) if self.main is not None else p

    def save_optimizer(self, opt, ckpt_dir: str) -> bool:
        if self.lora is not None:  # the adapter's state: the actor's per-rank file, by parameter name
            return False
        if self.dist_opt is not None:  # megatron's own sharded state (megatron_distopt)
            from miles_platform.training import megatron_distopt

            megatron_distopt.save(self.dist_opt, model_sharded_state(self.chunks), ckpt_dir, _save_strategy())
            return True
        from miles_platform.training.megatron_checkpoint import save_optimizer

        save_optimizer(self.chunks, self.named_parameters(), self._model_param_of, opt, ckpt_dir,
                       _save_strategy(), self.main is not None, self._scaler())  # fmt: skip
        return True

    def async_checkpoint(self, opt):
        """--async-save: torch_dist's asynchronous save of the weights and `opt` (megatron_checkpoint.py)."""
        from miles_platform.training import megatron_checkpoint as mc

        def model_state() -> dict:
            megatron_shims.apply_cpu_shims()
            return {**mc.copied(model_sharded_state(self.chunks)), "checkpoint_version": 3.0, "iteration": 0}

        def opt_state() -> dict:
            return mc.optimizer_state(self.chunks, self.named_parameters(), self._model_param_of, opt,
                                      self.main is not None, mc.host_copy, self._scaler())  # fmt: skip

        return mc.AsyncTorchDist(model_state, None if opt is None else opt_state, _save_strategy)

    def load_optimizer(self, opt, ckpt_dir: str) -> bool:
        if self.lora is not None:
            return False
        if self.dist_opt is not None:
            from miles_platform.training import megatron_distopt

            return megatron_distopt.load(
                self.dist_opt, model_sharded_state(self.chunks), str(resolve_checkpoint_dir(ckpt_dir))
            )
        from miles_platform.training.megatron_checkpoint import load_optimizer

        ok = load_optimizer(self.chunks, self.named_parameters(), self._model_param_of, opt,
                            str(resolve_checkpoint_dir(ckpt_dir)), self.main is not None, self._scaler())  # fmt: skip
        if ok and self.main is not None:
            self.main.to_model()
        return ok
