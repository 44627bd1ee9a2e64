"""Loss hub: every formula against a hand-computed example (numbers written out)."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch

from miles_platform.config import ConfigError, RunConfig
from miles_platform.training.loss import (
    compute_advantages_and_returns,
    compute_approx_kl,
    compute_policy_loss,
    entropy_from_logits,
    gae,
    get_loss_function,
    mask_counts,
    normalize_advantages,
    per_token_mean,
    policy_loss_function,
    sft_loss_function,
    sum_of_sample_mean,
)
from miles_platform.training.mis import compute_mis_weights

T = torch.tensor


def cfg(**kw) -> RunConfig:
    return RunConfig(rollout_batch_size=1, **kw)


def close(a, b, tol=1e-5):
    return torch.allclose(
        torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol
    )


def ones(*lens):
    return [torch.ones(n) for n in lens]


# ---------------------------------------------------------------------------- advantages


def test_grpo_group_1001():
    # mean 0.5, unbiased std sqrt(1/3) = 0.577350 -> +-0.5 / 0.577351 = +-0.866024
    args = cfg(advantage_estimator="grpo", n_samples_per_prompt=4)
    adv, _ = compute_advantages_and_returns(
        args, T([1.0, 0, 0, 1]), ones(2, 2, 2, 2), None, None, ones(2, 2, 2, 2)
    )
    assert close(torch.stack(adv), T([[0.866024] * 2, [-0.866024] * 2, [-0.866024] * 2, [0.866024] * 2]))


def test_grpo_two_groups_and_zero_std_group():
    args = cfg(advantage_estimator="gspo", n_samples_per_prompt=2)
    adv, _ = compute_advantages_and_returns(
        args, T([1.0, 0, 1, 1]), ones(1, 1, 1, 1), None, None, ones(1, 1, 1, 1)
    )
    # group 1: +-0.5 / (0.707107 + 1e-6) = +-0.707106; group 2: all equal -> 0
    assert close(torch.cat(adv), T([0.707106, -0.707106, 0.0, 0.0]))


def test_grpo_std_normalization_off():
    args = cfg(advantage_estimator="grpo", n_samples_per_prompt=4, disable_grpo_std_normalization=True)
    adv, _ = compute_advantages_and_returns(
        args, T([1.0, 0, 0, 1]), ones(1, 1, 1, 1), None, None, ones(1, 1, 1, 1)
    )
    assert close(torch.cat(adv), T([0.5, -0.5, -0.5, 0.5]))


def test_grpo_rejects_partial_group():
    args = cfg(advantage_estimator="grpo", n_samples_per_prompt=4)
    with pytest.raises(ValueError, match="groups of --n-samples-per-prompt=4"):
        compute_advantages_and_returns(args, T([1.0, 0, 0]), ones(1, 1, 1), None, None, ones(1, 1, 1))


def test_gae_three_tokens():
    # gamma 0.9, lambda 0.8, rewards [0, 0, 1], values [0.5, 0.6, 0.7]
    # t=2: delta = 1 - 0.7 = 0.3                  A2 = 0.3
    # t=1: delta = 0.9*0.7 - 0.6 = 0.03           A1 = 0.03 + 0.72*0.3   = 0.246
    # t=0: delta = 0.9*0.6 - 0.5 = 0.04           A0 = 0.04 + 0.72*0.246 = 0.21712
    adv, ret = gae(T([0.0, 0, 1]), T([0.5, 0.6, 0.7]), gamma=0.9, lambd=0.8)
    assert close(adv, T([0.21712, 0.246, 0.3]))
    assert close(ret, T([0.71712, 0.846, 1.0]))


def test_ppo_estimator_gae_then_whitening_only_when_asked():
    args = cfg(advantage_estimator="ppo", gamma=0.9, lambd=0.8)
    adv, ret = compute_advantages_and_returns(
        args, T([1.0]), [torch.zeros(3)], None, [T([0.5, 0.6, 0.7])], ones(3)
    )
    assert close(ret[0], T([0.71712, 0.846, 1.0]))
    assert close(adv[0], T([0.21712, 0.246, 0.3]))  # Miles whitens only with --normalize-advantages
    # whiten [0.21712, 0.246, 0.3]: mean 0.254373, deviations [-0.037253, -0.008373, 0.045627],
    # unbiased var 0.0035397 / 2 -> std 0.042070
    assert close(normalize_advantages(adv, ones(3))[0], T([-0.88550, -0.19903, 1.08455]), tol=1e-4)
    with pytest.raises(ConfigError, match="ppo needs critic values"):
        compute_advantages_and_returns(args, T([1.0]), [torch.zeros(3)], None, None, ones(3))


def test_reinforce_plus_plus_returns_with_kl_penalty():
    # k1 KL = [0.1, 0.2, 0.0], kl_coef 0.1 -> token rewards [-0.01, -0.02, 0 + 1.0]; gamma 0.5:
    # G2 = 1.0; G1 = -0.02 + 0.5*1.0 = 0.48; G0 = -0.01 + 0.5*0.48 = 0.23
    args = cfg(
        advantage_estimator="reinforce_plus_plus",
        kl_coef=0.1,
        kl_loss_type="k1",
        gamma=0.5,
        normalize_advantages=True,
    )
    lp, ref = [T([0.1, 0.2, 0.0]) - 1.0], [T([0.0, 0.0, 0.0]) - 1.0]
    adv, ret = compute_advantages_and_returns(args, T([1.0]), lp, ref, None, ones(3))
    assert close(ret[0], T([0.23, 0.48, 1.0])) and close(adv[0], ret[0])
    adv = normalize_advantages(adv, ones(3))
    assert close(adv[0].mean(), 0.0) and close(adv[0].std(), 1.0, tol=1e-4)
    # reward lands on the last *unmasked* token
    _, ret = compute_advantages_and_returns(args, T([1.0]), lp, ref, None, [T([1.0, 1.0, 0.0])])
    assert close(ret[0], T([0.48, 0.98, 0.0]))  # G1 = -0.02 + 1.0, G0 = -0.01 + 0.5*0.98
    # a response without tokens beside it (an abort before the first): empty, the others as before
    # (it raised IndexError for the whole batch, where grpo trains it)
    empty = torch.zeros(0)
    adv, ret = compute_advantages_and_returns(args, T([1.0, 1.0]), [lp[0], empty], [ref[0], empty], None,
                                              [ones(3)[0], empty])  # fmt: skip
    assert close(ret[0], T([0.23, 0.48, 1.0])) and ret[1].numel() == 0 and adv[1].numel() == 0


def test_reinforce_plus_plus_baseline():
    args = cfg(
        advantage_estimator="reinforce_plus_plus_baseline", n_samples_per_prompt=4, normalize_advantages=True
    )
    lp = [torch.zeros(1)] * 4
    adv, _ = compute_advantages_and_returns(args, T([1.0, 0, 0, 0]), lp, None, None, ones(1, 1, 1, 1))
    assert close(torch.cat(adv), T([0.75, -0.25, -0.25, -0.25]))  # group mean 0.25 removed
    # whitened: mean 0, unbiased std 0.5 -> [1.5, -0.5, -0.5, -0.5]
    assert close(torch.cat(normalize_advantages(adv, ones(1, 1, 1, 1))), T([1.5, -0.5, -0.5, -0.5]), tol=1e-4)


# ---------------------------------------------------------------------------- policy loss


def _pg(ratios, adv, **kw):
    lp = [torch.log(T(ratios))]
    return compute_policy_loss(lp, [torch.zeros(len(ratios))], [T(adv)], ones(len(ratios)), **kw)


def test_clipped_surrogate_and_clipfrac():
    # eps 0.2: band [0.8, 1.2]
    # r=1.1 A=+1: max(-1.1, -1.1) = -1.1  no clip
    # r=1.3 A=+1: max(-1.3, -1.2) = -1.2  clipped
    # r=0.7 A=-1: max( 0.7,  0.8) =  0.8  clipped
    # r=0.9 A=-1: max( 0.9,  0.9) =  0.9  no clip
    # r=0.7 A=+1: max(-0.7, -0.8) = -0.7  outside the band but the unclipped term wins: no clip
    pg, clip, kl = _pg([1.1, 1.3, 0.7, 0.9, 0.7], [1.0, 1, -1, -1, 1], eps_clip=0.2)
    assert close(pg[0], T([-1.1, -1.2, 0.8, 0.9, -0.7]))
    assert clip[0].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert close(kl[0], -torch.log(T([1.1, 1.3, 0.7, 0.9, 0.7])))  # ppo_kl = old - new


def test_asymmetric_clip_high():
    pg, clip, _ = _pg([1.3], [1.0], eps_clip=0.2, eps_clip_high=0.28)
    assert close(pg[0], T([-1.28])) and clip[0].tolist() == [1.0]


def test_ratio_one_means_no_kl_no_clip():
    pg, clip, kl = _pg([1.0, 1.0, 1.0], [2.0, -1.0, 0.5], eps_clip=0.2)
    assert close(pg[0], T([-2.0, 1.0, -0.5]))
    assert clip[0].sum() == 0 and kl[0].abs().sum() == 0


def test_dual_clip():
    # A=-1, eps_clip_c=3: r=5 -> max(5, 1.2) = 5 -> min(5, 3) = 3; r=2 -> 2 (under the cap)
    # A=+1 untouched: r=5 -> max(-5, -1.2) = -1.2
    pg, _, _ = _pg([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0], eps_clip=0.2, eps_clip_c=3.0)
    assert close(pg[0], T([3.0, 2.0, -1.2]))


def test_gspo_sequence_ratio():
    # masked mean of log-ratios = ln(1.5)/2 -> ratio sqrt(1.5) = 1.224745 > 1.2 with A=+1: all clipped
    lp = [T([math.log(1.5), 0.0, 5.0])]
    pg, clip, kl = compute_policy_loss(
        lp, [torch.zeros(3)], [T([1.0, 1.0, 1.0])], [T([1.0, 1.0, 0.0])], eps_clip=0.2, sequence_level=True
    )
    # the masked token carries no advantage and no ppo_kl (Miles' torch.where on inactive tokens)
    assert close(pg[0], T([-1.2, -1.2, 0.0])) and clip[0].tolist() == [1.0, 1.0, 0.0]
    assert close(kl[0], T([-0.202733, -0.202733, 0.0]))  # -ln(1.5)/2


# ---------------------------------------------------------------------------- KL / entropy / reductions


@pytest.mark.parametrize(
    "kind, expected",
    # r = ln(0.5) - ln(0.25) = ln 2 = 0.693147
    [("k1", 0.693147), ("k2", 0.240227), ("k3", 0.193147), ("low_var_kl", 0.193147)],  # k3: 0.5 - 1 + ln 2
)
def test_kl_estimators(kind, expected):
    assert close(compute_approx_kl(T([math.log(0.5)]), T([math.log(0.25)]), kind), T([expected]))


def test_low_var_kl_is_clamped():
    # r = -20: k3 = e^20 - 1 - 20 (huge); low_var_kl caps at 10
    assert compute_approx_kl(T([-20.0]), T([0.0]), "k3").item() > 1e8
    assert compute_approx_kl(T([-20.0]), T([0.0]), "low_var_kl").item() == 10.0
    # a -inf or NaN log-prob: the log-ratio is clamped first (Miles' _safe_clamp_log_ratio)
    assert compute_approx_kl(T([-math.inf]), T([0.0]), "low_var_kl").item() == 10.0
    assert compute_approx_kl(T([math.nan]), T([0.0]), "low_var_kl").item() == 0.0
    with pytest.raises(ConfigError, match="k4"):
        compute_approx_kl(T([0.0]), T([0.0]), "k4")


def test_entropy_from_logits():
    assert close(
        entropy_from_logits(T([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -1e9, -1e9]])), T([1.386294, 0.693147])
    )


def test_reductions():
    # sample A [1, 2, (3 masked)] -> 1.5; sample B [4] -> 4
    vals, masks = [T([1.0, 2.0, 3.0]), T([4.0])], [T([1.0, 1.0, 0.0]), T([1.0])]
    assert close(sum_of_sample_mean(vals, masks), 2.75)  # (1.5 + 4) / 2
    assert close(per_token_mean(vals, masks), 7 / 3)  # (1 + 2 + 4) / 3
    # a fully masked sample counts 0 tokens in its own mean's denominator (clamped to 1) and none of
    # the per-token one's; an empty one the same
    vals, masks = [T([1.0, 2.0]), T([5.0]), T([]), T([4.0])], [T([1.0, 1.0]), T([0.0]), T([]), T([1.0])]
    assert close(sum_of_sample_mean(vals, masks), (1.5 + 0 + 0 + 4) / 4)
    assert close(per_token_mean(vals, masks), 7 / 5)  # denominators clamped to 1: 2 + 1 + 1 + 1


def test_mask_counts_are_each_samples_mask_sum_in_one_pass():
    """The reducers' denominators: what a sum per sample gave, for every mask dtype, empty samples
    included, without a kernel per sample (one cat, one index_add)."""
    g = torch.Generator().manual_seed(0)
    masks = [(torch.rand(n, generator=g) > 0.4).float() for n in (3, 0, 7, 1, 0, 12)]
    want = torch.stack([m.sum() for m in masks])
    assert torch.equal(mask_counts(masks), want)
    assert torch.equal(mask_counts([m.bool() for m in masks]), want)
    assert torch.equal(mask_counts([m.long() for m in masks]), want)
    assert mask_counts([]).numel() == 0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        mask_counts(masks * 20)
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::sum") == 0


# ---------------------------------------------------------------------------- MIS (Miles' mis.py)


def _tis(mode, level, w):
    args = cfg(use_tis=True, tis_mode=mode, tis_level=level, tis_lower_bound=0.5, tis_upper_bound=2.0)
    train = [torch.log(T(w))]
    weights, masks, metrics = compute_mis_weights(
        args, train_log_probs=train, rollout_log_probs=[torch.zeros(len(w))], loss_masks=ones(len(w))
    )
    return weights, masks, {k: v[0] for k, v in metrics.items()}


def test_mis_token_truncate_clip_mask():
    w, keep, m = _tis("truncate", "token", [0.4, 1.0, 3.0])
    assert close(w[0], T([0.4, 1.0, 2.0])) and keep[0].tolist() == [1, 1, 1]  # only the upper bound
    assert m["tis_truncate_fraction"].tolist() == [0, 0, 1]
    assert close(m["tis_weight_before_bound"], T([0.4, 1.0, 3.0]))
    assert close(_tis("clip", "token", [0.4, 1.0, 3.0])[0][0], T([0.5, 1.0, 2.0]))
    w, keep, m = _tis("mask", "token", [0.4, 1.0, 3.0])
    # mask mode keeps the weight and rejects the token (the mask), as Miles' mis.py
    assert close(w[0], T([0.4, 1.0, 3.0])) and keep[0].tolist() == [0, 1, 0]
    assert m["tis_mask_fraction_low"].tolist() == [1, 0, 0] and m["tis_mask_fraction_high"].tolist() == [
        0,
        0,
        1,
    ]
    assert close(m["is_ratio_min_final"], T([0.4] * 3)) and close(m["is_ratio_max_final"], T([3.0] * 3))


def test_mis_sequence_and_geometric():
    # product 0.4 * 1.0 * 3.0 = 1.2; geometric mean 1.2 ** (1/3) = 1.062659
    assert close(_tis("truncate", "sequence", [0.4, 1.0, 3.0])[0][0], T([1.2] * 3))
    assert close(_tis("truncate", "geometric", [0.4, 1.0, 3.0])[0][0], T([1.062659] * 3))
    assert _tis("mask", "sequence", [0.4, 1.0, 9.0])[1][0].tolist() == [0, 0, 0]  # 3.6 > 2: rejected


# ---------------------------------------------------------------------------- composed losses


def _batch(n=2, adv=1.0):
    return {
        "advantages": [torch.full((n,), adv)],
        "old_log_probs": [torch.full((n,), math.log(0.5))],
        "rollout_log_probs": [torch.full((n,), math.log(0.25))],
        "ref_log_probs": [torch.full((n,), math.log(0.25))],
        "loss_masks": [torch.ones(n)],
    }


def test_policy_loss_function_composes_terms():
    args = cfg(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1", entropy_coef=0.1)
    lp = [torch.full((2,), math.log(0.5), requires_grad=True)]
    entropy = [T([0.3, 0.5])]
    loss, m = policy_loss_function(args, _batch(), lp, entropy)
    # ratio 1, A=1 -> pg -1; k1 KL vs ref = ln 2; entropy mean 0.4
    assert close(m["pg_loss"], -1.0) and close(m["ppo_kl"], 0.0) and close(m["pg_clipfrac"], 0.0)
    assert close(m["kl_loss"], 0.693147) and close(m["entropy_loss"], 0.4)
    assert close(loss, -1.0 + 0.5 * 0.693147 - 0.1 * 0.4)
    loss.backward()
    # d/dlp per token (mean of 2): -ratio*A/2 + 0.5 * 1/2 = -0.5 + 0.25
    assert close(lp[0].grad, T([-0.25, -0.25]))


def test_policy_loss_with_tis_and_rollout_logprobs():
    lp = [torch.full((2,), math.log(0.5))]
    # Miles' built-in TIS: weight pi_old / pi_rollout = 2 -> clamped to --tis-clip 1.5; pg = -1 * 1.5;
    # `tis` is the ratio before the clamp, reduced like the loss
    loss, m = policy_loss_function(cfg(use_tis=True, tis_clip=1.5), _batch(), lp)
    assert close(loss, -1.5) and close(m["tis"], 2.0) and close(m["tis_clipfrac"], 1.0)
    assert close(m["tis_abs"], 1.0) and close(m["ois"], 1.0)
    # an MIS flag selects MIS (truncate at --tis-upper-bound)
    loss, m = policy_loss_function(cfg(use_tis=True, tis_upper_bound=1.5), _batch(), lp)
    assert close(loss, -1.5) and close(m["mis_tis_truncate_fraction"], 1.0) and "tis" not in m
    loss, m = policy_loss_function(cfg(use_rollout_logprobs=True), _batch(), lp)
    # old := rollout (0.25): ratio 2 -> clipped at 1.2
    assert close(loss, -1.2) and close(m["pg_clipfrac"], 1.0) and close(m["ppo_kl"], -0.693147)
    with pytest.raises(ConfigError, match="--use-kl-loss needs ref_log_probs"):
        batch = _batch()
        del batch["ref_log_probs"]
        policy_loss_function(cfg(use_kl_loss=True), batch, lp)


def test_sft_loss():
    batch = {"loss_masks": [T([1.0, 1.0, 0.0])]}
    loss, m = sft_loss_function(cfg(), batch, [T([-1.0, -2.0, -9.0])])
    assert close(loss, 1.5) and close(m["loss"], 1.5)


@pytest.fixture
def custom_loss(tmp_path, monkeypatch):
    (tmp_path / "my_losses.py").write_text(
        textwrap.dedent(
            """
            def double_nll(args, batch, log_probs, entropy=None):
                loss = -2 * sum(lp.sum() for lp in log_probs)
                return loss, {"loss": loss}

            def too_few(args, batch):
                return 0, {}
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_losses", None)


