"""INT4 QAT on --train-backend megatron (training/qat.py has the rule; this maps the layers).

Miles' QAT is a megatron hook; here each megatron layer whose HF tensors the int4 rollout checkpoint
packs gets the same parameter swap as on fsdp (`qat.fake_int4_forward`). The fake quantization is
per row, grouped along the input columns, so a fused megatron weight (linear_qkv = q, k, v rows,
linear_fc1 = gate, up rows, in megatron's order) is on the same grid as the HF tensors it joins:
`fake_int4(linear_qkv)` holds exactly `fake_int4(q_proj)`, ... row by row. A row-parallel layer's
shard (linear_proj, linear_fc2 at TP > 1) holds a slice of the columns: its groups must not cross
the slice boundary, else the run is refused naming the layer.
"""

from __future__ import annotations

import re
import types

import torch

from kernels import quant as kq
from miles_platform.errors import ConfigError

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)\.weight$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)$")
# megatron layer -> the HF modules (under model.layers.i.) whose rows it holds
_HF = {
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.linear_fc2": ("mlp.down_proj",),
    "mlp.router": ("mlp.gate",),
}
_EXPERT_HF = {"linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


def hf_modules(global_name: str) -> tuple[str, ...]:
    """The HF modules whose weights a megatron `<layer>.weight` (global name) holds; () if none known."""
    m = _LAYER.match(global_name)
    if m is None:
        return ()
    i, rest = m.groups()
    pre = f"model.layers.{i}."
    e = _EXPERT.match(rest)
    if e:
        return tuple(f"{pre}mlp.experts.{e[1]}.{p}" for p in _EXPERT_HF[e[2]])
    return tuple(pre + h for h in _HF.get(rest, ()))


def apply_megatron_int4_qat(chunks: list[torch.nn.Module], modules: frozenset[str], group: int) -> int:
    """Hook every megatron layer whose HF modules are all packed; returns how many. Raises when a
    packed module is held by no hooked layer, or a TP shard would split a group."""
    from megatron.core import parallel_state as ps

    from miles_platform.training.megatron_weights import global_names
    from miles_platform.training.qat import fake_int4_forward

    tp = ps.get_tensor_model_parallel_world_size()
    covered: set[str] = set()
    hooked = 0
    for chunk in chunks:
        names = global_names(chunk)
        for local, p in chunk.named_parameters():
            owner, _, attr = local.rpartition(".")
            hf = hf_modules(names.get(local, local))
            if attr != "weight" or p.dim() != 2 or not hf or not set(hf) <= modules:
                continue
            layer = chunk.get_submodule(owner)
            row_parallel = bool(getattr(layer, "input_is_parallel", False)) and tp > 1
            full_in = p.shape[1] * (tp if row_parallel else 1)
            g = min(group, full_in)  # the checkpoint's grid: groups of g along the full input
            if p.shape[1] % g or g % kq.PACK_FACTOR:
                raise ConfigError(
                    f"INT4 QAT: {names.get(local, local)} at --tensor-model-parallel-size {tp} holds {p.shape[1]} "
                    f"of {full_in} input columns, which groups of {g} do not divide: use a TP whose shards hold "
                    "whole groups, or a smaller OPEN_TRAINING_INT4_GROUP_SIZE"
                )
            layer.int4_qat_group, layer.int4_qat_params = g, ("weight",)
            layer.forward = types.MethodType(fake_int4_forward, layer)
            covered |= set(hf)
            hooked += 1
    if ps.get_pipeline_model_parallel_world_size() == 1 and ps.get_expert_model_parallel_world_size() == 1:
        missing = sorted(modules - covered)  # with PP / EP each rank holds only its part of the model
        if missing:
            raise ConfigError(
                f"INT4 QAT: {len(missing)} modules the int4 checkpoint packs are held by no megatron layer hooked "
                f"here (e.g. {missing[:3]}; transformer-engine's grouped experts are not): their training "
                "forward would not see int4"
            )
    return hooked


def maybe_apply_megatron_int4_qat(chunks: list[torch.nn.Module], hf_checkpoint: str) -> int:
    """INT4 QAT on the megatron backend's chunks as the environment says (0 when off)."""
    from miles_platform.training.qat import packed_modules

    packed = packed_modules(hf_checkpoint)
    return apply_megatron_int4_qat(chunks, *packed) if packed else 0
