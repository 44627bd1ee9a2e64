"""Low precision that survives updates: the rollout checkpoint's format on every served version.

When --hf-checkpoint is quantized (its config.json's `quantization_config`: fp8 block-wise or
compressed-tensors int4 pack-quantized, the formats `miles-platform quantize` writes), engines
serve that format at version 0, and every weight update quantizes the trainer's HF-named weights
the same way on the way to them, as Miles' exporter does (megatron_to_hf/processors/quantize_params):
the modules the checkpoint stores quantized leave as fp8 `weight` + `weight_scale_inv`, or int4
`weight_packed` + `weight_scale` + `weight_shape`, with the checkpoint's block / group size; every
other tensor as it is. So the engines serve `dequant(quantize(trainer weights))` after version 1
exactly as they served `dequant(checkpoint)` at version 0, and the update carries the quantized
bytes (about a quarter (fp8, from fp32) or an eighth (int4) of the dense ones). Where the trainer ranks
ship the update themselves (broadcast, colocated tensor) they quantize it (training/actor.py).

The quantized tensors are self-describing (their suffixes): `dense_from_update` turns an update
back into dense module parameters wherever it lands (an engine, the weight check).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import quant as kq
from miles_platform.errors import CheckpointError

FP8_SUFFIX = ".weight_scale_inv"
INT4_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape")


@dataclass(frozen=True)
class RolloutQuant:
    """How the rollout checkpoint stores its weights, and so how every update is shipped."""

    fmt: str  # "fp8" | "int4"
    modules: frozenset[str]  # the modules the checkpoint stores quantized (HF on-disk names)
    group_size: int = 128  # int4 only (the checkpoint's config_groups group_size)

    def quantize(self, state: dict[str, torch.Tensor], partial: bool = False) -> dict[str, torch.Tensor]:
        """The trainer's HF-named weights as the rollout checkpoint stores them (on-disk layout: an
        MoE's experts one tensor each). Raises when a module the checkpoint quantized is missing,
        unless `state` is `partial` (one bucket of a streamed update)."""
        from miles_platform.models.checkpoint_layout import split_fused_experts

        state = split_fused_experts(state)
        missing = [] if partial else sorted(m for m in self.modules if f"{m}.weight" not in state)
        if missing:
            raise CheckpointError(
                f"the rollout checkpoint stores {len(missing)} modules {self.fmt}-quantized that the trainer's "
                f"weights do not have (e.g. {missing[:3]}): it is not a quantized copy of the trained model"
            )
        out: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            module = name.removesuffix(".weight")
            if not (name.endswith(".weight") and module in self.modules):
                out[name] = t
            elif self.fmt == "fp8":
                out[name], out[module + FP8_SUFFIX] = kq.fp8_block_quant(t)
            else:
                for suffix, v in kq.int4_pack_quantize(t, self.group_size).items():
                    out[f"{module}.{suffix}"] = v
        return out


def _weights_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _tensor_names(path: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for f in _weights_files(path):
        with safe_open(str(f), "pt") as st:
            names.extend(st.keys())
    return names


def quant_format(qc: dict | None) -> str | None:
    """ "fp8" / "int4" for the quantization_configs the platform serves (None: not quantized);
    refuses the variants its kernels do not reproduce, naming the field."""
    if not isinstance(qc, dict) or not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3" or qc.get("activation_scheme", "dynamic") != "dynamic":
            raise CheckpointError(
                f"fp8 quantization_config fmt {qc.get('fmt')!r} / activation_scheme "
                f"{qc.get('activation_scheme')!r}: only e4m3 weights with dynamic activations are served"
            )
        if list(qc.get("weight_block_size") or []) != [kq.FP8_BLOCK, kq.FP8_BLOCK]:
            raise CheckpointError(
                f"fp8 quantization_config weight_block_size {qc.get('weight_block_size')}: only "
                f"[{kq.FP8_BLOCK}, {kq.FP8_BLOCK}] block-wise fp8 is served and re-quantized here"
            )
        return "fp8"
    if method == "compressed-tensors" and qc.get("format") == "pack-quantized":
        w = _int4_weights(qc)
        if (w.get("num_bits"), w.get("symmetric"), w.get("strategy")) != (4, True, "group"):
            raise CheckpointError(
                f"compressed-tensors weights {{num_bits {w.get('num_bits')}, symmetric {w.get('symmetric')}, "
                f"strategy {w.get('strategy')}}}: only symmetric group-wise int4 (W4A16) is served here"
            )
        return "int4"
    raise CheckpointError(f"unsupported quantization_config {method}/{qc.get('format')}")


def _int4_weights(qc: dict) -> dict:
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1 or not isinstance(groups[0].get("weights"), dict):
        raise CheckpointError(
            f"compressed-tensors config_groups {list(qc.get('config_groups') or {})}: exactly one group "
            "with a `weights` scheme is served here"
        )
    return groups[0]["weights"]


def rollout_quant(hf_checkpoint: str) -> RolloutQuant | None:
    """The rollout checkpoint's quantization (None for a dense one). The quantized modules are read
    from its tensor names (the safetensors headers), so updates quantize exactly what it did."""
    path = Path(hf_checkpoint)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None  # not a local checkpoint dir: validation elsewhere says why
    qc = cfg.get("quantization_config")
    fmt = quant_format(qc)
    if fmt is None:
        return None
    marker = FP8_SUFFIX if fmt == "fp8" else ".weight_packed"
    modules = frozenset(n.removesuffix(marker) for n in _tensor_names(path) if n.endswith(marker))
    group = int(_int4_weights(qc).get("group_size") or 128) if fmt == "int4" else kq.FP8_BLOCK
    return RolloutQuant(fmt, modules, group)


def quantized_names(named: dict[str, torch.Tensor]) -> list[str]:
    """The tensors of an update that hold quantized modules (weights, scales, shapes)."""
    fp8 = {n.removesuffix(FP8_SUFFIX) for n in named if n.endswith(FP8_SUFFIX)}
    return [
        n
        for n in named
        if n.endswith((FP8_SUFFIX, *INT4_SUFFIXES)) or (n.endswith(".weight") and n[: -len(".weight")] in fp8)
    ]


def dense_from_update(
    named: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> tuple[dict[str, torch.Tensor], str | None]:
    """(the update's tensors as module parameters: quantized modules dequantized to `dtype`, an
    MoE's per-expert tensors fused; the update's format: "fp8", "int4" or None when dense)."""
    from miles_platform.models.checkpoint_layout import fuse_checkpoint_experts

    fp8 = [n.removesuffix(FP8_SUFFIX) for n in named if n.endswith(FP8_SUFFIX)]
    int4 = [n.removesuffix(".weight_packed") for n in named if n.endswith(".weight_packed")]
    if fp8 and int4:
        raise CheckpointError("a weight update carries both fp8 and int4 tensors: one format per model")
    out = dict(named)
    for m in fp8:
        q, s = out.pop(f"{m}.weight", None), out.pop(m + FP8_SUFFIX)
        if q is None:
            raise CheckpointError(f"weight update: {m}{FP8_SUFFIX} without {m}.weight")
        out[f"{m}.weight"] = kq.fp8_block_dequant(q, s, dtype)
    for m in int4:
        try:
            packed, scale, shape = (out.pop(m + s) for s in INT4_SUFFIXES)
        except KeyError as e:
            raise CheckpointError(f"weight update: int4 module {m} lacks {e.args[0]}") from e
        out[f"{m}.weight"] = kq.int4_dequant(packed, scale, shape, dtype)
    stray = [n for n, t in out.items() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    if stray:  # an fp8 weight without its scale would load as its raw fp8 values
        raise CheckpointError(
            f"weight update: {stray[0]} is fp8 without {stray[0][: -len('.weight')]}{FP8_SUFFIX}"
        )
    if not fp8 and not int4:
        return named, None
    return fuse_checkpoint_experts(out), ("fp8" if fp8 else "int4")


def read_served_state(path) -> tuple[dict[str, torch.Tensor], str | None, dict[str, torch.Tensor]]:
    """An HF checkpoint dir as an engine loads it: (dense module parameters, an MoE's per-expert
    tensors fused as transformers' modules hold them; its served format; the quantized tensors as
    stored). Dense tensors in a dir whose config says quantized (an older export) load as they are,
    and the format is None: what is served, not what the config claims."""
    from safetensors.torch import load_file

    from miles_platform.models.checkpoint import validate_hf_dir
    from miles_platform.models.checkpoint_layout import fuse_checkpoint_experts

    validate_hf_dir(path, need_tokenizer=False)
    raw: dict[str, torch.Tensor] = {}
    for f in _weights_files(Path(path)):
        raw.update(load_file(str(f)))
    quantized = {n: raw[n] for n in quantized_names(raw)}
    dense, fmt = dense_from_update(raw)
    return fuse_checkpoint_experts(dense), fmt, quantized


def write_served_checkpoint(served: dict[str, torch.Tensor], hf_checkpoint: str, out_dir: str) -> str:
    """A version as the engines serve it: the quantized tensors next to the rollout checkpoint's
    config (its quantization_config) and tokenizer; atomic (training/export.py). What a replacement
    engine, a `disk` update and the `quantized_weights` record load."""
    from miles_platform.training.export import export_hf_dir

    return export_hf_dir(served, hf_checkpoint, out_dir)


def quantized_serving(cfg) -> list[str]:
    """What a run with a quantized --hf-checkpoint logs at start."""
    rq = rollout_quant(cfg.hf_checkpoint)
    if rq is None:
        return []
    return [
        f"--hf-checkpoint is {rq.fmt}-quantized ({len(rq.modules)} modules): the trainer starts from its "
        f"dequantized weights, and every weight update quantizes the trainer's weights the same way, so the "
        f"engines serve {rq.fmt} at every version (docs/weights.md)"
    ]
