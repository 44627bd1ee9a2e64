"""Bridge interface, the registry by HF architecture name, and megatron GPT layout helpers."""

from __future__ import annotations

import importlib
import math
import pkgutil
from abc import ABC, abstractmethod
from typing import Any

import torch

from miles_platform.errors import CheckpointError
from miles_platform.models.families import family_of

_REGISTRY: dict[str, type[Bridge]] = {}

# megatron GPT tensor-parallel layout: how each parameter (by name suffix) is split over TP ranks
# (core_attention.softmax_offset: one per head, GPT-OSS's sinks, split with the heads)
_COLUMN_PARALLEL = (
    "word_embeddings.weight",
    "output_layer.weight",
    "linear_qkv.weight",
    "linear_qkv.bias",
    "core_attention.softmax_offset",
    # MLA (DeepSeek-V3): the up projections' rows are whole heads; the latent down projections are whole
    # on every rank (duplicated, in both specs: training/megatron_mla.py)
    "linear_q_proj.weight",
    "linear_q_up_proj.weight",
    "linear_kv_up_proj.weight",
)
_ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight", "self_attention.out_proj.weight")
_GATED_COLUMN_PARALLEL = ("linear_fc1.weight",)  # [gate; up], each half split on dim 0
# megatron's GatedDeltaNet (Qwen3.5): per value head, split with the heads; in_proj [q; k; v; z; b; a] and
# conv1d [q; k; v] are split part by part (each rank: its slice of every part, rank-major), sizes from the
# layer (megatron_weights.tp_parts)
_GDN_COLUMN_PARALLEL = ("self_attention.dt_bias", "self_attention.A_log")
_PARTS = ("self_attention.in_proj.weight", "self_attention.conv1d.weight")


