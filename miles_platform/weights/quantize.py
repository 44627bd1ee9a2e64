"""Quantized HF checkpoints for rollout engines: block-wise FP8 and INT4 W4A16 (compressed-tensors).

    miles-platform quantize --format fp8|int4 --hf-checkpoint DIR --save DIR [--group-size N]

fp8:  `<m>.weight` float8_e4m3fn + `<m>.weight_scale_inv` fp32 [ceil(out/128), ceil(in/128)];
      quantization_config {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
      "weight_block_size": [128, 128], "modules_to_not_convert": [...]} (DeepSeek / SGLang layout).
int4: `<m>.weight_packed` int32, `<m>.weight_scale`, `<m>.weight_shape`; quantization_config
      {"quant_method": "compressed-tensors", "format": "pack-quantized", config_groups (num_bits 4,
      symmetric, strategy group, group_size), "ignore": [...]}.
Norms, embeddings and lm_head stay in their checkpoint dtype (`DEFAULT_IGNORE`). The save is atomic.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kernels import quant as kq
from miles_platform.errors import CheckpointError
from miles_platform.progress import Progress

FORMATS = ("fp8", "int4")
DEFAULT_IGNORE = (r"norm", r"embed", r"lm_head")
# per-block (fp8) / per-group (int4) max |w - dequant(quant(w))| relative to the block/group amax:
# fp8 e4m3 rounds to 3 mantissa bits (half-ulp <= 1/16 of |w|); int4 rounds to scale/2 = amax/14
MAX_REL_ERROR = {"fp8": 1 / 16, "int4": 1 / 14}


@dataclass
class QuantizeStats:
    fmt: str
    tensors_quantized: int
    tensors_kept: int
    bytes_in: int
    bytes_out: int
    compression_ratio: float
    seconds: float
    max_rel_error: float  # worst block/group, relative to its amax
    out_dir: str = ""
    group_size: int = 128  # int4: the group size actually used (after clamping)

    def as_dict(self) -> dict:
        return asdict(self)


def _quantizable(name: str, t: torch.Tensor, ignore) -> bool:
    return (
        name.endswith(".weight")
        and t.dim() == 2
        and t.is_floating_point()
        and not any(re.search(p, name) for p in ignore)
    )


def block_rel_error(w: torch.Tensor, deq: torch.Tensor, fmt: str, group_size: int = 128) -> float:
    """Max over blocks (fp8 128x128) or groups (int4) of max|err| / amax of that block or group."""
    w, err = w.float(), (w.float() - deq.float()).abs()
    if fmt == "fp8":
        b = kq.FP8_BLOCK
        w, err = kq._pad_to_blocks(w, b), kq._pad_to_blocks(err, b)
        r, c = w.shape[0] // b, w.shape[1] // b
        amax = w.abs().reshape(r, b, c, b).amax((1, 3))
        emax = err.reshape(r, b, c, b).amax((1, 3))
    else:
        g = kq.int4_group_size(w.shape[1], group_size)
        amax = w.abs().reshape(w.shape[0], -1, g).amax(-1)
        emax = err.reshape(w.shape[0], -1, g).amax(-1)
    return float((emax / amax.clamp_min(1e-12)).max())


def quantize_state_dict(
    state: dict, fmt: str, group_size: int = 128, ignore=DEFAULT_IGNORE, progress: Progress | None = None
):
    """-> (quantized tensors, kept module names, max relative error, int4 group size used).
    `progress` advances by one per tensor (quantized or kept) as it starts on it."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: allowed {', '.join(FORMATS)}")
    if fmt == "int4":  # one group size for the whole checkpoint (the config has one): clamp to in_features
        ins = [t.shape[1] for n, t in state.items() if _quantizable(n, t, ignore)]
        group_size = min([group_size, *ins])
    out, kept, worst = {}, [], 0.0
    for name, t in state.items():
        if progress is not None:
            progress.update()
        if not _quantizable(name, t, ignore) or (
            fmt == "int4" and (t.shape[1] % group_size or group_size % kq.PACK_FACTOR)
        ):
            out[name] = t
            if t.dim() == 2 and name.endswith(".weight"):
                kept.append(name.removesuffix(".weight"))
            continue
        prefix = name.removesuffix(".weight")
        if fmt == "fp8":
            q, s = kq.fp8_block_quant(t)
            out[name], out[f"{prefix}.weight_scale_inv"] = q, s
            deq = kq.fp8_block_dequant(q, s)
        else:
            for suffix, v in kq.int4_pack_quantize(t, group_size).items():
                out[f"{prefix}.{suffix}"] = v
            deq = kq.int4_dequant(out[f"{prefix}.weight_packed"], out[f"{prefix}.weight_scale"], t.shape)
        worst = max(worst, block_rel_error(t, deq, fmt, group_size))
    return out, kept, worst, group_size


def quantization_config(fmt: str, group_size: int, kept: list[str]) -> dict:
    if fmt == "fp8":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [kq.FP8_BLOCK, kq.FP8_BLOCK],
            "modules_to_not_convert": sorted(set(kept) | {"lm_head"}),
        }
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": group_size, "dynamic": False, "actorder": None, "observer": "minmax"}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None, "output_activations": None}},
        "ignore": sorted(set(kept) | {"lm_head"}),
        "kv_cache_scheme": None,
    }  # fmt: skip


def _load_state(hf_dir: Path) -> dict:
    from miles_platform.models.checkpoint import read_safetensors_dir

    return read_safetensors_dir(hf_dir)


def _read_config(hf_dir: Path) -> dict:
    try:
        return json.loads((hf_dir / "config.json").read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"HF checkpoint {hf_dir}: missing config.json") from e


