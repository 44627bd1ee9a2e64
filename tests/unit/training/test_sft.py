import dataclasses
import json
import os
import subprocess

import pytest
import torch
from loop_helpers import warm_python

from miles_platform.data.tasks import write_task_datasets
from miles_platform.errors import MilesError
from miles_platform.models.checkpoint import load_hf_checkpoint
from miles_platform.training.schedule import LRSchedule
from miles_platform.training.sft import SFTRecipe, cli_main, default_sft_recipe, run_sft

SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16)


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    return write_task_datasets(tmp_path_factory.mktemp("tasks"), seed=0)["sft"]


def _recipe(**kw):
    base = SFTRecipe(
        model=SMALL, lr=3e-3, lr_warmup_iters=2, global_batch_size=32, micro_batch_size=16, train_iters=40
    )
    return dataclasses.replace(base, log_interval=5, **kw)


def test_sft_lowers_the_loss_and_saves_a_reloadable_checkpoint(sft_data, tmp_path):
    m = run_sft(sft_data, tmp_path / "ckpt", recipe=_recipe(), progress=False)
    first, last = m["loss_curve"][0][1], m["final_loss"]
    assert last < 0.7 * first, m["loss_curve"]
    model, tok = load_hf_checkpoint(tmp_path / "ckpt")
    ids = torch.tensor([tok.encode("12+34=")])
    assert torch.equal(model(ids).logits, m["model"](ids).logits)
    assert m["train_iters"] == 40 and m["sft_seconds"] > 0 and m["num_parameters"] > 0


def test_same_seed_same_weights_other_seed_differs(sft_data):
    def weights(seed):
        m = run_sft(sft_data, recipe=_recipe(train_iters=6, seed=seed), progress=False)
        return m["model"].state_dict()

    a, b, c = weights(7), weights(7), weights(8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_sft_continues_from_an_existing_hf_dir(sft_data, tiny_hf_checkpoint, tmp_path):
    before, _ = load_hf_checkpoint(tiny_hf_checkpoint)
    m = run_sft(
        sft_data,
        tmp_path / "cont",
        hf_checkpoint=tiny_hf_checkpoint,
        recipe=_recipe(train_iters=3, num_threads=2),
        progress=False,
    )
    assert torch.get_num_threads() == 1  # the recipe's thread count is restored after SFT
    after, _ = load_hf_checkpoint(m["save"])
    w = "model.embed_tokens.weight"
    assert after.state_dict()[w].shape == before.state_dict()[w].shape
    assert not torch.equal(after.state_dict()[w], before.state_dict()[w])


def test_lr_schedule_warms_up_then_decays():
    """The trainers' one schedule (SFT and RL; megatron-core's formulas, tests/unit/training/test_schedule.py):
    warmup from 0, then cosine / linear / constant to min_lr."""
    f = LRSchedule(1.0, 0.1, 10, 110, "cosine").lr
    assert f(0) == 0.0 and f(5) == pytest.approx(0.5) and f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)
    lin = LRSchedule(1.0, 0.1, 10, 110, "linear").lr
    assert lin(60) == pytest.approx(0.55) and lin(110) == pytest.approx(0.1)
    assert LRSchedule(1.0, 0.1, 10, 110, "constant").lr(100) == 1.0
    with pytest.raises(MilesError, match="lr-decay-style"):
        LRSchedule(1.0, 0.1, 10, 110, "step")


def test_bad_batch_sizes_are_refused(sft_data):
    with pytest.raises(
        MilesError, match="--global-batch-size 30 must be a multiple of --micro-batch-size 16"
    ):
        run_sft(sft_data, recipe=_recipe(global_batch_size=30), progress=False)


def test_cli_from_scratch(sft_data, tmp_path, capsys):
    rc = cli_main(
        ["--from-scratch", "--prompt-data", sft_data, "--save", str(tmp_path / "b"), "--train-iters", "2"]
        + ["--global-batch-size", "8", "--micro-batch-size", "4", "--lr", "1e-3", "--seed", "3"]
    )
    assert rc == 0 and "sft: 2 iters" in capsys.readouterr().out
    assert (tmp_path / "b" / "model.safetensors").exists() and (tmp_path / "b" / "tokenizer.json").exists()
    assert default_sft_recipe().train_iters > 0