def test_get_loss_function(custom_loss):
    assert get_loss_function(cfg()) is policy_loss_function
    assert get_loss_function(cfg(loss_type="sft_loss")) is sft_loss_function
    fn = get_loss_function(cfg(loss_type="custom_loss", custom_loss_function_path="my_losses.double_nll"))
    assert close(fn(None, {}, [T([-1.0])])[0], 2.0)
    with pytest.raises(ConfigError, match="--custom-loss-function-path 'my_losses.too_few'.*4 positional"):
        get_loss_function(cfg(loss_type="custom_loss", custom_loss_function_path="my_losses.too_few"))
    with pytest.raises(ConfigError, match="needs --custom-loss-function-path"):
        get_loss_function(cfg(loss_type="custom_loss"))


def test_the_policy_loss_and_its_ess_metric_run_as_many_kernels_for_64_samples_as_for_8():
    """compute_policy_loss (token level) and the ess_ratio metric work on the micro-batch's tokens
    laid end to end: their kernel count does not grow with the sample count (a loop over samples
    cost ~10 ms of the demo's 128-sample GRPO step), and ess_ratio is each sample's
    (sum w)^2 / (n sum w^2) with w = exp(-ppo_kl) at its loss tokens, averaged over samples."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from miles_platform.training.loss import _ess_ratio, compute_policy_loss

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    def case(n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        sizes = [int(x) for x in torch.randint(1, 7, (n,), generator=g)]
        lp = [torch.randn(k, generator=g, requires_grad=True) for k in sizes]
        old = [x.detach() + 0.3 * torch.randn(k, generator=g) for x, k in zip(lp, sizes, strict=True)]
        adv = [torch.randn(k, generator=g) for k in sizes]
        masks = [(torch.rand(k, generator=g) > 0.2).float() for k in sizes]
        return lp, old, adv, masks

    def kernels(n: int) -> int:
        lp, old, adv, masks = case(n)
        with Count() as c:
            _, _, ppo_kl = compute_policy_loss(lp, old, adv, masks, 0.2)
            _ess_ratio(ppo_kl, masks, per_token=False)
        return c.n

    assert kernels(64) == kernels(8)
    lp, old, adv, masks = case(16, seed=1)
    _, _, ppo_kl = compute_policy_loss(lp, old, adv, masks, 0.2)
    want = []
    for k, m in zip(ppo_kl, masks, strict=True):
        w = torch.where(m > 0, (-k.detach()).exp(), torch.zeros(())) * m
        want.append(w.sum() ** 2 / (m.sum().clamp_min(1) * (w * w).sum().clamp_min(1e-8)))
    assert torch.allclose(_ess_ratio(ppo_kl, masks, per_token=False), torch.stack(want).mean(), rtol=1e-6)


def test_group_advantages_are_one_repeat_of_the_rewards_not_a_fill_per_sample():
    """grpo / gspo: each sample's normalized reward at each of its tokens, built in one pass over the
    batch (a fill and a clone per sample were ~1 ms of a 128-sample step); returns never alias them."""
    from torch.profiler import ProfilerActivity, profile

    args = cfg(advantage_estimator="grpo", n_samples_per_prompt=2)
    masks = [T([1.0, 1.0, 0.0]), T([1.0]), T([1.0, 1.0]), T([0.0, 1.0])] * 16
    rewards = T([1.0, 0.0, 0.0, 0.0] * 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        adv, ret = compute_advantages_and_returns(args, rewards, None, None, None, masks)
    ops = {e.key: e.count for e in prof.key_averages()}
    assert ops.get("aten::full_like", 0) + ops.get("aten::fill_", 0) < 8, ops
    assert [a.shape[0] for a in adv] == [m.shape[0] for m in masks]
    g0 = 0.5 / (math.sqrt(0.5) + 1e-6)  # (1 - 0.5) / (the group std 0.7071 + 1e-6)
    assert close(adv[0], T([g0] * 3)) and close(adv[1], T([-g0])) and close(adv[2], T([0.0, 0.0]))
    ret[0].add_(1.0)
    assert close(adv[0], T([g0] * 3)) and close(adv[4], T([g0] * 3))  # returns are their own copy