def quantize_checkpoint(
    hf_dir: str, out_dir: str, fmt: str = "fp8", group_size: int = 128, ignore=DEFAULT_IGNORE,
    progress: bool = False,
) -> QuantizeStats:  # fmt: skip
    """`progress`: a line on stderr every interval (tensors done, ETA; miles_platform/progress.py)."""
    src, dest = Path(hf_dir), Path(out_dir)
    cfg = _read_config(src)
    if cfg.get("quantization_config"):
        raise CheckpointError(
            f"HF checkpoint {src} is already quantized ({cfg['quantization_config'].get('quant_method')})"
        )
    t0 = time.perf_counter()
    state = _load_state(src)
    with Progress("quantize", len(state), unit="tensor", enabled=progress) as bar:
        qstate, kept, worst, group_size = quantize_state_dict(state, fmt, group_size, ignore, bar)
        bar.update(0, stage="writing model.safetensors")
        cfg["quantization_config"] = quantization_config(fmt, group_size, kept)
        _write_quantized(src, dest, qstate, cfg)
    b_in = sum(t.numel() * t.element_size() for t in state.values())
    b_out = sum(t.numel() * t.element_size() for t in qstate.values())
    n_q = sum(1 for k in qstate if k.endswith((".weight_scale_inv", ".weight_packed")))
    return QuantizeStats(fmt, n_q, len(state) - n_q, b_in, b_out, b_in / max(b_out, 1),
                         time.perf_counter() - t0, worst, str(dest), group_size)  # fmt: skip


def _write_quantized(src: Path, dest: Path, qstate: dict, cfg: dict) -> None:
    """`dest` = src's other files (tokenizer, generation config) + the quantized weights and config, atomically."""
    from safetensors.torch import save_file

    from miles_platform.store.atomic import fsync_tree, replace_dir

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        for f in src.iterdir():
            if (
                f.is_file()
                and f.suffix != ".safetensors"
                and f.name not in ("config.json", "model.safetensors.index.json")
            ):
                shutil.copy2(f, tmp / f.name)
        save_file(
            {k: v.contiguous() for k, v in qstate.items()},
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        fsync_tree(tmp)
        replace_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def dequantize_state_dict(state: dict, qc: dict | None, dtype: torch.dtype = torch.float32) -> dict:
    if not qc:
        return dict(state)
    out = {}
    if qc.get("quant_method") == "fp8":
        for k, v in state.items():
            if k.endswith(".weight_scale_inv"):
                continue
            s = state.get(k.removesuffix(".weight") + ".weight_scale_inv") if k.endswith(".weight") else None
            out[k] = kq.fp8_block_dequant(v, s, dtype) if s is not None else v
        return out
    if qc.get("quant_method") == "compressed-tensors" and qc.get("format") == "pack-quantized":
        for k, v in state.items():
            if k.endswith((".weight_scale", ".weight_shape")):
                continue
            if k.endswith(".weight_packed"):
                p = k.removesuffix(".weight_packed")
                out[f"{p}.weight"] = kq.int4_dequant(
                    v, state[f"{p}.weight_scale"], state[f"{p}.weight_shape"], dtype
                )
            else:
                out[k] = v
        return out
    raise CheckpointError(f"unsupported quantization_config {qc.get('quant_method')}/{qc.get('format')}")


def load_dequantized_state_dict(hf_dir: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """State dict with HF names and dense weights, whatever the checkpoint's quantization (engines)."""
    src = Path(hf_dir)
    cfg = _read_config(src)
    if dtype is None:
        name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        dtype = getattr(torch, name, torch.float32) if isinstance(name, str) else torch.float32
    return dequantize_state_dict(_load_state(src), cfg.get("quantization_config"), dtype)


def load_dense_hf_model(path: str, dtype: torch.dtype = torch.float32):
    """An HF causal LM (eval mode) with dense weights: a quantized checkpoint (fp8 / int4) is built from
    its config without the quantization and loaded dequantized, the same tensors whoever loads it
    (engines, trainer, critic); any other checkpoint as `models.checkpoint.load_hf_model`."""
    from miles_platform.models.checkpoint import load_hf_model, validate_hf_dir
    from miles_platform.models.checkpoint_layout import fuse_checkpoint_experts

    if not validate_hf_dir(path, need_tokenizer=False).get("quantization_config"):
        return load_hf_model(path, dtype)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    from miles_platform.models.gdn import keep_decay_fp32

    keep_decay_fp32(model)  # Qwen3.5's A_log (kept unquantized) loads as stored, as from_pretrained does
    state = fuse_checkpoint_experts(load_dequantized_state_dict(str(path)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise CheckpointError(
            f"HF checkpoint {path}: dequantized weights missing {missing[:5]} / unexpected {unexpected[:5]}"
        )
    return model


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="miles-platform quantize", description=__doc__.splitlines()[0]
    )
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--hf-checkpoint", required=True, help="source HF checkpoint dir (bf16/fp32)")
    p.add_argument("--save", required=True, help="output HF checkpoint dir")
    p.add_argument("--group-size", type=int, default=128, help="int4 group size (clamped to in_features)")
    a = p.parse_args(argv)
    st = quantize_checkpoint(a.hf_checkpoint, a.save, a.format, a.group_size, progress=True)
    print(
        f"{a.format}: {st.tensors_quantized} tensors quantized, {st.tensors_kept} kept; "
        f"{st.bytes_in} -> {st.bytes_out} bytes ({st.compression_ratio:.2f}x), "
        f"max block rel error {st.max_rel_error:.4f}, {st.seconds:.2f} s -> {st.out_dir}"
    )
    return 0