def test_sft_on_megatron_matches_fsdp(sft_data, tiny_hf_checkpoint, tmp_path):
    """SFT is the RL trainer with sft_loss, so it runs on either backend: the megatron run (the CLI,
    in a subprocess: megatron's parallel state is per process) follows the fsdp run's loss curve
    and ends at the same weights up to float32 reassociation."""
    argv = ["--prompt-data", sft_data, "--hf-checkpoint", tiny_hf_checkpoint, "--train-iters", "6",
            "--global-batch-size", "16", "--micro-batch-size", "8", "--lr", "3e-3", "--json"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [*warm_python(), "-m", "miles_platform.cli", "sft", "--train-backend", "megatron",
         "--save", str(tmp_path / "mg"), *argv],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    mg = json.loads(proc.stdout.strip().splitlines()[-1])
    assert mg["recipe"]["train_backend"] == "megatron"
    recipe = dataclasses.replace(default_sft_recipe(), train_iters=6, global_batch_size=16,
                                 micro_batch_size=8, lr=3e-3)  # fmt: skip
    fs = run_sft(sft_data, hf_checkpoint=tiny_hf_checkpoint, recipe=recipe, progress=False)
    assert mg["final_loss"] == pytest.approx(fs["final_loss"], abs=1e-4)
    before, _ = load_hf_checkpoint(tiny_hf_checkpoint)
    after, _ = load_hf_checkpoint(tmp_path / "mg")
    moved = 0.0
    for k, v in after.state_dict().items():
        assert (v - fs["model"].state_dict()[k]).abs().max() < 1e-4, k
        moved = max(moved, float((v - before.state_dict()[k]).abs().max()))
    assert moved > 1e-3  # the megatron run trained: its weights left the start


def test_trainer_sft_loss_is_the_token_mean_nll_of_the_trained_tokens(sft_data, tiny_hf_checkpoint):
    """The TrainBatch run_sft hands the trainer (response from the first trained token, untrained
    tool-answer tokens masked, padding dropped) gives the trainer's first-step loss equal to the
    padded-batch token-mean cross-entropy over exactly the trained target tokens."""
    from miles_platform.training.actor import TrainerActor
    from miles_platform.training.sft import load_sft_rows, sft_run_config, sft_train_batch, tokenize_sft

    model, tok = load_hf_checkpoint(tiny_hf_checkpoint)
    rows = load_sft_rows(sft_data)[:7]
    rows.append({"prompt": "12*3=", "response": "36+1", "response_parts": [["36", 1], ["+", 0], ["1", 1]]})
    ids, mask = tokenize_sft(rows, tok)
    batch = sft_train_batch(ids, mask)
    last = batch.loss_masks[-1]
    assert last[0] == 1 and 0 in last and last[-1] == 1  # trained, tool answer, trained ... EOS
    assert all(len(m) == n for m, n in zip(batch.loss_masks, batch.response_lengths, strict=True))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none"
        )
        want = float((nll * mask[:, 1:].reshape(-1)).sum() / mask[:, 1:].sum())
    recipe = dataclasses.replace(default_sft_recipe(), global_batch_size=8, micro_batch_size=8)
    prev = torch.get_num_threads()
    try:
        actor = TrainerActor(sft_run_config(recipe, tiny_hf_checkpoint, 1))
        got = actor.train(0, batch)["train/loss"]
    finally:
        torch.set_num_threads(prev)
    assert got == pytest.approx(want, abs=1e-5)


def test_sft_on_chat_data_trains_the_batches_train_would(tiny_hf_checkpoint, tmp_path):
    """`miles-platform sft --input-key messages` masks a conversation as `train`'s SFT rollout
    function does (one masking code): the trainer gets the same tokens, response spans and masks."""
    from loop_helpers import sft_argv, write_chat_data

    from miles_platform.config import parse_run_config
    from miles_platform.data.source import RolloutDataSource
    from miles_platform.models.checkpoint import load_tokenizer
    from miles_platform.rollout.sft_rollout import generate_rollout
    from miles_platform.training.actor import TrainBatch
    from miles_platform.training.sft import load_sft_rows, sft_train_batch, tokenize_sft

    data = write_chat_data(tmp_path, n=4)
    tok = load_tokenizer(tiny_hf_checkpoint)
    ids, mask = tokenize_sft(load_sft_rows(data, input_key="messages"), tok, input_key="messages")
    mine = sft_train_batch(ids, mask)
    cfg = parse_run_config(sft_argv(tiny_hf_checkpoint, data))
    theirs = TrainBatch.from_samples(
        [g[0] for g in generate_rollout(cfg, 0, RolloutDataSource.from_config(cfg))]
    )
    assert mine.tokens == theirs.tokens and mine.loss_masks == theirs.loss_masks
    assert mine.response_lengths == theirs.response_lengths
    m = run_sft(data, hf_checkpoint=tiny_hf_checkpoint, input_key="messages", progress=False,
                recipe=_recipe(train_iters=2, global_batch_size=4, micro_batch_size=2))  # fmt: skip
    assert m["num_samples"] == 4 and m["train_iters"] == 2
