"""One non-finite number must not poison a model (issue #49, item 1): a NaN / inf reward or log-prob
removes its sample from the loss (counted), the rest of its group keeps its signal, a NaN / inf loss
or gradient skips the optimizer step, and too many such steps stop the run by name."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch
from loop_helpers import random_train_batch, small_run_config

from miles_platform.data.sample import Sample
from miles_platform.errors import NonFiniteTraining
from miles_platform.models.checkpoint import load_tokenizer
from miles_platform.training.loss import group_normalize_rewards


def test_a_nan_reward_leaves_the_rest_of_its_group_normalized_over_the_finite_ones():
    # finite [1, 0, 1]: mean 2/3, unbiased std sqrt(1/3) = 0.57735; the NaN sample gets 0
    adv = group_normalize_rewards(torch.tensor([math.nan, 1.0, 0.0, 1.0]), 4, std_normalize=True)
    assert torch.allclose(adv, torch.tensor([0.0, 0.57735, -1.1547, 0.57735]), atol=1e-4)
    adv = group_normalize_rewards(torch.tensor([math.inf, 1.0, 0.0, 1.0, 0.5, 0.5]), 2, std_normalize=True)
    assert torch.allclose(adv, torch.tensor([0.0, 0.0, -0.7071, 0.7071, 0.0, 0.0]), atol=1e-4)


def test_the_rollout_removes_a_sample_with_a_nonfinite_reward_or_log_prob(tiny_hf_checkpoint, tmp_path):
    from miles_platform.rollout.manager import RolloutManager

    cfg = small_run_config(tiny_hf_checkpoint, tmp_path, rollout_batch_size=1, n_samples_per_prompt=4)
    m = RolloutManager(cfg, load_tokenizer(tiny_hf_checkpoint), None, "http://127.0.0.1:9")
    try:
        rows = [(math.nan, [-0.1, -0.2]), (1.0, [-0.1, math.inf]), (0.0, [-0.1, -0.3]), (1.0, [-0.2, -0.2])]
        group = [
            Sample(response_tokens=[5, 6], rollout_log_probs=lps, loss_mask=[1, 1], raw_reward=r)
            for r, lps in rows
        ]
        group[3].loss_mask, group[3].rollout_log_probs = (
            [1, 0],
            [-0.2, -math.inf],
        )  # -inf at a masked token: fine
        samples = m.finalize(0, [group])
        metrics = m._metrics(samples, {}, 0.0)
    finally:
        m.close()
    assert [s.remove_sample for s in samples] == [True, True, False, False]
    assert [s.metadata.get("nonfinite") for s in samples] == ["raw_reward", "rollout_log_probs", None, None]
    assert samples[0].loss_mask == [0, 0] and samples[1].loss_mask == [0, 0]
    assert metrics["rollout/nonfinite_samples"] == 2.0
    assert metrics["rollout/raw_reward"] == pytest.approx(2 / 3)  # the finite rewards' mean
    assert math.isfinite(metrics["rollout/rollout_log_probs"])


@pytest.fixture
def nan_loss(tmp_path, monkeypatch):
    (tmp_path / "nan_losses.py").write_text(
        textwrap.dedent(
            """
            def nan_loss(args, batch, log_probs, entropy=None):
                loss = sum(lp.sum() for lp in log_probs) * float("nan")
                return loss, {"loss": loss.detach()}
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "nan_losses.nan_loss"
    sys.modules.pop("nan_losses", None)


def test_a_nonfinite_loss_skips_the_step_and_keeps_the_weights(tiny_hf_checkpoint, nan_loss):
    from miles_platform.config import RunConfig
    from miles_platform.training.actor import TrainerActor

    cfg = RunConfig(hf_checkpoint=tiny_hf_checkpoint, rollout_batch_size=2, n_samples_per_prompt=2, lr=1e-2,
                    loss_type="custom_loss", custom_loss_function_path=nan_loss).validate()  # fmt: skip
    actor = TrainerActor(cfg)
    before = {k: v.clone() for k, v in actor.get_hf_weights().items()}
    m = actor.train(0, random_train_batch())
    assert m["train/nonfinite_steps"] == 1.0 and m["train/grad_norm"] == 0.0
    after = actor.get_hf_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)  # old code: every weight NaN
    assert all(p.grad is None for p in actor.backend.parameters())


