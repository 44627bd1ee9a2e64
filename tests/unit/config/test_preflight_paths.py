"""Roots and data that cannot work fail before anything starts, naming the flag (issue #49, item 12):
an unwritable or unreachable --storage-root / --save and a directory as --prompt-data ended in raw
FileNotFoundError / IsADirectoryError tracebacks mid-start."""

from __future__ import annotations

import pytest
from loop_helpers import small_run_config

from miles_platform.config import ConfigError
from miles_platform.data.dataset import load_prompt_dataset
from miles_platform.errors import MilesError
from miles_platform.preflight import validate_before_start


@pytest.mark.parametrize(
    "kw, needle",
    [
        (
            dict(storage_root="/proc/nope"),
            r"--storage-root /proc/nope: this user cannot create it \(in /proc\)",
        ),
        (dict(save="/proc/x/y"), r"--save /proc/x/y: this user cannot create it"),
        (dict(storage_root="{file}"), r"--storage-root .*/p\.txt: .*/p\.txt exists and is not a directory"),
        (
            dict(storage_root="{file}/below"),
            r"--storage-root .*/below: .*/p\.txt exists and is not a directory",
        ),
    ],
)
def test_a_root_the_run_cannot_write_is_refused_before_start(tiny_hf_checkpoint, tmp_path, kw, needle):
    (tmp_path / "p.txt").write_text("a file")
    kw = {k: v.format(file=tmp_path / "p.txt") for k, v in kw.items()}
    with pytest.raises(ConfigError, match=needle):
        validate_before_start(small_run_config(tiny_hf_checkpoint, tmp_path, **kw))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".miles-probe")) == []


def test_a_fresh_root_under_a_writable_dir_passes_and_nothing_is_left(tiny_hf_checkpoint, tmp_path):
    validate_before_start(
        small_run_config(tiny_hf_checkpoint, tmp_path, storage_root=str(tmp_path / "a" / "b"))
    )
    assert not (tmp_path / "a").exists() and not [
        p for p in tmp_path.iterdir() if p.name.startswith(".miles-")
    ]


def test_a_directory_as_prompt_data_is_named(tmp_path):
    with pytest.raises(
        MilesError, match=r"is a directory; give a JSONL or Parquet file \(check --prompt-data\)"
    ):
        load_prompt_dataset(str(tmp_path))


def test_a_tokenizer_larger_than_the_embedding_is_refused(tiny_hf_checkpoint, tmp_path):
    import json
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_hf_checkpoint, ckpt)
    conf = json.loads((ckpt / "config.json").read_text())
    conf["vocab_size"] = 64  # the tiny tokenizer has 128 tokens
    (ckpt / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match=r"tokenizer has \d+ tokens but the model's vocab_size is 64"):
        validate_before_start(small_run_config(str(ckpt), tmp_path))


@pytest.mark.parametrize(
    "kw", [dict(rollout_batch_size=9), dict(rollout_batch_size=2, over_sampling_batch_size=9)]
)
def test_a_batch_larger_than_the_dataset_is_refused_before_start(tiny_hf_checkpoint, tmp_path, kw):
    """A rollout batch of more prompts than the data has repeated prompts within one batch (Miles'
    data source hands out fewer and fails later): now refused by name before Ray, nothing written."""
    from miles_platform.loop import train

    cfg = small_run_config(tiny_hf_checkpoint, tmp_path, storage_root=str(tmp_path / "root"), **kw)
    flag = "--over-sampling-batch-size" if "over_sampling_batch_size" in kw else "--rollout-batch-size"
    with pytest.raises(ConfigError, match=f"{flag} 9 is more than the 8 prompt"):
        train(cfg)
    assert not (tmp_path / "root").exists()
