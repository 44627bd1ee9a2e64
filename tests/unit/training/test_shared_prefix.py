"""Shared-prefix packing (training/shared_prefix.py): a prompt's samples share one forward of it, and
every score and gradient is the padded layout's."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from miles_platform.config import RunConfig
from miles_platform.training.shared_prefix import model_shares_prefixes, pack_shared_prefixes


def _rows(prompts: int = 4, group: int = 4, seed: int = 0, vocab: int = 100):
    """Right-padded rows of `prompts` groups of `group` samples: (seqs, prompt lens, width)."""
    rng = random.Random(seed)
    seqs, plens = [], []
    for _ in range(prompts):
        p = rng.randint(3, 7)
        prompt = [rng.randrange(1, vocab) for _ in range(p)]
        for _ in range(group):
            seqs.append(prompt + [rng.randrange(1, vocab) for _ in range(rng.randint(1, 6))])
            plens.append(p)
    return seqs, plens, max(map(len, seqs))


def test_each_padded_position_reads_its_own_token_in_the_packed_rows():
    seqs, plens, width = _rows()
    packed = pack_shared_prefixes(seqs, plens, width)
    assert packed is not None and packed.input_ids.shape[0] == 4  # a row per prompt
    flat_ids, flat_pos = packed.input_ids.reshape(-1), packed.position_ids.reshape(-1)
    index = packed.index.view(len(seqs), width)
    for i, s in enumerate(seqs):
        at = index[i, : len(s)]
        assert flat_ids[at].tolist() == s  # the same token
        assert flat_pos[at].tolist() == list(range(len(s)))  # at the same position
        # a token attends to exactly the tokens before it in its own padded row
        g, q = divmod(int(at[-1]), packed.input_ids.shape[1])
        seen = packed.keep[g, 0, q].nonzero().flatten()
        assert sorted((seen + g * packed.input_ids.shape[1]).tolist()) == sorted(at.tolist())


def test_nothing_to_share_keeps_the_padded_layout():
    seqs, plens, width = _rows(prompts=8, group=1)
    assert pack_shared_prefixes(seqs, plens, width) is None  # every prompt once: no saving
    seqs, plens, width = _rows()
    assert pack_shared_prefixes(seqs, [0] * len(seqs), width) is None  # no prompt
    # pairs sharing a 1-token prompt, long responses of one length: 38 positions for 40, under MIN_SAVING
    pairs = [[p, *range(10 * k, 10 * k + 9)] for p in (5, 6) for k in (1, 2)]
    assert pack_shared_prefixes(pairs, [1] * 4, 10) is None
    four = [[7, 8, 9, *range(10 * k, 10 * k + 7)] for k in (1, 2, 3, 4)]
    assert pack_shared_prefixes(four, [3] * 4, 10) is not None  # a 3-token prompt 4 times: 31 for 40


def test_model_families_that_attend_only_through_the_mask():
    from miles_platform.models.families import tiny_config
    from miles_platform.models.qwen3 import tiny_qwen3_config

    dense = tiny_qwen3_config(64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    dense._attn_implementation = "sdpa"
    assert model_shares_prefixes(dense)
    dense._attn_implementation = "eager"
    assert not model_shares_prefixes(dense)  # an additive mask of its own: not built here
    moe = tiny_config("qwen3_moe", 64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    moe._attn_implementation = "sdpa"
    assert not model_shares_prefixes(moe)  # load balancing counts every token
    dense._attn_implementation = "sdpa"
    dense.layer_types = ["sliding_attention", "full_attention"]
    assert not model_shares_prefixes(dense)


def _backend(ckpt: str):
    from miles_platform.training.fsdp_backend import FSDPBackend

    be = FSDPBackend(RunConfig(hf_checkpoint=ckpt, rollout_batch_size=1).validate())
    be.build(ckpt)
    return be


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_packed_scores_and_gradients_are_the_padded_ones(tmp_path, family):
    """Each family that packs (DENSE_FULL_ATTENTION). Fails with a mask that lets a response see
    another's tokens, positions that do not restart, or a gather off by one: each changes the
    log-probs at 1e-2 or more."""
    from miles_platform.models.tiny import save_tiny_checkpoint
    from miles_platform.training.backend import ScoreRequest

    be = _backend(save_tiny_checkpoint(tmp_path / family, family))
    assert be.shares_prefixes
    seqs, plens, width = _rows(vocab=be.module.config.vocab_size)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    pos = torch.arange(width).expand(len(seqs), -1)
    packed = pack_shared_prefixes(seqs, plens, width)
    assert packed is not None

    def scored(req):
        be.module.zero_grad()
        lp = be.score(req).log_probs
        real = torch.zeros_like(lp, dtype=torch.bool)
        for i, s in enumerate(seqs):
            real[i, : len(s) - 1] = True
        (lp[real] * torch.linspace(0.5, 1.5, int(real.sum()))).sum().backward()
        return lp[real].detach(), [p.grad.clone() for p in be.module.parameters()]

    lp0, g0 = scored(ScoreRequest(ids, pos))
    lp1, g1 = scored(ScoreRequest(ids, pos, packed=packed))
    torch.testing.assert_close(lp1, lp0, atol=2e-5, rtol=0)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("extra", [{}, {"use_kl_loss": True, "kl_loss_coef": 0.1}])
def test_a_train_step_packed_is_the_padded_step(tiny_hf_checkpoint, extra):
    """The trainer packs a rollout's groups (its forwards go through packed_logits) and its step's
    loss, gradient norm and weights are the padded step's; with the reference model's forward too."""
    from miles_platform.training.actor import TrainBatch, TrainerActor

    seqs, plens, _ = _rows(prompts=2, group=4, seed=1, vocab=60)
    resp = [len(s) - p for s, p in zip(seqs, plens, strict=True)]
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    batch = TrainBatch(seqs, resp, [[1] * n for n in resp], rewards, [[-2.0] * n for n in resp])
    got = {}
    for share in (True, False):
        cfg = RunConfig(hf_checkpoint=tiny_hf_checkpoint, rollout_batch_size=2, n_samples_per_prompt=4,
                        micro_batch_size=8, optimizer="sgd", lr=0.5, weight_decay=0.0, **extra).validate()  # fmt: skip
        actor = TrainerActor(cfg)
        actor.share_prefixes = share
        calls = []
        real = actor.backend.packed_logits
        actor.backend.packed_logits = lambda packed, real=real, calls=calls: (
            calls.append(packed) or real(packed)
        )
        m = actor.train(0, batch)
        weights = {n: p.detach().clone() for n, p in actor.backend.module.named_parameters()}
        got[share] = (m, weights, len(calls))
    (m1, w1, n1), (m0, w0, n0) = got[True], got[False]
    assert n1 >= 1 and n0 == 0
    for k in ("train/loss", "train/pg_loss", "train/grad_norm", "train/kl_loss"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-7), k
    for n in w0:  # SGD: the weights moved by lr x the gradient, packed as padded
        torch.testing.assert_close(w1[n], w0[n], atol=1e-6, rtol=0)


def test_a_packed_step_runs_on_the_ranks_device(tiny_hf_checkpoint):
    """The packed rows, their mask and the gather index live on the rank's device
    (tests/device_check.py's fake one: a CPU tensor meeting device tensors fails the op, as on a GPU),
    and the step there is the CPU's."""
    from device_check import fake_device, on_device

    from miles_platform.training.actor import TrainBatch, TrainerActor

    seqs, plens, _ = _rows(prompts=2, group=4, seed=1, vocab=60)
    resp = [len(s) - p for s, p in zip(seqs, plens, strict=True)]
    batch = TrainBatch(seqs, resp, [[1] * n for n in resp], [1.0, 0.0] * 4, [[-2.0] * n for n in resp])
    cfg = RunConfig(hf_checkpoint=tiny_hf_checkpoint, rollout_batch_size=2, n_samples_per_prompt=4,
                    micro_batch_size=8, lr=1e-3).validate()  # fmt: skip
    got = {}
    for where in ("device", "cpu"):
        with fake_device() if where == "device" else contextlib.nullcontext("cpu") as dev:
            actor = TrainerActor(cfg, device=dev)
            seen = []
            real = actor.backend.packed_logits
            actor.backend.packed_logits = lambda packed, real=real, seen=seen: (
                seen.append(packed) or real(packed)
            )
            got[where] = actor.train(0, batch)
            assert seen, "the step did not pack"
            if where == "device":
                for name in ("input_ids", "position_ids", "keep", "index"):
                    assert on_device(getattr(seen[0], name)), name
    for k in ("train/loss", "train/grad_norm"):
        assert got["device"][k] == pytest.approx(got["cpu"][k], rel=1e-5, abs=1e-7), k
