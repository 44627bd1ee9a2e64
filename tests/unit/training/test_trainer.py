"""Trainer actor (in-process, no Ray): step-0 invariants, learning signal, exact resume."""

import torch
from loop_helpers import random_train_batch

from miles_platform.config import RunConfig
from miles_platform.training.actor import TrainerActor
from miles_platform.training.checkpoint import read_latest


def _cfg(ckpt, save, **kw):
    base = dict(
        hf_checkpoint=ckpt,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        global_batch_size=4,
        lr=1e-3,
        save=save,
        num_rollout=4,
        micro_batch_size=2,
    )
    base.update(kw)
    return RunConfig(**base).validate()


def _batch(seed=0):
    return random_train_batch(seed, rewards=[1.0, 0.0, 0.0, 1.0])


def _weights(actor):
    return {k: v.clone() for k, v in actor.get_hf_weights().items()}


def test_step0_ratio_is_exactly_one_and_weights_move(tiny_hf_checkpoint, tmp_path):
    actor = TrainerActor(_cfg(tiny_hf_checkpoint, str(tmp_path / "ck")))
    before = _weights(actor)
    m = actor.train(0, _batch())
    assert abs(m["train/step0_ppo_kl"]) < 1e-9
    assert m["train/step0_pg_clipfrac"] < 1e-10
    assert m["train/grad_norm"] > 0
    after = _weights(actor)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_advantage_sign_raises_rewarded_logprobs(tiny_hf_checkpoint, tmp_path):
    actor = TrainerActor(_cfg(tiny_hf_checkpoint, str(tmp_path / "ck"), lr=3e-3, clip_grad=10.0))
    b = _batch(1)
    lp0 = actor.compute_log_probs(b)
    for r in range(5):
        actor.train(r, b)
    lp1 = actor.compute_log_probs(b)
    delta = [sum(a) / len(a) - sum(c) / len(c) for a, c in zip(lp1, lp0, strict=True)]
    # samples 0 and 3 were rewarded: their log-probs rise relative to the unrewarded ones
    assert delta[0] > delta[1] and delta[3] > delta[2]


def test_resume_is_exact(tiny_hf_checkpoint, tmp_path):
    save = str(tmp_path / "ck")
    a = TrainerActor(_cfg(tiny_hf_checkpoint, save))
    a.train(0, _batch(0))
    a.save(0, {"weight_version": 1, "data_source": {"epoch": 0, "offset": 2}})
    assert read_latest(save) == 0
    a.train(1, _batch(1))
    b = TrainerActor(_cfg(tiny_hf_checkpoint, save))
    state = b.load()
    assert state["rollout_id"] == 0 and state["weight_version"] == 1 and state["data_source"]["offset"] == 2
    b.train(1, _batch(1))
    wa, wb = _weights(a), _weights(b)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_ppo_critic_learns_returns_and_resumes(tiny_hf_checkpoint, tmp_path):
    save = str(tmp_path / "ck")
    cfg = _cfg(tiny_hf_checkpoint, save, advantage_estimator="ppo", lr=1e-3, critic_lr=1e-2)
    a = TrainerActor(cfg)
    losses = [a.train(r, _batch(0))["train/value_loss"] for r in range(6)]
    assert losses[-1] < 0.5 * losses[0]  # the value head fits the (fixed) returns
    a.save(5, {"weight_version": 6, "data_source": {}})
    b = TrainerActor(_cfg(tiny_hf_checkpoint, save, advantage_estimator="ppo", lr=1e-3, critic_lr=1e-2))
    b.load()
    ma, mb = a.train(6, _batch(1)), b.train(6, _batch(1))
    assert ma["train/value_loss"] == mb["train/value_loss"]
    for k, v in a.critic.state_dict().items():
        assert torch.equal(v, b.critic.state_dict()[k]), k


def test_kl_loss_against_frozen_reference(tiny_hf_checkpoint, tmp_path):
    """--use-kl-loss: KL to the reference is 0 while policy == reference and grows as the policy moves."""
    actor = TrainerActor(
        _cfg(
            tiny_hf_checkpoint,
            str(tmp_path / "ck"),
            use_kl_loss=True,
            kl_loss_coef=0.1,
            kl_loss_type="low_var_kl",
        )
    )
    first = actor.train(0, _batch(0))
    assert first["train/kl_loss"] == 0.0  # the first step runs before any update: policy == reference
    later = [actor.train(r, _batch(0))["train/kl_loss"] for r in range(1, 4)]
    assert later[-1] > 0.0
    ref = {k: v for k, v in actor.ref.export_hf_state_dict().items()}
    base = TrainerActor(_cfg(tiny_hf_checkpoint, str(tmp_path / "ck2"))).get_hf_weights()
    assert all(torch.equal(ref[k], base[k]) for k in base)  # the reference never trains


