"""Weights in and out of a model-parallel megatron model, under the bridges' global names.

A rank holds model chunks (one per virtual pipeline stage) whose state dicts use local names:
`decoder.layers.j` counts from the chunk's first layer, and each tensor-parallel tensor is this TP
rank's slice. `global_names` maps them to the full model's names (layer j of a chunk is its
module's `layer_number - 1`); `load_full_state` copies a full state dict into the chunks;
`hf_buckets` goes the other way, unit by unit.

A unit is what the bridge converts at once: the embedding, one decoder layer, or the final norm
and output layer. Units are packed into buckets of at most `--update-weight-buffer-size` bytes
(Miles' rule: when the next unit would reach or exceed the size, the bucket is flushed first; a
unit is never split). For each tensor the owner (the lowest rank holding it: a pipeline stage, an
expert-parallel rank) all-gathers its TP slices and broadcasts the full tensor, and the bucket is
converted to HF names, so a rank holds at most its own shards plus one bucket of full tensors (plus
what the caller keeps). Every rank runs the same collectives; `hf_buckets` yields on every rank.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from miles_platform.errors import CheckpointError
from miles_platform.models.bridge.base import tp_shard, tp_split, tp_unshard

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..*)$")
TIED_COPY = "output_layer.weight"  # the last stage's copy of a tied embedding


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _tp(expert: bool = False) -> tuple[int, int, Any]:
    """(rank, size, group) of the tensor-parallel group that splits a tensor: the expert TP group
    (`--expert-tensor-parallel-size`) for the experts' weights, the TP group for the rest."""
    from megatron.core import parallel_state as ps

    if expert:
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group())  # fmt: skip
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group())  # fmt: skip


def tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A chunk's parameters and buffers by local name (no `_extra_state`)."""
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def global_names(model: torch.nn.Module) -> dict[str, str]:
    """local name -> the full model's name for one chunk: layer j of the chunk is its module's
    `layer_number - 1`; local expert j of expert-parallel rank r is expert r * (experts / EP) + j."""
    from megatron.core import parallel_state as ps

    offsets = {}
    decoder = getattr(model, "decoder", None)
    for j, layer in enumerate(getattr(decoder, "layers", []) or []):
        offsets[j] = int(layer.layer_number) - 1
    experts = getattr(getattr(model, "config", None), "num_moe_experts", None) or 0
    ep = ps.get_expert_model_parallel_world_size() if experts else 1
    first_expert = ps.get_expert_model_parallel_rank() * (experts // ep) if ep > 1 else 0
    out = {}
    for name in tensors(model):
        m = _LAYER.match(name)
        if not m:
            out[name] = name
            continue
        rest = m.group(2)
        e = _LOCAL_EXPERT.match(rest)
        if e and first_expert:
            rest = f"{e.group(1)}{first_expert + int(e.group(2))}{e.group(3)}"
        out[name] = f"decoder.layers.{offsets[int(m.group(1))]}.{rest}"
    return out


def tp_parts(model: torch.nn.Module, local: str) -> list[int] | None:
    """The full row counts of a tensor TP splits part by part (base.tp_split 'parts': GatedDeltaNet's
    in_proj [q; k; v; z; b; a] and conv1d [q; k; v]), read from its layer; None for any other tensor."""
    if tp_split(local) != "parts":
        return None
    gdn = model.get_submodule(local.rsplit(".", 2)[0])
    qk, v, nv = gdn.qk_dim, gdn.v_dim, gdn.num_value_heads
    return [qk, qk, v, v, nv, nv] if local.endswith("in_proj.weight") else [qk, qk, v]


def is_tied_copy(model: torch.nn.Module, local: str) -> bool:
    """The last pipeline stage's copy of a tied embedding (kept equal to the first stage's)."""
    return local == TIED_COPY and bool(getattr(model, "share_embeddings_and_output_weights", False))


def load_full_state(chunks: list[torch.nn.Module], full: dict[str, torch.Tensor]) -> None:
    """Copy a full (unsharded, global names) megatron state dict into this rank's TP slices."""
    with torch.no_grad():
        for model in chunks:
            names = global_names(model)
            params = tensors(model)
            missing = sorted(
                g for local, g in names.items() if g not in full and not is_tied_copy(model, local)
            )
            if missing:
                raise CheckpointError(f"megatron state: missing tensor(s) {missing[:5]}")
            for local, dst in params.items():
                g = names[local]
                src = full["embedding.word_embeddings.weight"] if is_tied_copy(model, local) else full[g]
                rank, size, _ = _tp(is_expert(g))
                src = tp_shard(g, src, rank, size, tp_parts(model, local))
                if src.shape != dst.shape:
                    raise CheckpointError(
                        f"megatron state: tensor {g!r} shard has shape {tuple(src.shape)}, model has {tuple(dst.shape)}"
                    )
                dst.copy_(src)


def _unit_of(name: str) -> tuple[int, int]:
    """Sort key of a global name's unit: (0, 0) embedding, (1, i) layer i, (2, 0) the rest."""
    if name.startswith("embedding."):
        return (0, 0)
    m = _LAYER.match(name)
    return (1, int(m.group(1))) if m else (2, 0)


def _local_plan(chunks: list[torch.nn.Module]) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(global name, local shape, dtype, chunk index) of every tensor this rank holds and exports."""
    plan = []
    for c, model in enumerate(chunks):
        params = tensors(model)
        for local, g in global_names(model).items():
            if not is_tied_copy(model, local):
                plan.append(
                    (g, tuple(params[local].shape), str(params[local].dtype).removeprefix("torch."), c)
                )
    return plan


def full_tensor_units(
    chunks: list[torch.nn.Module],
) -> Iterator[tuple[tuple[int, int], dict[str, torch.Tensor]]]:
    """(unit key, {global name: full tensor}) for every unit of the model, in order, on every rank.

    Every rank's plan (the global names it holds) is exchanged once; each tensor's owner is the
    lowest rank holding it: its TP group (an expert's: its expert TP group) all-gathers the slices,
    then the owner broadcasts the full tensor to every rank (one bucket at a time)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    me = dist.get_rank() if dist.is_initialized() else 0
    groups = {e: _tp(e) for e in (False, True)}
    my_group = {
        e: set(dist.get_process_group_ranks(g)) if size > 1 else {me} for e, (_, size, g) in groups.items()
    }
    mine = _local_plan(chunks)
    plans: list = [mine]
    if world > 1:
        plans = [None] * world
        dist.all_gather_object(plans, mine)
    owner: dict[str, tuple[int, tuple[int, ...], str]] = {}
    for r, plan in enumerate(plans):
        for g, shape, dtype, _ in plan:
            owner.setdefault(g, (r, shape, dtype))
    local = [tensors(m) for m in chunks]
    by_global = {g: local[c][loc] for c, m in enumerate(chunks) for loc, g in global_names(m).items()}
    parts = {g: tp_parts(m, loc) for m in chunks for loc, g in global_names(m).items()}
    unit, cur = None, {}
    for g in sorted(owner, key=lambda name: (_unit_of(name), name)):
        src, shape, dtype = owner[g]
        key = _unit_of(g)
        if key != unit and cur:
            yield unit, cur
            cur = {}
        unit = key
        _, tp_size, tp_group = groups[is_expert(g)]
        kind = tp_split(g) if tp_size > 1 else None
        if src in my_group[is_expert(g)]:  # this rank holds a slice of the owner's copy
            t = by_global[g].detach()
            if kind is not None:
                shards = [torch.empty_like(t) for _ in range(tp_size)]
                dist.all_gather(shards, t.contiguous(), group=tp_group)
                t = tp_unshard(g, shards, parts[g])
            t = t.contiguous()
        else:
            full_shape = list(shape)
            if kind is not None:
                full_shape[1 if kind == "row" else 0] *= tp_size
            t = torch.empty(full_shape, dtype=getattr(torch, dtype), device=_device(chunks))
        if world > 1:
            dist.broadcast(t, src=src)
        cur[g] = t
    if cur:
        yield unit, cur


def _device(chunks) -> torch.device:
    return next(iter(chunks[0].parameters())).device


def hf_buckets(chunks, bridge, hf_config, buffer_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """HF-named CPU tensors, bucket by bucket (see the module docstring)."""
    bucket: dict[str, torch.Tensor] = {}
    units: list = []
    size = 0
    for unit, full in full_tensor_units(chunks):
        n = sum(t.numel() * t.element_size() for t in full.values())
        if bucket and size + n >= buffer_size:
            yield _convert(bridge, hf_config, bucket, units)
            bucket, units, size = {}, [], 0
        bucket.update(full)
        units.append(unit)
        size += n
    if bucket:
        yield _convert(bridge, hf_config, bucket, units)


def _convert(bridge, hf_config, bucket: dict[str, torch.Tensor], units) -> dict[str, torch.Tensor]:
    out = {}
    for unit in units:
        out.update(bridge.megatron_to_hf_part(bucket, hf_config, unit))
    return {k: v.detach().cpu().clone() for k, v in out.items()}


def gather_full_state(chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The full megatron state dict (global names, CPU) on every rank."""
    out = {}
    for _, full in full_tensor_units(chunks):
        out.update({k: v.cpu().clone() for k, v in full.items()})
    return out
