"""A version's HF export: the trainer's weights beside the template's config and tokenizer, whole or
absent; the template's files hard-linked from the version before (`link_from`) where they are its
copies, so a run does not copy and fsync them again every version."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from miles_platform.models.checkpoint import content_hash, load_hf_model
from miles_platform.training.export import CONFIG_FILES, export_hf_dir


def _files(d: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(d.iterdir())}


def test_consecutive_versions_link_the_template_files_and_write_their_weights(tiny_hf_checkpoint, tmp_path):
    model = load_hf_model(tiny_hf_checkpoint)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    v1 = Path(export_hf_dir(state, tiny_hf_checkpoint, str(tmp_path / "v1")))
    moved = {k: v + 1 for k, v in state.items()}
    v2 = Path(export_hf_dir(moved, tiny_hf_checkpoint, str(tmp_path / "v2"), link_from=str(v1)))
    plain = Path(export_hf_dir(moved, tiny_hf_checkpoint, str(tmp_path / "plain")))
    template = [n for n in CONFIG_FILES if (Path(tiny_hf_checkpoint) / n).exists()]
    assert len(template) >= 3
    for name in template:  # one inode for the run's copies of each template file
        assert os.stat(v2 / name).st_ino == os.stat(v1 / name).st_ino
        assert os.stat(plain / name).st_ino != os.stat(v1 / name).st_ino
    assert os.stat(v2 / "model.safetensors").st_ino != os.stat(v1 / "model.safetensors").st_ino
    assert _files(v2) == _files(plain)  # the same export, byte for byte
    assert content_hash(v2) == content_hash(plain) != content_hash(v1)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left


def test_a_template_file_that_changed_or_an_override_is_written_again(tiny_hf_checkpoint, tmp_path):
    model = load_hf_model(tiny_hf_checkpoint)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tpl = tmp_path / "tpl"
    shutil.copytree(tiny_hf_checkpoint, tpl)
    v1 = Path(export_hf_dir(state, str(tpl), str(tmp_path / "v1")))
    (tpl / "tokenizer_config.json").write_text((tpl / "tokenizer_config.json").read_text() + "\n")
    v2 = Path(export_hf_dir(state, str(tpl), str(tmp_path / "v2"), link_from=str(v1)))
    assert os.stat(v2 / "tokenizer_config.json").st_ino != os.stat(v1 / "tokenizer_config.json").st_ino
    assert (v2 / "tokenizer_config.json").read_bytes() == (tpl / "tokenizer_config.json").read_bytes()
    assert os.stat(v2 / "tokenizer.json").st_ino == os.stat(v1 / "tokenizer.json").st_ino
    v3 = Path(
        export_hf_dir(
            state, str(tpl), str(tmp_path / "v3"), {"tie_word_embeddings": False}, link_from=str(v2)
        )
    )
    assert os.stat(v3 / "config.json").st_ino != os.stat(v2 / "config.json").st_ino
    assert '"tie_word_embeddings": false' in (v3 / "config.json").read_text()
    assert (v2 / "config.json").read_bytes() == (tpl / "config.json").read_bytes()  # v2 left as it was
    gone = Path(export_hf_dir(state, str(tpl), str(tmp_path / "v4"), link_from=str(tmp_path / "deleted")))
    assert _files(gone)["tokenizer.json"] == (tpl / "tokenizer.json").read_bytes()
    assert torch.equal(load_hf_model(str(gone)).state_dict()["lm_head.weight"], state["lm_head.weight"])
