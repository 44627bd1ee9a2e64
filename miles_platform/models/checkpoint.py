"""HF checkpoint directories: validate, load, save atomically, content-hash.

Layout: config.json, model.safetensors, tokenizer files. Every error names the path and
what is missing; a save is written to a temp dir and renamed, so no half-written
checkpoint is ever visible.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from miles_platform.errors import CheckpointError
from miles_platform.models.families import (
    REFUSED_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    VLM_FAMILIES,
    family_of,
)
from miles_platform.store.atomic import fsync_tree, replace_dir

if TYPE_CHECKING:  # torch loads with the first model, not with the module (the Dagster code location)
    import torch


def embedding_rows(config: dict) -> int | None:
    """The token ids a checkpoint has embedding rows for: config.json's `vocab_size`, or its
    `text_config`'s (multimodal configs); None when it names none."""
    v = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(v) if v else None


# (quant_method, format) of the quantized checkpoints the loaders dequantize (weights/quantize.py)
READ_QUANTIZATIONS = {("fp8", None), ("compressed-tensors", "pack-quantized")}


def quantization(path: str) -> str | None:
    """The quant_method of an HF checkpoint dir's config.json (fp8, compressed-tensors, ...), or None."""
    try:
        q = json.loads((Path(path) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None
    return (q.get("quant_method") or "quantized") if isinstance(q, dict) else None


def context_length(config: dict) -> int | None:
    """The positions a checkpoint serves (`max_position_embeddings`, or its `text_config`'s)."""
    v = config.get("max_position_embeddings") or (config.get("text_config") or {}).get(
        "max_position_embeddings"
    )
    return int(v) if v else None


def validate_hf_dir(path: str | os.PathLike, need_tokenizer: bool = True) -> dict:
    """Check an HF checkpoint dir; return its config dict. Raises CheckpointError naming what is wrong."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"HF checkpoint {p}: not a directory")
    cfg_file = p / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"HF checkpoint {p}: missing config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"HF checkpoint {cfg_file}: invalid JSON ({e})") from e
    weights = sorted(p.glob("*.safetensors"))
    if not weights:
        raise CheckpointError(f"HF checkpoint {p}: no *.safetensors weights file")
    for w in weights:
        _check_safetensors(w)
    archs = cfg.get("architectures") or []
    refused = [a for a in archs if a in REFUSED_ARCHITECTURES]
    if refused and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise CheckpointError(
            f"HF checkpoint {p}: architecture {refused[0]} is refused: {REFUSED_ARCHITECTURES[refused[0]]}"
        )
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise CheckpointError(
            f"HF checkpoint {p}: architecture {archs} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict) and (qc.get("quant_method"), qc.get("format")) not in READ_QUANTIZATIONS:
        raise CheckpointError(
            f"HF checkpoint {p}: quantization_config {qc.get('quant_method')}/{qc.get('format')} is not read here "
            "(fp8 block-wise and compressed-tensors pack-quantized int4 are: `miles-platform quantize` writes "
            "them); bring the checkpoint's bf16 weights (GPT-OSS as published keeps its experts in mxfp4)"
        )
    if need_tokenizer and not (p / "tokenizer.json").exists() and not (p / "tokenizer_config.json").exists():
        raise CheckpointError(
            f"HF checkpoint {p}: missing tokenizer files (tokenizer.json / tokenizer_config.json)"
        )
    return cfg


def _check_safetensors(path: Path) -> None:
    """Header and size of a safetensors file (8-byte header length, JSON header, data): a truncated
    or foreign file fails here, in validation, not at the first load inside an actor."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n <= 0 or 8 + n > size:
            raise CheckpointError(f"HF checkpoint {path}: not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise CheckpointError(f"HF checkpoint {path}: corrupt safetensors header") from None
    ends = []
    for k, v in header.items() if isinstance(header, dict) else [(None, None)]:
        if k == "__metadata__":
            continue
        offs = v.get("data_offsets") if isinstance(v, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int and o >= 0 for o in offs)):
            raise CheckpointError(f"HF checkpoint {path}: corrupt safetensors header (tensor {k!r})")
        ends.append(offs[1])
    need = 8 + n + max(ends, default=0)
    if size < need:
        raise CheckpointError(f"HF checkpoint {path}: truncated ({size} bytes, the header needs {need})")


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types; the user needs the path and cause
        raise CheckpointError(
            f"HF checkpoint {path}: tokenizer does not load ({type(e).__name__}: {e})"
        ) from e


def load_hf_model(path: str | os.PathLike, dtype: torch.dtype | None = None):
    """Load a supported HF causal LM (eval mode, fp32 unless `dtype`) after validation."""
    validate_hf_dir(path, need_tokenizer=False)
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    cls = AutoModelForCausalLM
    fam = family_of(json.loads((Path(path) / "config.json").read_text()))
    if (
        fam is not None and fam.name in VLM_FAMILIES
    ):  # the *ForConditionalGeneration class, vision tower included
        import transformers

        cls = getattr(transformers, fam.architecture)
    from miles_platform.models.gdn import load_decay_fp32

    load_decay_fp32(json.loads((Path(path) / "config.json").read_text()).get("architectures") or ())
    try:
        model = cls.from_pretrained(str(path), dtype=dtype)
    except Exception as e:
        raise CheckpointError(f"HF checkpoint {path}: weights do not load ({type(e).__name__}: {e})") from e
    model.eval()
    return model


def load_hf_checkpoint(path: str | os.PathLike, dtype: torch.dtype | None = None):
    validate_hf_dir(path)
    return load_hf_model(path, dtype), load_tokenizer(path)


def save_hf_checkpoint(model, tokenizer, path: str | os.PathLike, extra=None) -> Path:
    """Write model (safetensors) + config + tokenizer to `path` atomically (temp dir, fsync, rename).
    `extra`: one more object with save_pretrained (a VLM's image processor) written alongside."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if extra is not None:
            extra.save_pretrained(str(tmp))
        fsync_tree(tmp)
        replace_dir(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def read_safetensors_dir(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in an HF dir (sharded or not), as stored."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"HF checkpoint {path}: no *.safetensors weights file")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types on truncated files
            raise CheckpointError(f"HF checkpoint {f}: unreadable safetensors ({e})") from e
    return state


_REMOTE_HASHES: dict[str, str] = {}  # object-store dirs this process uploaded -> their content hash


def remember_content_hash(url: str, digest: str) -> None:
    _REMOTE_HASHES[str(url).rstrip("/")] = digest


def content_hash(path: str | os.PathLike) -> str:
    """sha256 over the weights and config: the Dagster data version of a checkpoint (or of a PEFT
    adapter dir: adapter_model.safetensors + adapter_config.json). An object-store dir: the hash
    remembered when this process uploaded it, else computed over a download."""
    from miles_platform.store import remote

    if remote.is_remote(path):
        known = _REMOTE_HASHES.get(str(path).rstrip("/"))
        if known is not None:
            return known
        with remote.local_dir(str(path), want=lambda rel: "/" not in rel) as d:
            return content_hash(d)
    p = Path(path)
    h = hashlib.sha256()
    if (p / "model_index.json").exists():  # a diffusers-layout pipeline (DiT): every component
        files = [p / "model_index.json", *sorted(f for f in p.rglob("*") if f.suffix in (".safetensors", ".json")
                                                 and f.name != "model_index.json")]  # fmt: skip
        for f in files:
            h.update(str(f.relative_to(p)).encode())
            h.update(f.read_bytes())
        return h.hexdigest()[:32]
    configs = [p / "config.json"] if not (p / "adapter_config.json").exists() else [p / "adapter_config.json"]
    for f in sorted(p.glob("*.safetensors")) + configs:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:32]


def checkpoint_bytes(path: str | os.PathLike) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