class Bridge(ABC):
    """Maps one HF architecture to megatron-core GPTModel names/layouts and back.

    State dicts on the megatron side use the module names of GPTModel (`model.state_dict()`),
    full (unsharded) tensors, no `_extra_state`. `fused_norms=True` emits the TE-spec names
    (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`); `megatron_to_hf` reads either.
    """

    architectures: tuple[str, ...] = ()
    # why LoRA adapters are not built on megatron for this family (the text after its architectures in the
    # refusal, training/megatron_lora.check_lora_model); None where they are (the dense / Qwen3-MoE bridges).
    # Refused unless a bridge says otherwise: a new family's projections are not checked with adapters
    lora_refusal: str | None = (
        ": its megatron bridge is not built with adapters here; use --train-backend fsdp"
    )
    # HF's packed gate_up_proj interleaves the gate and up columns (GPT-OSS); megatron's fc1 rows are
    # [gate; up] either way (training/megatron_lora.py orders an expert adapter's rows by it)
    interleaved_gate_up = False

    @abstractmethod
    def transformer_config(self, hf_config: Any) -> dict[str, Any]:
        """kwargs of megatron.core.transformer.TransformerConfig for this HF config."""

    @abstractmethod
    def gpt_model_kwargs(self, hf_config: Any, tensor_model_parallel_size: int = 1) -> dict[str, Any]:
        """kwargs of GPTModel besides config and layer spec (vocab size, rope, tied embeddings)."""

    @abstractmethod
    def layer_spec_kwargs(self, hf_config: Any) -> dict[str, Any]:
        """kwargs shared by get_gpt_layer_local_spec / get_gpt_layer_with_transformer_engine_spec."""

    def layout_refusal(self, hf_config: dict[str, Any], layout: Any, *, step: bool = True) -> str | None:
        """Why this family cannot take a megatron layout (training/megatron_parallel.Layout), or None: the
        family's own limits beyond the shapes every model splits by. `step=False`: a conversion, which
        runs no step (a limit of the step's arithmetic, such as a needed --sequence-parallel, does not apply).
        Checked before Ray (megatron_parallel.check_model_fits) and before a conversion writes."""
        return None

    def adapt_layer_spec(self, spec: Any, use_te: bool) -> Any:
        """The family's changes to megatron's layer spec beyond `layer_spec_kwargs` (MiniMax-M2's whole-
        projection q/k norms); the spec itself when none."""
        return spec

    @abstractmethod
    def hf_to_megatron(
        self,
        hf_sd: dict[str, torch.Tensor],
        config: Any,
        *,
        fused_norms: bool = False,
        padded_vocab_size: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """HF state dict -> full megatron state dict. CheckpointError names a missing/misshapen tensor."""

    def megatron_to_hf(self, mcore_sd: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
        """Full megatron state dict (local or TE names) -> HF state dict under the module names of
        transformers' model (`model.state_dict()`: what engines load and the fsdp backend exports):
        every unit of `megatron_to_hf_part`."""
        out = self.megatron_to_hf_part(mcore_sd, config, (0, 0))
        for i in range(int(hf_config_dict(config)["num_hidden_layers"])):
            out.update(self.megatron_to_hf_part(mcore_sd, config, (1, i)))
        out.update(self.megatron_to_hf_part(mcore_sd, config, (2, 0)))
        return out

    def megatron_to_hf_part(
        self, mcore_sd: dict[str, torch.Tensor], config: Any, unit: tuple[int, int]
    ) -> dict[str, torch.Tensor]:
        """One unit of `megatron_to_hf` (bucketed weight export): (0, 0) the embedding, (1, i)
        decoder layer i, (2, 0) the final norm and output layer; `mcore_sd` holds that unit."""
        raise NotImplementedError(f"{type(self).__name__}: no per-unit megatron_to_hf")

    def checkpoint_layout(self, hf_sd: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
        """megatron_to_hf's state dict as `save_pretrained` lays it out on disk: the fused expert
        parameters split into HF's per-expert tensors (models/checkpoint_layout.py); the same tensors
        for the families whose module names are their checkpoint names (the dense ones)."""
        from miles_platform.models.checkpoint_layout import split_fused_experts

        return split_fused_experts(hf_sd)


def register_bridge(*architectures: str):
    """Class decorator: `@register_bridge("Qwen3ForCausalLM")`."""

    def wrap(cls: type[Bridge]) -> type[Bridge]:
        cls.architectures = tuple(architectures)
        for arch in architectures:
            _REGISTRY[arch] = cls
        return cls

    return wrap


def _discover() -> None:
    import miles_platform.models.bridge as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name != "base":
            importlib.import_module(f"{pkg.__name__}.{info.name}")


def supported_architectures() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def hf_config_dict(hf_config: Any) -> dict[str, Any]:
    """Accept a transformers PretrainedConfig or a config.json dict."""
    if isinstance(hf_config, dict):
        return hf_config
    return hf_config.to_dict()


def get_bridge(hf_config: Any) -> Bridge:
    """The bridge for an HF config's `architectures`; CheckpointError lists the supported ones."""
    _discover()
    archs = hf_config_dict(hf_config).get("architectures") or []
    for arch in archs:
        if arch in _REGISTRY:
            return _REGISTRY[arch]()
    fam = family_of(hf_config_dict(hf_config))
    if fam is not None and fam.megatron:
        raise CheckpointError(f"{fam.architecture} ({fam.name}) on the megatron backend: {fam.megatron}")
    raise CheckpointError(
        f"architecture {archs} has no megatron bridge; supported: {sorted(_REGISTRY)} "
        "(add one as miles_platform/models/bridge/<model>.py)"
    )


def tp_split(name: str) -> str | None:
    """'column' | 'row' | 'gated' | 'parts' | None (replicated) for a megatron GPT parameter name."""
    if name.endswith(_GATED_COLUMN_PARALLEL):
        return "gated"
    if name.endswith(_PARTS):
        return "parts"
    if name.endswith(_COLUMN_PARALLEL + _GDN_COLUMN_PARALLEL):
        return "column"
    if name.endswith(_ROW_PARALLEL):
        return "row"
    return None


def tp_shard(
    name: str, full: torch.Tensor, rank: int, size: int, parts: list[int] | None = None
) -> torch.Tensor:
    """This TP rank's slice of a full megatron tensor (`parts`: the full row counts of a 'parts' tensor)."""
    kind = tp_split(name)
    if kind is None or size == 1:
        return full
    if kind in ("gated", "parts"):
        pieces = full.chunk(2, dim=0) if kind == "gated" else full.split(_need(name, parts), dim=0)
        return torch.cat([p.chunk(size, dim=0)[rank] for p in pieces], dim=0)
    return full.chunk(size, dim=0 if kind == "column" else 1)[rank]


def tp_unshard(name: str, shards: list[torch.Tensor], parts: list[int] | None = None) -> torch.Tensor:
    """Inverse of tp_shard over all ranks' slices (in rank order)."""
    kind = tp_split(name)
    if kind is None or len(shards) == 1:
        return shards[0]
    if kind in ("gated", "parts"):
        n = len(shards)
        local = (
            [2 * [s.shape[0] // 2] for s in shards]
            if kind == "gated"
            else [[p // n for p in _need(name, parts)]] * n
        )
        pieces = [s.split(sizes, dim=0) for s, sizes in zip(shards, local, strict=True)]
        return torch.cat([ps[i] for i in range(len(local[0])) for ps in pieces], dim=0)
    return torch.cat(shards, dim=0 if kind == "column" else 1)


def _need(name: str, parts: list[int] | None) -> list[int]:
    if parts is None:
        raise ValueError(f"{name}: a tensor split part by part over TP needs its parts' sizes")
    return parts


# Megatron's default --make-vocab-size-divisible-by; a multiple of every power-of-two TP size up
# to 128, so the padded vocab (and the torch_dist tensor shapes) do not depend on the TP size.
VOCAB_PAD_MULTIPLE = 128


def padded_vocab(vocab_size: int, tensor_model_parallel_size: int = 1) -> int:
    """vocab_size rounded up to a multiple of lcm(128, TP): VocabParallelEmbedding splits rows evenly."""
    m = math.lcm(VOCAB_PAD_MULTIPLE, tensor_model_parallel_size)
    return -(-vocab_size // m) * m