def test_the_run_stops_by_name_past_max_nonfinite_steps(tiny_hf_checkpoint, tmp_path):
    from miles_platform.loop import RLRun
    from miles_platform.run_types import Reporter

    lines = []

    class Log(Reporter):
        def log(self, msg: str) -> None:
            lines.append(msg)

    run = RLRun(small_run_config(tiny_hf_checkpoint, tmp_path, max_nonfinite_steps=1), Log())
    run._check_finite(0, {"train/nonfinite_steps": 0.0})
    run._check_finite(2, {"train/nonfinite_steps": 1.0})
    assert lines == ["rollout 2: 1 optimizer step(s) skipped: non-finite loss or gradient"]
    with pytest.raises(
        NonFiniteTraining,
        match=r"2 optimizer steps .* \(rollouts \[2, 5\]\), more than --max-nonfinite-steps 1",
    ):
        run._check_finite(5, {"train/nonfinite_steps": 1.0})


def test_an_out_of_vocabulary_token_fails_its_sample_only(tiny_hf_checkpoint, tmp_path):
    """A generate function's token id past the embedding stopped the run with a raw IndexError
    (issue #49, item 10): now its sample fails and the batch still trains."""
    from miles_platform.config import RunConfig
    from miles_platform.rollout.manager import RolloutManager
    from miles_platform.training.actor import TrainBatch, TrainerActor

    cfg = small_run_config(tiny_hf_checkpoint, tmp_path, rollout_batch_size=1, n_samples_per_prompt=2)
    tok = load_tokenizer(tiny_hf_checkpoint)
    m = RolloutManager(cfg, tok, None, "http://127.0.0.1:9")
    try:
        group = [
            Sample(prompt_tokens=[5, 6], response_tokens=[7, 10**6], rollout_log_probs=[-0.1, -0.2], loss_mask=[1, 1],
                   raw_reward=1.0),
            Sample(prompt_tokens=[5, 6], response_tokens=[8, 9], rollout_log_probs=[-0.1, -0.2], loss_mask=[1, 1],
                   raw_reward=0.0),
        ]  # fmt: skip
        samples = m.finalize(0, [group])
    finally:
        m.close()
    bad, good = samples
    assert bad.status == "failed" and bad.remove_sample and bad.loss_mask == [0, 0]
    assert bad.metadata["oov_token_ids"] == [10**6] and bad.response_tokens == [7, tok.eos_token_id]
    assert good.status == "completed" and not good.remove_sample
    actor = TrainerActor(
        RunConfig(hf_checkpoint=tiny_hf_checkpoint, rollout_batch_size=1, n_samples_per_prompt=2).validate()
    )
    assert math.isfinite(actor.train(0, TrainBatch.from_samples(samples))["train/loss"])


def test_a_base_checkpoint_with_nan_weights_is_refused_naming_the_tensor(tmp_path):
    """A NaN in the base checkpoint trained nothing and failed late and unclearly (issue #49, item
    12): now the trainer refuses it as it loads, and the run stops with that one line (Ray's
    "actor died" wrapper unwrapped), a CheckpointError the CLI and Dagster treat as final."""
    from safetensors.torch import load_file, save_file

    from miles_platform.errors import CheckpointError
    from miles_platform.loop import train
    from miles_platform.models.tiny import save_tiny_checkpoint

    ckpt = str(save_tiny_checkpoint(tmp_path / "tiny"))
    w = load_file(f"{ckpt}/model.safetensors")
    w["model.norm.weight"][3] = math.nan
    save_file(w, f"{ckpt}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has 1 NaN / inf value\(s\)"):
        train(small_run_config(ckpt, tmp_path))
