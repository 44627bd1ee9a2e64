import dataclasses

import pytest
import torch

from miles_platform.data.tasks import write_task_datasets
from miles_platform.errors import MilesError
from miles_platform.models.checkpoint import load_hf_checkpoint
from miles_platform.training.sft import SFTRecipe, cli_main, default_sft_recipe, lr_lambda, run_sft

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
    r = SFTRecipe(lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_style="cosine")
    f = lr_lambda(r, 110)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)
    lin = lr_lambda(dataclasses.replace(r, lr_decay_style="linear"), 110)
    assert lin(60) == pytest.approx(0.55) and lin(110) == pytest.approx(0.1)
    assert lr_lambda(dataclasses.replace(r, lr_decay_style="constant"), 110)(100) == 1.0
    with pytest.raises(MilesError, match="lr-decay-style"):
        lr_lambda(dataclasses.replace(r, lr_decay_style="step"), 10)


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
