"""HF export of a policy version: the trainer's HF-named weights + the base config and tokenizer."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

from miles_platform.models.checkpoint_layout import split_fused_experts
from miles_platform.store import remote
from miles_platform.store.atomic import fsync_dir, fsync_file, replace_dir

CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "preprocessor_config.json",  # a vision-language model's image processor (models/vlm.py)
)


def export_hf_dir(
    state: dict[str, torch.Tensor],
    template_dir: str,
    out_dir: str,
    config_overrides: dict | None = None,
    link_from: str | None = None,
) -> str:
    """Write `state` as model.safetensors next to the template's config + tokenizer, atomically.
    `config_overrides`: keys replaced in config.json (a merged LoRA head is no longer tied; None
    removes the key: a dense export of a quantized checkpoint's model drops its quantization_config).
    An object-store `out_dir` is staged locally and uploaded with model.safetensors last (what
    readers check for), and its content hash remembered (no download to hash it again).
    `link_from`: an earlier export of the same template (the run's previous version): each of its
    config / tokenizer files that is still the template's copy (same size and mtime, as `copy2` left
    it) is hard-linked, not copied and fsynced again (5 of a version's 6 files, ~1.5 ms of CPU and 5
    fsyncs a version on the demo, 2026-12-07); exports are never written in place."""
    if remote.is_remote(out_dir):
        from miles_platform.models.checkpoint import content_hash, remember_content_hash

        with remote.staging_dir() as d:
            local = export_hf_dir(state, template_dir, os.path.join(d, "export"), config_overrides)
            h = content_hash(local)
            remote.upload_dir(local, out_dir, last=["model.safetensors"])
        remember_content_hash(out_dir, h)
        return str(out_dir)
    dest = Path(out_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        written = []  # files whose data is new here (fsynced before the rename)
        for name in CONFIG_FILES:
            src = Path(template_dir) / name
            if not src.exists():
                continue
            if not (config_overrides and name == "config.json") and _link_copy(src, link_from, tmp / name):
                continue
            shutil.copy2(src, tmp / name)
            written.append(tmp / name)
        if config_overrides:
            import json

            conf = {**json.loads((tmp / "config.json").read_text()), **config_overrides}
            conf = {k: v for k, v in conf.items() if not (k in config_overrides and v is None)}
            (tmp / "config.json").write_text(json.dumps(conf, indent=2))
        save_file(  # in HF's checkpoint layout: an MoE's experts one tensor each, as SGLang reads them
            {k: v.contiguous() for k, v in split_fused_experts(state).items()},
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        written.append(tmp / "model.safetensors")
        for f in written:
            fsync_file(f)
        fsync_dir(tmp)
        replace_dir(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return os.fspath(dest)


def _link_copy(src: Path, link_from: str | None, dst: Path) -> bool:
    """Hard-link `link_from`'s copy of template file `src` to `dst` when it is one (same size and
    mtime: `copy2`'s); False where there is none, it differs or the link fails (another disk)."""
    if not link_from:
        return False
    old = Path(link_from) / src.name
    try:
        a, b = src.stat(), old.stat()
        if a.st_size != b.st_size or a.st_mtime_ns != b.st_mtime_ns:
            return False
        os.link(old, dst)
    except OSError:
        return False
    return True
