"""The Miles flags this build honours beyond its own (docs/miles_flags.md): each does what Miles' does."""

import json
import os
import sys
import types

import pytest

from miles_platform.config import parse_run_config
from miles_platform.data.source import RolloutDataSource
from miles_platform.models.checkpoint import load_tokenizer
from miles_platform.rollout.sft_rollout import generate_rollout
from miles_platform.rollout.train_only import TrainOnlyRollouts
from miles_platform.training.checkpoint import prune_checkpoints
from miles_platform.training.schedule import schedule_of

BASE = ["--rollout-batch-size", "2"]


def test_lr_warmup_fraction_is_a_fraction_of_the_decay_steps():
    cfg = parse_run_config(
        [*BASE, "--lr-warmup-fraction", "0.1", "--lr-decay-style", "cosine", "--lr-decay-iters", "50"]
    )
    f = schedule_of(cfg, total_steps=1000).lr
    assert [round(f(s) / cfg.lr, 3) for s in (0, 1, 5)] == [
        0.0,
        0.2,
        1.0,
    ]  # 5 warmup steps from 0 (megatron's)
    with pytest.raises(Exception, match="--lr-warmup-fraction and --lr-warmup-iters"):
        parse_run_config([*BASE, "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"])


def test_save_retain_interval_keeps_multiples_and_the_newest(tmp_path):
    for it in (5, 10, 15, 20, 25):
        (tmp_path / f"iter_{it:07d}").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("25")
    gone = prune_checkpoints(str(tmp_path), newest=25, retain_interval=10)
    assert sorted(os.path.basename(p) for p in gone) == ["iter_0000005", "iter_0000015"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "iter_0000010",
        "iter_0000020",
        "iter_0000025",
    ]


def test_eval_input_key_and_train_env_vars():
    cfg = parse_run_config([*BASE, "--input-key", "prompt", "--eval-input-key", "question",
                            "--train-env-vars", '{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}'])  # fmt: skip
    assert cfg.eval_settings().input_key == "question"
    assert cfg.train_env() == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    with pytest.raises(Exception, match="--train-env-vars .*JSON object of strings"):
        parse_run_config([*BASE, "--train-env-vars", '{"A": 1}'])


def test_wandb_key_host_and_team_reach_wandb_and_never_its_config(monkeypatch):
    seen = {}

    class Run:
        id, dir, settings = "r", "/tmp", types.SimpleNamespace(mode="offline")

        def define_metric(self, *a, **k):
            pass

    def init(**kw):
        seen.update(kw, env={k: os.environ.get(k) for k in ("WANDB_API_KEY", "WANDB_BASE_URL")})
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    from miles_platform.trackers import _WandbSink

    cfg = parse_run_config([*BASE, "--use-wandb", "--wandb-team", "glm-zero", "--wandb-host", "https://wandb.example",
                            "--wandb-key", "secret-key", "--wandb-project", "p"])  # fmt: skip
    _WandbSink(cfg)
    assert seen["entity"] == "glm-zero"
    assert seen["env"] == {"WANDB_API_KEY": "secret-key", "WANDB_BASE_URL": "https://wandb.example"}
    assert "secret-key" not in json.dumps(seen["config"])


def test_miles_sft_rollout_trains_the_assistant_turns_only(tiny_hf_checkpoint, tmp_path):
    rows = [{"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{i}+{i}?"},
                          {"role": "assistant", "content": str(2 * i)}]} for i in range(3)]  # fmt: skip
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_run_config(["--hf-checkpoint", tiny_hf_checkpoint, "--prompt-data", str(data), "--input-key",
                            "messages", "--rollout-function-path", "miles.rollout.sft_rollout.generate_rollout",
                            "--loss-type", "sft_loss", "--debug-train-only", "--rollout-batch-size", "3"])  # fmt: skip
    tok = load_tokenizer(tiny_hf_checkpoint)
    src = RolloutDataSource.from_config(cfg, tokenizer=tok)
    groups = generate_rollout(cfg, 0, src)
    assert [len(g) for g in groups] == [1, 1, 1]
    for s, row in zip((g[0] for g in groups), rows, strict=True):
        trained = [t for t, m in zip(s.response_tokens, s.loss_mask, strict=True) if m]
        assert tok.decode(trained) == row["messages"][-1]["content"] + "<|im_end|>\n"  # answer + end of turn
        whole = tok.apply_chat_template(row["messages"], tokenize=False)
        assert tok.decode(s.prompt_tokens + s.response_tokens) == whole
        assert s.reward == 0.0 and s.rollout_log_probs == []
    samples, metrics = TrainOnlyRollouts(cfg, RolloutDataSource.from_config(cfg, tokenizer=tok)).generate(4)
    assert [(s.rollout_id, s.index) for s in samples] == [(4, 0), (4, 1), (4, 2)]
    assert metrics["rollout/raw_reward"] == 0.0


def test_sft_rollout_needs_miles_sft_flags():
    with pytest.raises(Exception, match="needs --loss-type sft_loss, --debug-train-only"):
        parse_run_config([*BASE, "--rollout-function-path", "miles.rollout.sft_rollout.generate_rollout"])


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_trainer_and_engine_start_from_the_same_dequantized_weights(tiny_hf_checkpoint, tmp_path, fmt):
    """Miles' low-precision recipes hand a quantized --hf-checkpoint to the run: the trainer builds from
    its dequantized weights, the very tensors the engine serves (an int4 one crashed the trainer)."""
    import torch

    from miles_platform.rollout.engine_weights import load_model
    from miles_platform.training.fsdp_backend import FSDPBackend
    from miles_platform.weights.quantize import quantize_checkpoint

    q = str(tmp_path / fmt)
    quantize_checkpoint(tiny_hf_checkpoint, q, fmt, group_size=16)
    cfg = parse_run_config([*BASE, "--hf-checkpoint", q])
    trainer = FSDPBackend(cfg, 0, 1).build(q).state_dict()
    engine = load_model(q, torch.float32)[0].state_dict()
    assert trainer.keys() == engine.keys()
    assert all(torch.equal(trainer[k].float(), engine[k].float()) for k in engine)
    plain = load_model(tiny_hf_checkpoint, torch.float32)[0].state_dict()
    assert not all(torch.equal(plain[k], engine[k].float()) for k in engine)  # it was quantized


def test_docs_name_every_miles_flag_and_its_verdict():
    """docs/miles_flags.md lists each model flag with its config key and each compat flag with the
    verdict and reason the parser applies (a flag added to the tables shows up there too)."""
    from pathlib import Path

    from miles_platform.config import MODEL_ARGS
    from miles_platform.config.compat import COMPAT, SAME
    from miles_platform.config.flags import flag_name

    doc = (Path(__file__).resolve().parents[3] / "docs" / "miles_flags.md").read_text()
    same, refused = doc.split("## Same result here")[1].split("## Refused")
    for name in MODEL_ARGS:
        assert f"`{flag_name(name)}`" in doc, name
    for name, f in COMPAT.items():
        section = same if f.verdict == SAME else refused
        assert f"`{flag_name(name)}`" in section and f.why in section, name