def test_old_log_probs_from_the_training_forward_train_exactly_like_a_separate_pass(
    tiny_hf_checkpoint, tmp_path, monkeypatch
):
    """One step per rollout: the fused path (old = the training forward's own log-probs, detached)
    gives the same loss, metrics and weights as the separate no-grad pass it replaces."""
    fused = TrainerActor(_cfg(tiny_hf_checkpoint, str(tmp_path / "a")))
    separate = TrainerActor(_cfg(tiny_hf_checkpoint, str(tmp_path / "b")))
    assert fused._old_log_probs_from_training_forward()
    monkeypatch.setattr(separate, "_old_log_probs_from_training_forward", lambda: False)
    calls = {"n": 0}
    real = separate._all_log_probs

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(separate, "_all_log_probs", counting)
    for rid in range(2):
        ma, mb = fused.train(rid, _batch(rid)), separate.train(rid, _batch(rid))
        for k in ("train/loss", "train/pg_loss", "train/ppo_kl", "train/train_rollout_logprob_abs_diff"):
            assert abs(ma[k] - mb[k]) < 1e-6, (k, ma[k], mb[k])
    assert calls["n"] == 2  # the separate path ran its extra forward each rollout
    wa, wb = _weights(fused), _weights(separate)
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)
    assert any(not torch.equal(wa[k], _weights(TrainerActor(_cfg(tiny_hf_checkpoint, str(tmp_path / "c"))))[k])
               for k in wa)  # fmt: skip
    # --ci-test keeps the independent pass on the first step only
    ci = TrainerActor(_cfg(tiny_hf_checkpoint, str(tmp_path / "d"), ci_test=True))
    assert not ci._old_log_probs_from_training_forward()
    ci.train(0, _batch(0))
    assert ci._old_log_probs_from_training_forward()
    several = TrainerActor(_cfg(tiny_hf_checkpoint, str(tmp_path / "e"), global_batch_size=2))
    assert not several._old_log_probs_from_training_forward()  # 2 steps per rollout


def test_rank_fault_hooks_fire_inside_the_rank_with_its_rollout_id(tiny_hf_checkpoint, tmp_path, capsys):
    import json

    import pytest

    from miles_platform.fault_hooks import FaultInjected

    hooks = [
        {"request_id": "g", "hook_name": "trainer_weight_update_before_all_gather",
         "action": {"kind": "raise", "message": "gather"}, "rollout_id": 0},
        {"request_id": "s", "hook_name": "trainer_step_before_allreduce",
         "action": {"kind": "raise", "message": "step"}, "rollout_id": 1},
        {"request_id": "r1", "hook_name": "trainer_step_before_allreduce", "action": {"kind": "raise"},
         "target": {"rank": 1}},  # another rank's
    ]  # fmt: skip
    actor = TrainerActor(_cfg(tiny_hf_checkpoint, str(tmp_path / "ck"), ci_fault_hooks=json.dumps(hooks)))
    _weights(actor)  # rollout -1 (the initial sync): nothing due
    actor.train(0, _batch())  # "s" is rollout 1's, "r1" rank 1's
    with pytest.raises(FaultInjected, match="gather"):
        actor.get_hf_weights()  # rollout 0's weight update
    before = _weights(actor)  # once only
    with pytest.raises(FaultInjected, match="step"):
        actor.train(1, _batch(1))
    after = _weights(actor)
    assert all(torch.equal(before[k], after[k]) for k in before)  # it fired before the optimizer step
    err = capsys.readouterr().err
    assert (
        "[ci-fault-hooks] g: raise at trainer_weight_update_before_all_gather, rollout 0 in TrainerActor rank 0"
        in err
    )
    assert (
        "[ci-fault-hooks] s: raise at trainer_step_before_allreduce, rollout 1 in TrainerActor rank 0" in err
    )
    assert "r1:" not in err


def test_per_sample_windows_are_one_gather_with_the_slices_values_and_gradients():
    """A micro-batch's per-sample response windows (position j scores token j + 1): the values and
    gradients of slicing each sample, from one gather and split (two autograd nodes for the
    micro-batch: a slice per sample cost the backward ~60 us a sample, ~5% of the demo's SFT step)."""
    from types import SimpleNamespace

    from miles_platform.training.backend import Scores

    g = torch.Generator().manual_seed(0)
    batch = SimpleNamespace(tokens=[[1] * n for n in (9, 5, 7, 9)], response_lengths=[3, 1, 4, 2])
    idx = [2, 0, 3]  # a micro-batch of the batch's samples 2, 0, 3, padded to width 9
    lp = torch.randn(3, 8, generator=g, requires_grad=True)
    ent = torch.randn(3, 8, generator=g)
    cand = torch.randn(3, 8, 4, generator=g)
    lps, ents, cands = TrainerActor._per_sample(batch, idx, Scores(lp, ent, cand))
    want = [slice(2, 6), slice(5, 8), slice(6, 8)]  # [total - response - 1, total - 1)
    for r, (w, got) in enumerate(zip(want, lps, strict=True)):
        assert (
            torch.equal(got, lp[r, w])
            and torch.equal(ents[r], ent[r, w])
            and torch.equal(cands[r], cand[r, w])
        )
    upstream = [torch.randn(x.shape, generator=g) for x in lps]
    (grad,) = torch.autograd.grad(lps, lp, upstream)
    ref = lp.detach().clone().requires_grad_()
    (want_grad,) = torch.autograd.grad([ref[r, w] for r, w in enumerate(want)], ref, upstream)
    assert torch.equal(grad, want_grad)
    assert len({x.grad_fn for x in lps}) == 1  # one node for the micro-batch, not one per sample
