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

import os
from pathlib import Path
from typing import Any

import torch

from miles_platform.errors import CheckpointError
from miles_platform.models.bridge import Bridge, get_bridge
from miles_platform.models.bridge.base import tp_shard, tp_split, tp_unshard
from miles_platform.training import megatron_shims
from miles_platform.training.backend import ModelBackend

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
    """(GPTModel, bridge) for an HF config, on `device` (default: CUDA's current device when there
    is one, else the CPU); parallel_state must be initialized."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer import TransformerConfig

    bridge = get_bridge(hf_config)
    use_te = te_available() if use_te is None else use_te
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    megatron_shims.apply_no_te_shims()
    cfg = TransformerConfig(
        **bridge.transformer_config(hf_config),
        tensor_model_parallel_size=tensor_model_parallel_size,
        params_dtype=params_dtype,
        use_cpu_initialization=device.type != "cuda",
    )
    spec_kwargs = bridge.layer_spec_kwargs(hf_config)
    if use_te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(**spec_kwargs)
    else:
        spec = specs.get_gpt_layer_local_spec(**spec_kwargs, normalization="RMSNorm")
    model = GPTModel(
        cfg,
        spec,
        **bridge.gpt_model_kwargs(hf_config, tensor_model_parallel_size),
        parallel_output=False,  # logits gathered over TP: [B, T, V] on every rank
    )
    return to_device(model, device), bridge


def to_device(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model.to(device)`, with the tensors megatron keeps as plain attributes (RoPE's `inv_freq`,
    created on the CPU under `use_cpu_initialization`), which `.to` does not see."""
    model.to(device)
    for m in model.modules():
        for name, v in list(vars(m).items()):
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and v.device != device:
                if name not in m._buffers:
                    setattr(m, name, v.to(device))
    return model


def uses_fused_norms(model: torch.nn.Module) -> bool:
    """TE spec: layer norms live inside linear_qkv / linear_fc1."""
    return any(k.endswith("linear_qkv.layer_norm_weight") for k in model.state_dict())


def _tp_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def load_full_state(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy a full (unsharded) megatron state dict into this rank's TP shards of `model`."""
    rank, size = _tp_rank_size()
    params = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    missing = sorted(set(params) - set(full))
    if missing:
        raise CheckpointError(f"megatron state: missing tensor(s) {missing[:5]}")
    with torch.no_grad():
        for name, dst in params.items():
            src = tp_shard(name, full[name], rank, size)
            if src.shape != dst.shape:
                raise CheckpointError(
                    f"megatron state: tensor {name!r} shard has shape {tuple(src.shape)}, model has {tuple(dst.shape)}"
                )
            dst.copy_(src)


def gather_full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full megatron state dict (CPU, detached), all-gathered over the TP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    _, size = _tp_rank_size()
    out = {}
    for name, t in model.state_dict().items():
        if not isinstance(t, torch.Tensor):
            continue  # _extra_state
        t = t.detach()
        if size > 1 and tp_split(name) is not None:
            shards = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(shards, t.contiguous(), group=ps.get_tensor_model_parallel_group())
            t = tp_unshard(name, shards)
        out[name] = t.cpu().clone()
    return out


def _save_strategy():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    # one writer process per rank: the machines this runs on in tests have 2 cores
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)


def save_torch_dist(model: torch.nn.Module, ckpt_dir: str | os.PathLike, iteration: int = 0) -> None:
    """Collective: every rank calls it. Writes Megatron's torch_dist format into ckpt_dir."""
    from megatron.core import dist_checkpointing

    megatron_shims.apply_cpu_shims()
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    state = {"model": model.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": iteration}
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


def load_torch_dist(model: torch.nn.Module, ckpt_dir: str | os.PathLike) -> Path:
    """Collective: load (resharding as needed) a torch_dist checkpoint into `model`."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    megatron_shims.apply_cpu_shims()
    p = check_torch_dist_dir(ckpt_dir)
    try:
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(p))
    except (CheckpointingException, KeyError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"torch_dist checkpoint {p}: {type(e).__name__}: {e}") from e
    model.load_state_dict(state["model"], strict=True)
    return p


def wrap_data_parallel(model: torch.nn.Module):
    """megatron-core DDP, configured for what runs here: the actor's torch AdamW over full
    parameters (no distributed optimizer) and one blocking all-reduce after the last
    micro-batch (no overlap: gloo on CPU has no side stream to overlap on; one bucket)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=False,
    )
    return DistributedDataParallel(model.config, ddp_config, model)


class MegatronBackend(ModelBackend):
    name = "megatron"
    ddp = None  # megatron DDP around self.module when it trains data-parallel

    def build(self, hf_checkpoint: str, trainable: bool = True) -> torch.nn.Module:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from miles_platform.models.checkpoint import validate_hf_dir
        from miles_platform.weights.quantize import load_dense_hf_model

        hf_config = validate_hf_dir(hf_checkpoint, need_tokenizer=False)
        tp = int(getattr(self.cfg, "tensor_model_parallel_size", 1) or 1)
        if self.world_size > 1 and not dist.is_initialized():
            raise RuntimeError(
                f"MegatronBackend rank {self.rank} of {self.world_size}: join torch.distributed first "
                "(TrainerActor does it from its dist_init)"
            )
        megatron_shims.init_process_group(
            self.rank, self.world_size, tp, seed=int(getattr(self.cfg, "seed", 1234)), device=self.device
        )
        self.hf_config = hf_config
        self.module, self.bridge = build_gpt_model(hf_config, tp, device=self.device)
        ref_load = getattr(self.cfg, "ref_load", None)
        if ref_load:
            load_torch_dist(self.module, ref_load)
        else:
            self.load_hf_state_dict(load_dense_hf_model(hf_checkpoint).state_dict())
        if trainable and getattr(self.cfg, "moe_router_freeze_gate", False):
            for name, p in self.module.named_parameters():  # MoE routers stay as loaded
                if name.endswith("mlp.router.weight"):
                    p.requires_grad_(False)
        if trainable and ps.get_data_parallel_world_size() > 1:
            # after the weights are in: DDP keeps param.data where it is (no distributed optimizer)
            self.ddp = wrap_data_parallel(self.module)
        self.module.train()
        return self.module

    def zero_grad(self) -> None:
        if self.ddp is not None:
            self.ddp.zero_grad_buffer()

    def finish_grad_sync(self) -> None:
        if self.ddp is None:
            return
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])
        for p in self.module.parameters():
            if p.requires_grad:
                p.grad = p.main_grad  # a view of the averaged buffer, zeroed by zero_grad()

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # an explicit causal mask: megatron's default one is allocated on "cuda". RoPE uses
        # positions 0..T-1, which equals position_ids on every real token of right-padded rows.
        T = input_ids.shape[1]
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=input_ids.device), diagonal=1)
        out = self.module(input_ids, position_ids, causal[None, None])
        return out[..., : self.vocab_size]

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self.bridge.megatron_to_hf(gather_full_state(self.module), self.hf_config)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        bridge: Bridge = self.bridge
        vocab_rows = self.module.state_dict()["embedding.word_embeddings.weight"].shape[0]
        _, tp = _tp_rank_size()
        full = bridge.hf_to_megatron(
            state,
            self.hf_config,
            fused_norms=uses_fused_norms(self.module),
            padded_vocab_size=vocab_rows * tp,
        )
        load_full_state(self.module, full)

    def save_model(self, ckpt_dir: str) -> None:
        save_torch_dist(self.module, ckpt_dir)

    def load_model(self, ckpt_dir: str) -> None:
        load_torch_dist(self.module, ckpt_dir)
