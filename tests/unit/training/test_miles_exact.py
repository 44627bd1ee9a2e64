"""The loss hub against Miles' formulas (issue #45): multi-turn GAE, whitening only on request and
after OPD, the value loss, the numerical guards, the reductions, and Miles' correction flags.

Every expected value is computed by hand (written out) or by the float64 reference below, which
is this test's own code, written from Miles' docs and formulas."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_platform.config import ConfigError, RunConfig, parse_run_config
from miles_platform.training.loss import (
    compute_advantages_and_returns,
    normalize_advantages,
    per_token_mean,
    policy_loss_function,
    value_loss,
)

T = torch.tensor


def cfg(**kw) -> RunConfig:
    return RunConfig(rollout_batch_size=1, **kw)


def close(a, b, tol=1e-5) -> bool:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return torch.allclose(a, b, atol=tol, rtol=0)


# ---------------------------------------------------------------------------- float64 references


def ref_gae_on_trainable(reward, values, mask, gamma, lambd, kl_pen=None):
    """GAE over the loss-mask-1 positions only; zeros elsewhere (Miles' multi-turn semantics)."""
    idx = [t for t, m in enumerate(mask) if m]
    adv, ret = [0.0] * len(mask), [0.0] * len(mask)
    last = 0.0
    for j in reversed(range(len(idx))):
        t = idx[j]
        r = (kl_pen[t] if kl_pen else 0.0) + (reward if j == len(idx) - 1 else 0.0)
        nxt = values[idx[j + 1]] if j + 1 < len(idx) else 0.0
        last = r + gamma * nxt - values[t] + gamma * lambd * last
        adv[t], ret[t] = last, last + values[t]
    return adv, ret


def ref_whiten(advs, masks):
    xs = [a for adv, m in zip(advs, masks) for a, k in zip(adv, m) if k]
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return [[(a - mean) / math.sqrt(var + 1e-8) for a in adv] for adv in advs]


# ---------------------------------------------------------------------------- 1. GAE on multi-turn masks


def test_gae_runs_over_trained_tokens_only_as_miles():
    # the input: mask [1,1,0,0,1], V = 0.5, reward 1, gamma 1, lambda 0.5
    # trained positions 0,1,4: deltas [0, 0, 0.5] -> A = [0.125, 0.25, 0.5]; the old code: [0.031, 0.0625, 0.5]
    args = cfg(advantage_estimator="ppo", gamma=1.0, lambd=0.5)
    adv, ret = compute_advantages_and_returns(
        args, T([1.0]), [torch.zeros(5)], None, [torch.full((5,), 0.5)], [T([1.0, 1, 0, 0, 1])]
    )
    assert close(adv[0], [0.125, 0.25, 0.0, 0.0, 0.5])
    assert close(ret[0], [0.625, 0.75, 0.0, 0.0, 1.0])


def test_gae_with_kl_shaping_matches_the_reference_on_random_masks():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        n = int(torch.randint(1, 12, (1,), generator=g))
        mask = (torch.rand(n, generator=g) > 0.4).float()
        values, lp, ref = (torch.randn(n, generator=g) for _ in range(3))
        reward, gamma, lambd = float(torch.rand(1, generator=g)), 0.9, 0.7
        args = cfg(advantage_estimator="ppo", gamma=gamma, lambd=lambd, kl_coef=0.3, kl_loss_type="k1")
        adv, ret = compute_advantages_and_returns(args, T([reward]), [lp], [ref], [values], [mask])
        kl_pen = (-0.3 * (lp - ref)).double().tolist()
        want_adv, want_ret = ref_gae_on_trainable(
            reward, values.double().tolist(), mask.tolist(), gamma, lambd, kl_pen
        )
        assert close(adv[0], want_adv) and close(ret[0], want_ret)


# ---------------------------------------------------------------------------- 2. whitening


def test_reinforce_plus_plus_needs_normalize_advantages_and_advantages_are_unwhitened_before():
    with pytest.raises(ConfigError, match="reinforce_plus_plus needs --normalize-advantages"):
        cfg(advantage_estimator="reinforce_plus_plus").validate()
    with pytest.raises(ConfigError, match="reinforce_plus_plus_baseline needs --normalize-advantages"):
        cfg(advantage_estimator="reinforce_plus_plus_baseline").validate()
    args = cfg(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, gamma=1.0).validate()
    adv, _ = compute_advantages_and_returns(
        args, T([1.0, 0.0]), [torch.zeros(2)] * 2, None, None, [torch.ones(2)] * 2
    )
    assert close(torch.cat(adv), [1.0, 1.0, 0.0, 0.0])  # returns, not whitened by the estimator


def _capture(actor):
    """The advantages the loss sees, per micro-batch call."""
    seen = []
    fn = actor.loss_fn

    def spy(args, batch, log_probs, entropy=None):
        seen.append([a.clone() for a in batch["advantages"]])
        return fn(args, batch, log_probs, entropy)

    actor.loss_fn = spy
    return seen


def _actor(ckpt, **kw):
    from miles_platform.training.actor import TrainerActor

    base = dict(hf_checkpoint=ckpt, rollout_batch_size=2, n_samples_per_prompt=2, lr=1e-3, weight_decay=0.0)
    return TrainerActor(RunConfig(**{**base, **kw}).validate())


@pytest.mark.parametrize("normalize", [False, True])
def test_grpo_is_whitened_only_with_normalize_advantages(tiny_hf_checkpoint, normalize):
    from loop_helpers import random_train_batch

    batch = random_train_batch(rewards=[1.0, 0.0, 0.0, 0.0])
    actor = _actor(tiny_hf_checkpoint, normalize_advantages=normalize)
    seen = _capture(actor)
    actor.train(0, batch)
    got = [a for call in seen for a in call]
    # GRPO: group 1 = [1, 0] -> +-0.7071; group 2 all 0 -> 0 (per token)
    scores = [0.707106, -0.707106, 0.0, 0.0]
    raw = [[s] * n for s, n in zip(scores, batch.response_lengths)]
    want = ref_whiten(raw, batch.loss_masks) if normalize else raw
    for a, w in zip(got, want, strict=True):
        assert close(a, w, tol=1e-4)


def test_opd_penalty_lands_before_whitening(tiny_hf_checkpoint, tmp_path):
    from loop_helpers import random_train_batch

    from miles_platform.models.checkpoint import load_hf_model, load_tokenizer, save_hf_checkpoint
    from miles_platform.models.qwen3 import build_model

    teacher = save_hf_checkpoint(
        build_model(load_hf_model(tiny_hf_checkpoint).config, seed=7),
        load_tokenizer(tiny_hf_checkpoint),
        tmp_path / "t",
    )
    batch = random_train_batch(rewards=[1.0, 0.0, 1.0, 1.0])
    actor = _actor(tiny_hf_checkpoint, advantage_estimator="reinforce_plus_plus", normalize_advantages=True,
                   use_opd=True, opd_type="megatron", opd_teacher_load=str(teacher), opd_kl_coef=0.5)  # fmt: skip
    seen = _capture(actor)
    m = actor.train(0, batch)
    assert abs(m["opd/reverse_kl"]) > 1e-3  # the teacher disagrees: the penalty is not 0
    flat = torch.cat([a for call in seen for a in call]).double()
    # Miles: A <- whiten(A - coef * reverse_kl): zero mean, unit (unbiased) std over the loss tokens
    assert abs(flat.mean().item()) < 1e-5 and abs(flat.std().item() - 1.0) < 1e-4


# ---------------------------------------------------------------------------- 3. value loss


def test_value_loss_is_miles_clipped_form_with_value_clip():
    # v_old 0, v [0.5, -0.05], returns [1, 1], clip 0.1:
    # tok 0: unclipped (0.5-1)^2 = 0.25, clipped (0.1-1)^2 = 0.81 -> 0.81, clipped (|0.5| > 0.1)
    # tok 1: unclipped (-1.05)^2 = 1.1025, clipped the same -> 1.1025, not clipped
    v = [T([0.5, -0.05], requires_grad=True)]
    loss, m = value_loss(cfg(value_clip=0.1), v, [torch.zeros(2)], [torch.ones(2)], [torch.ones(2)])
    assert close(loss, (0.81 + 1.1025) / 2) and close(m["value_clipfrac"], 0.5)
    loss.backward()  # tok 0: the clipped branch has no gradient; tok 1: 2 * (-1.05) / 2
    assert close(v[0].grad, [0.0, -1.05])
    with pytest.raises(ConfigError, match="--value-clip"):
        cfg(value_clip=0.3).validate()  # grpo has no critic


# ---------------------------------------------------------------------------- 4. guards


def _batch(lp_old, adv, masks, rollout=None, ref=None):
    return {
        "advantages": [T(a) for a in adv],
        "old_log_probs": [T(o) for o in lp_old],
        "rollout_log_probs": [T(r) for r in (rollout or lp_old)],
        "ref_log_probs": [T(r) for r in ref] if ref else None,
        "loss_masks": [T(m) for m in masks],
    }


def test_the_ppo_log_ratio_is_clamped_before_exp():
    # log-ratio +25, A = -1: Miles' loss is exp(20) with no gradient (the clamp); unclamped: 7e10
    lp = [T([25.0], requires_grad=True)]
    loss, _ = policy_loss_function(cfg(), _batch([[0.0]], [[-1.0]], [[1.0]]), lp)
    assert abs(loss.item() / math.exp(20.0) - 1) < 1e-6
    loss.backward()
    assert lp[0].grad.item() == 0.0


def test_a_minus_inf_log_prob_at_a_masked_token_leaves_the_loss_finite():
    lp = [T([-0.5, -0.7], requires_grad=True)]
    batch = _batch([[-0.5, -math.inf]], [[1.0, math.nan]], [[1.0, 0.0]], ref=[[-0.4, math.nan]])
    loss, m = policy_loss_function(cfg(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k2"), batch, lp)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(lp[0].grad).all()
    # the masked token is out of the loss: pg -1 (ratio 1, A 1) + 0.1 * k2 of 0.1 (0.005)
    assert close(loss, -1.0 + 0.1 * 0.005) and lp[0].grad[1].item() == 0.0


def test_sequence_level_mask_tis_on_a_long_response_rejects_instead_of_overflowing():
    # 120 tokens at log-ratio +0.8: exp(96) overflows fp32; MIS clamps at exp(20) and rejects the sequence
    n = 120
    args = cfg(use_tis=True, tis_level="sequence", tis_mode="mask", tis_lower_bound=0.5, tis_upper_bound=2.0)
    lp = [torch.zeros(n, requires_grad=True)]
    loss, m = policy_loss_function(
        args, _batch([[0.0] * n], [[1.0] * n], [[1.0] * n], rollout=[[-0.8] * n]), lp
    )
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(lp[0].grad).all()
    assert close(m["mis_tis_mask_fraction_high"], 1.0)


finite = st.floats(-30, 30, allow_nan=False)
masked_value = st.one_of(finite, st.just(-math.inf))


@st.composite
def batches(draw):
    n_samples = draw(st.integers(1, 3))
    out = {"lp": [], "old": [], "rollout": [], "ref": [], "adv": [], "mask": []}
    for _ in range(n_samples):
        n = draw(st.integers(1, 5))
        mask = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n))
        for key in ("lp", "old", "rollout", "ref"):
            out[key].append([draw(masked_value) if not k else draw(finite) for k in mask])
        out["adv"].append(
            [draw(st.one_of(finite, st.just(math.nan))) if not k else draw(finite) for k in mask]
        )
        out["mask"].append(mask)
    return out


CONFIGS = [
    dict(),
    dict(advantage_estimator="gspo"),
    dict(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="low_var_kl", use_unbiased_kl=True),
    dict(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1", calculate_per_token_loss=True),
    dict(use_tis=True, tis_clip=3.0, tis_clip_low=0.1),
    dict(use_tis=True, tis_level="sequence", tis_mode="mask", use_rs=True, rs_veto_threshold=1e-4),
    dict(use_tis=True, tis_level="geometric", tis_mode="clip", tis_lower_bound=0.9, tis_upper_bound=1.1),
    dict(use_tis=True, tis_batch_normalize=True),
    dict(use_opsm=True, get_mismatch_metrics=True, eps_clip_c=3.0),
]


@pytest.mark.parametrize("kw", CONFIGS, ids=[",".join(k) or "default" for k in CONFIGS])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(b=batches())
def test_loss_and_gradient_are_finite_for_any_log_ratio_and_any_masked_value(kw, b):
    args = cfg(**kw).validate()
    lp = [T(x, dtype=torch.float32).requires_grad_() for x in b["lp"]]
    batch = {
        "advantages": [T(a) for a in b["adv"]],
        "old_log_probs": [T(o) for o in b["old"]],
        "rollout_log_probs": [T(r) for r in b["rollout"]],
        "ref_log_probs": [T(r) for r in b["ref"]],
        "loss_masks": [T(m) for m in b["mask"]],
    }
    entropy = [torch.where(T(m) > 0, torch.rand(len(m)), T(math.nan)) for m in b["mask"]]
    loss, metrics = policy_loss_function(args, batch, lp, entropy)
    loss.backward()
    assert math.isfinite(loss.item())
    for x in lp:
        assert torch.isfinite(x.grad).all()
    for k, v in metrics.items():
        assert math.isfinite(float(v)), k


# ---------------------------------------------------------------------------- 5. reductions and metric names


def test_per_token_normalizer_counts_a_fully_masked_sample_as_one_token():
    vals, masks = [T([1.0, 2.0]), T([5.0, 5.0])], [T([1.0, 1.0]), T([0.0, 0.0])]
    assert close(per_token_mean(vals, masks), 3.0 / 3)  # Miles: (1 + 2) / (2 + max(0, 1)); the old code: 1.5


def test_tis_metrics_are_the_ratio_before_the_clamp_reduced_like_the_loss():
    # sample A: 1 token at ratio 4; sample B: 3 tokens at ratio 1. Per-sample mean: (4 + 1) / 2 = 2.5
    # (a token mean would be 7/4 = 1.75); weights clamp to 2: pg = -(2 + 1) / 2 = -1.5
    batch = _batch(
        [[math.log(4.0)], [0.0] * 3], [[1.0], [1.0] * 3], [[1.0], [1.0] * 3], rollout=[[0.0], [0.0] * 3]
    )
    lp = [T([math.log(4.0)]), torch.zeros(3)]
    loss, m = policy_loss_function(cfg(use_tis=True), batch, lp)
    assert close(m["tis"], 2.5) and close(m["tis_clipfrac"], 0.5) and close(loss, -1.5)


# ---------------------------------------------------------------------------- Miles' correction flags


def test_unbiased_kl_weights_the_kl_by_pi_over_pi_old():
    # log pi = ln 0.5, old = ln 0.25 (ratio 2), ref = ln 0.25: k1 = ln 2; unbiased: 2 ln 2
    args = cfg(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k1", use_unbiased_kl=True)
    lp = [T([math.log(0.5)])]
    b = _batch([[math.log(0.25)]], [[0.0]], [[1.0]], ref=[[math.log(0.25)]])
    _, m = policy_loss_function(args, b, lp)
    assert close(m["kl_loss"], 2 * math.log(2))
    with pytest.raises(ConfigError, match="--use-unbiased-kl"):
        cfg(use_unbiased_kl=True).validate()


def test_opsm_masks_negative_advantages_of_sequences_that_drifted():
    # sample A: seq kl = old - new = 0.5 > delta, A = -1 -> masked; sample B: same drift, A = +1 -> kept
    args = cfg(use_opsm=True, opsm_delta=0.1, eps_clip=10.0)
    lp = [T([-1.0, -1.0]), T([-1.0, -1.0])]
    b = _batch([[-0.5, -0.5], [-0.5, -0.5]], [[-1.0, -1.0], [1.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]])
    loss, m = policy_loss_function(args, b, lp)
    ratio = math.exp(-0.5)
    assert close(m["opsm_clipfrac"], 0.5) and close(loss, (0.0 - ratio) / 2)


def test_rejection_keeps_the_denominator_and_the_veto_drops_the_sequence():
    # token ratios [1, 8]: RS (token, bounds 0.5-2) rejects token 2; pg = (-1 + 0) / 2 (denominator 2, as Miles)
    args = cfg(use_tis=True, use_rs=True, tis_upper_bound=10.0, rs_upper_bound=2.0, rs_lower_bound=0.5)
    b = _batch([[0.0, math.log(8.0)]], [[1.0, 1.0]], [[1.0, 1.0]], rollout=[[0.0, 0.0]])
    loss, m = policy_loss_function(args, b, [T([0.0, math.log(8.0)])])
    assert close(loss, -1.0 / 2) and close(m["mis_rs_mask_fraction_high"], 0.5)
    # a token at ratio 1e-5 < the veto threshold 1e-4 rejects its whole sequence
    args = cfg(use_tis=True, use_rs=True, rs_veto_threshold=1e-4, rs_lower_bound=0.0, rs_upper_bound=1e9)
    b = _batch([[0.0, math.log(1e-5)]], [[1.0, 1.0]], [[1.0, 1.0]], rollout=[[0.0, 0.0]])
    loss, m = policy_loss_function(args, b, [T([0.0, math.log(1e-5)])])
    assert loss.item() == 0.0 and close(m["mis_rs_catastrophic_seq_fraction"], 1.0)


def test_tis_batch_normalize_makes_the_mean_weight_one():
    args = cfg(use_tis=True, tis_batch_normalize=True, tis_upper_bound=10.0)
    b = _batch([[math.log(2.0), math.log(4.0)]], [[1.0, 1.0]], [[1.0, 1.0]], rollout=[[0.0, 0.0]])
    _, m = policy_loss_function(args, b, [T([math.log(2.0), math.log(4.0)])])
    assert close(m["mis_batch_norm_factor"], 3.0) and close(m["mis_is_ratio_mean_final"], 1.0)


def test_mismatch_metrics_alone_leave_the_loss_unchanged():
    b = _batch([[-0.2, -0.4]], [[1.0, -0.5]], [[1.0, 1.0]], rollout=[[-0.3, -0.1]])
    lp = [T([-0.25, -0.35])]
    plain, _ = policy_loss_function(cfg(), b, lp)
    loss, m = policy_loss_function(cfg(get_mismatch_metrics=True), b, lp)
    assert loss.item() == plain.item()
    # mis_kl = mean(rollout - train) = ((-0.3 + 0.2) + (-0.1 + 0.4)) / 2 = 0.1
    assert close(m["mis_kl"], 0.1) and "mis_tis_weight_before_bound" not in m and "ois" in m


def test_disable_rewards_normalization_feeds_raw_rewards():
    args = cfg(n_samples_per_prompt=2, disable_rewards_normalization=True)
    adv, _ = compute_advantages_and_returns(
        args, T([1.0, 0.0]), [torch.zeros(1)] * 2, None, None, [torch.ones(1)] * 2
    )
    assert close(torch.cat(adv), [1.0, 0.0])
    # ... and --normalize-advantages whitens any estimator, GRPO included
    assert close(torch.cat(normalize_advantages(adv, [torch.ones(1)] * 2)), [0.707107, -0.707107])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--use-tis", "--use-rollout-logprobs"], "--use-rollout-logprobs with --use-tis"),
        (["--tis-mode", "mask"], "--tis-mode: act only with --use-tis"),
        (["--use-tis", "--rs-veto-threshold", "1e-4"], "--rs-veto-threshold: are bounds of --use-rs"),
        (["--use-tis", "--tis-mode", "clip", "--tis-clip", "3"], "--tis-clip: bound the built-in TIS"),
        (["--get-mismatch-metrics", "--tis-mode", "mask"], "--tis-mode: weight the loss"),
        (["--opsm-delta", "0.1"], "--opsm-delta: needs --use-opsm"),
        (["--use-tis", "--tis-clip-low", "3"], "--tis-clip-low 3.0 > --tis-clip 2.0"),
        (["--use-tis", "--tis-level", "geometric", "--tis-batch-normalize"], "not --tis-level geometric"),
    ],
)
def test_correction_flags_without_effect_are_refused_by_name(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_run_config(["--rollout-batch-size", "1", *argv]).validate()


def test_miles_mis_path_resolves_to_ours():
    from miles_platform.plugins import load_function
    from miles_platform.training.mis import compute_mis_weights_with_cp

    for v in ("with_cp", "fsdp"):
        path = f"examples.infra_features.train_infer_mismatch_helper.mis.compute_mis_weights_{v}"
        assert load_function(path, "--custom-tis-function-path") is compute_mis_weights_with_cp
    args = parse_run_config(
        ["--rollout-batch-size", "1", "--use-tis", "--custom-tis-function-path",
         "examples.infra_features.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"]
    ).validate()  # fmt: skip
    b = _batch([[math.log(3.0)]], [[1.0]], [[1.0]], rollout=[[0.0]])
    _, m = policy_loss_function(args, b, [T([math.log(3.0)])])
    assert close(m["mis_tis_weight_after_bound"], 2.0)  # MIS truncate at its upper bound 2
