import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from miles_platform.errors import CheckpointError
from miles_platform.models.checkpoint import load_hf_checkpoint, save_hf_checkpoint, validate_hf_dir
from miles_platform.models.qwen3 import build_model, tiny_qwen3_config
from miles_platform.models.tokenizer import EOS, PAD, build_task_tokenizer

SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16)


@pytest.fixture(scope="module")
def task_ckpt(tmp_path_factory):
    tok = build_task_tokenizer()
    model = build_model(tiny_qwen3_config(len(tok), **SMALL), seed=1)
    path = tmp_path_factory.mktemp("task") / "ckpt"
    save_hf_checkpoint(model, tok, path)
    return path, model


def test_task_tokenizer_round_trips_and_splits_digits():
    tok = build_task_tokenizer()
    for text in ("12+34=46", "999-123=876", "What is 7+8? 15"):
        assert tok.decode(tok.encode(text)) == text
    assert tok.tokenize("123+45=") == ["1", "2", "3", "+", "4", "5", "="]
    assert tok.eos_token == EOS and tok.pad_token == PAD and tok.eos_token_id != tok.pad_token_id
    assert build_task_tokenizer().get_vocab() == tok.get_vocab()  # deterministic


def test_saved_checkpoint_reloads_with_identical_logits_and_chat_template(task_ckpt):
    path, model = task_ckpt
    reloaded, tok = load_hf_checkpoint(path)
    ids = torch.tensor([tok.encode("12+34=")])
    assert torch.equal(model(ids).logits, reloaded(ids).logits)
    auto = AutoTokenizer.from_pretrained(str(path))
    text = auto.apply_chat_template(
        [{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    assert auto.eos_token == EOS and auto.decode(auto.encode("1+2=3")) == "1+2=3"


def _copy(src, tmp_path):
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    return dst


def test_missing_config_is_named(task_ckpt, tmp_path):
    bad = _copy(task_ckpt[0], tmp_path)
    (bad / "config.json").unlink()
    with pytest.raises(CheckpointError, match=rf"{bad}.*missing config.json"):
        load_hf_checkpoint(bad)


def test_missing_weights_is_named(task_ckpt, tmp_path):
    bad = _copy(task_ckpt[0], tmp_path)
    (bad / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=rf"{bad}.*safetensors"):
        validate_hf_dir(bad)


def test_truncated_or_foreign_weights_are_named(task_ckpt, tmp_path):
    bad = _copy(task_ckpt[0], tmp_path)
    w = bad / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated"):
        validate_hf_dir(bad)
    w.write_bytes(b"PK\x03\x04 not safetensors at all")
    with pytest.raises(CheckpointError, match=r"model.safetensors: (not a safetensors file|corrupt)"):
        validate_hf_dir(bad)


def test_unsupported_architecture_is_named(task_ckpt, tmp_path):
    bad = _copy(task_ckpt[0], tmp_path)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=rf"{bad}.*GPT2LMHeadModel.*not supported"):
        load_hf_checkpoint(bad)


def test_tokenizer_that_does_not_load_is_named(task_ckpt, tmp_path):
    bad = _copy(task_ckpt[0], tmp_path)
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"{bad}.*tokenizer does not load"):
        load_hf_checkpoint(bad)


def _materialize(tmp_path, config):
    import dagster as dg

    from assets.checkpoints import base_checkpoint
    from resources.storage import StorageRootResource

    res = dg.materialize(
        [base_checkpoint],
        resources={"storage": StorageRootResource(root=str(tmp_path / "root"))},
        run_config={"ops": {"base_checkpoint": {"config": config}}},
        raise_on_error=False,
    )
    return res


def test_base_checkpoint_asset_sft_mode(tmp_path):
    res = _materialize(tmp_path, {"mode": "sft", "train_iters": 2, "eval_prompts": 16})
    assert res.success
    md = res.asset_materializations_for_node("base_checkpoint")[0].metadata
    path = md["path"].value
    assert path == str(tmp_path / "root" / "models" / "base")
    validate_hf_dir(path)
    assert md["num_parameters"].value > 0 and md["bytes"].value > 0 and md["sft_seconds"].value > 0
    assert 0.0 <= md["eval/pass@1"].value <= 1.0
    assert len(md["content_hash"].value) == 32
    curve = md["sft_loss_curve"].value  # a table the asset page renders: step, loss
    assert [c.name for c in curve.schema.columns] == ["step", "loss"]
    assert curve.records[-1].data["step"] == 2 and curve.records[-1].data["loss"] == pytest.approx(
        md["sft_final_loss"].value, abs=1e-5
    )


def test_base_checkpoint_asset_registers_existing_and_refuses_bad_dirs(tiny_hf_checkpoint, tmp_path):
    res = _materialize(tmp_path, {"mode": "existing", "path": tiny_hf_checkpoint})
    assert res.success
    md = res.asset_materializations_for_node("base_checkpoint")[0].metadata
    from miles_platform.models.checkpoint import content_hash

    assert md["content_hash"].value == content_hash(tiny_hf_checkpoint)
    bad = _copy(tiny_hf_checkpoint, tmp_path)
    (bad / "config.json").unlink()
    res = _materialize(tmp_path, {"mode": "existing", "path": str(bad)})
    assert not res.success
    error = res.get_step_failure_events()[0].event_specific_data.error
    err = error.message + (error.cause.message if error.cause else "")
    assert "missing config.json" in err and str(bad) in err
