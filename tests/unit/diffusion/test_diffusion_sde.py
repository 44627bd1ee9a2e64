"""SDE step backends, step strategies and diffusion RL losses against hand-computed references.

Expected numbers are computed here with explicit float arithmetic (math, not the code under
test), following flow_grpo's sd3_sde_with_logprob.py / train_sd3.py and DiffusionNFT's
train_nft_sd3.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from miles_platform.diffusion.losses import (
    ema_decay,
    ema_init,
    ema_update,
    flow_grpo_loss,
    grpo_advantages,
    kl_to_ref,
    nft_loss,
    nft_reward_weight,
)
from miles_platform.diffusion.sde import (
    CpsSdeStepBackend,
    FlowSdeStepBackend,
    OdeStepBackend,
    SdeStepBackend,
    backend_for,
)
from miles_platform.diffusion.step_strategy import (
    drop_final_steps,
    drop_random_steps,
    epoch_global_random_choice,
    sde_window,
)
from miles_platform.errors import ConfigError


class MyBackend(FlowSdeStepBackend):
    """Loaded by dotted path in test_backend_for_builtins_errors_and_custom_path."""

    name = "mine"


class NotABackend:
    pass


def _shifted_sigmas(num_steps: int, shift: float = 3.0) -> list[float]:
    """SD3's shifted schedule, ending in 0."""
    s = torch.linspace(1.0, 0.0, num_steps + 1)
    return (shift * s / (1 + (shift - 1) * s)).tolist()


# ---------------------------------------------------------------- scalar references


def flow_sde_ref(x, v, prev, sigma, nxt, smax, eta):
    """flow_grpo's Flow-SDE on python float lists: (mean list, std, mean log-prob)."""
    dt = nxt - sigma
    std_dev_t = eta * math.sqrt(sigma / (1 - (smax if sigma == 1 else sigma)))
    mean = [
        xi * (1 + std_dev_t**2 / (2 * sigma) * dt) + vi * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        for xi, vi in zip(x, v)
    ]
    std = std_dev_t * math.sqrt(-dt)
    const = -math.log(std) - math.log(math.sqrt(2 * math.pi))
    lps = [-((p - m) ** 2) / (2 * std**2) + const for p, m in zip(prev, mean)]
    return mean, std, sum(lps) / len(lps)


def ppo_ref(new, old, adv, c, adv_max):
    terms, clipped = [], 0
    for n, o, a in zip(new, old, adv):
        a = max(-adv_max, min(adv_max, a))
        ratio = math.exp(n - o)
        terms.append(max(-a * ratio, -a * max(1 - c, min(1 + c, ratio))))
        clipped += abs(ratio - 1) > c
    return sum(terms) / len(terms), clipped / len(terms)


# ---------------------------------------------------------------- (a) Flow-SDE density


def test_flow_sde_log_prob_is_the_gaussian_density_in_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 3, 3, generator=g, dtype=torch.float64)
    v = torch.randn(3, 2, 3, 3, generator=g, dtype=torch.float64)
    sigma = torch.tensor([1.0, 0.6, 0.3], dtype=torch.float64)
    nxt = torch.tensor([0.8, 0.3, 0.0], dtype=torch.float64)
    out = FlowSdeStepBackend().step(x, v, sigma, nxt, 0.8, 0.7, generator=g)
    assert out.log_prob.dtype == torch.float64 and out.log_prob.shape == (3,)
    ref = torch.distributions.Normal(out.prev_mean, out.std).log_prob(out.prev_sample).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob, ref, rtol=0, atol=1e-12)
    # std: sigma == 1 uses sigma_max (0.8) in the denominator; the last step uses sigma itself
    expected_std = [0.7 * math.sqrt(1 / 0.2) * math.sqrt(0.2), 0.7 * math.sqrt(0.6 / 0.4) * math.sqrt(0.3)]
    expected_std.append(0.7 * math.sqrt(0.3 / 0.7) * math.sqrt(0.3))
    torch.testing.assert_close(out.std.flatten(), torch.tensor(expected_std, dtype=torch.float64))
    no_const = FlowSdeStepBackend(log_prob_no_const=True).sde_step_logprob(
        x, v, sigma, nxt, 0.8, 0.7, out.prev_sample
    )
    const = (-torch.log(out.std.flatten()) - math.log(math.sqrt(2 * math.pi))).expand(3)
    torch.testing.assert_close(no_const.log_prob + const, out.log_prob, rtol=0, atol=1e-12)
    per_call = FlowSdeStepBackend().sde_step_logprob(
        x, v, sigma, nxt, 0.8, 0.7, out.prev_sample, log_prob_no_const=True
    )
    assert torch.equal(per_call.log_prob, no_const.log_prob)


# ---------------------------------------------------------------- (b) engine/trainer mirror


@pytest.mark.parametrize("backend", [FlowSdeStepBackend(), CpsSdeStepBackend()], ids=lambda b: b.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_then_rescore_gives_the_identical_log_prob(backend, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 3, 3, generator=g).to(dtype)
    v = torch.randn(4, 2, 3, 3, generator=g).to(dtype)
    sigma, nxt = torch.tensor([1.0, 0.9, 0.5, 0.2]), torch.tensor([0.9, 0.5, 0.2, 0.1])
    out = backend.step(x, v, sigma, nxt, torch.full((4,), 0.9), 0.7, generator=g)
    assert out.prev_sample.dtype == dtype and out.log_prob.dtype == torch.float32
    back = backend.sde_step_logprob(x, v, sigma, nxt, torch.full((4,), 0.9), 0.7, out.prev_sample)
    assert torch.equal(out.log_prob, back.log_prob)
    assert torch.equal(torch.exp(back.log_prob - out.log_prob), torch.ones(4))
    # the trainer's micro-batches (other sizes, other order) score each pair identically
    for idx in ([3], [2, 0], [1, 3, 0]):
        part = backend.sde_step_logprob(x[idx], v[idx], sigma[idx], nxt[idx], 0.9, 0.7, out.prev_sample[idx])
        assert torch.equal(part.log_prob, out.log_prob[idx])
    # an explicit noise tensor is the same draw as the generator's
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    a = backend.step(x, v, sigma, nxt, 0.9, 0.7, noise=noise)
    b = backend.step(x, v, sigma, nxt, 0.9, 0.7, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.prev_sample, b.prev_sample) and torch.equal(a.log_prob, b.log_prob)


# ---------------------------------------------------------------- (c) CPS by hand


def test_cps_matches_the_hand_computed_kernel():
    x, v, prev = [0.3, -0.6], [1.2, 0.4], [0.1, -0.5]
    sigma, nxt, eta = 0.7, 0.4, 0.7  # eta != 0.5, where sin and cos agree
    std = nxt * math.sin(eta * math.pi / 2)
    x0 = [xi - sigma * vi for xi, vi in zip(x, v)]
    eps = [xi + (1 - sigma) * vi for xi, vi in zip(x, v)]
    mean = [a * (1 - nxt) + e * math.sqrt(nxt**2 - std**2) for a, e in zip(x0, eps)]
    lp = -sum((p - m) ** 2 for p, m in zip(prev, mean)) / 2
    t = lambda vals: torch.tensor(vals, dtype=torch.float64).view(1, 1, 1, 2)  # noqa: E731
    out = CpsSdeStepBackend().sde_step_logprob(t(x), t(v), 0.7, 0.4, 0.9, 0.7, t(prev))
    assert out.log_prob.item() == pytest.approx(lp, abs=1e-12)
    assert out.std.item() == pytest.approx(std, abs=1e-12)
    assert out.prev_mean.flatten().tolist() == pytest.approx(mean, abs=1e-12)


# ---------------------------------------------------------------- (d) losses by hand


def test_flow_grpo_loss_on_a_hand_computed_two_step_trajectory():
    eta, sig, smax = 0.7, [1.0, 0.5, 0.0], 0.5  # 2 steps; sigma_max = the schedule's second sigma
    x = [[0.4, -0.3], [1.1, 0.2]]  # B=2, 1x1x2 latents
    v = {0: [[0.5, -0.2], [0.1, 0.9]], 1: [[-0.4, 0.3], [0.6, -0.1]]}  # rollout velocity per step
    dv = 0.15  # the trainer's velocity differs by dv everywhere
    noise = {0: [[0.3, -1.2], [0.8, 0.1]], 1: [[-0.5, 0.4], [1.5, -0.7]]}
    adv = [1.0, -0.6]
    backend, lat = FlowSdeStepBackend(), torch.tensor(x).view(2, 1, 1, 2)
    old_t, new_t, old_h, new_h, adv_h = [], [], [], [], []
    xs = [list(r) for r in x]
    for i in range(2):
        vt = torch.tensor(v[i]).view(2, 1, 1, 2)
        out = backend.step(
            lat, vt, sig[i], sig[i + 1], smax, eta, noise=torch.tensor(noise[i]).view(2, 1, 1, 2)
        )
        new = backend.sde_step_logprob(lat, vt + dv, sig[i], sig[i + 1], smax, eta, out.prev_sample)
        old_t.append(out.log_prob), new_t.append(new.log_prob)
        for b in range(2):
            mean, std, _ = flow_sde_ref(xs[b], v[i][b], [0, 0], sig[i], sig[i + 1], smax, eta)
            prev = [m + std * n for m, n in zip(mean, noise[i][b])]
            old_h.append(flow_sde_ref(xs[b], v[i][b], prev, sig[i], sig[i + 1], smax, eta)[2])
            new_h.append(
                flow_sde_ref(xs[b], [a + dv for a in v[i][b]], prev, sig[i], sig[i + 1], smax, eta)[2]
            )
            adv_h.append(adv[b])
            xs[b] = prev
        # the latent itself (log-probs alone are blind to the mean's x-coefficient)
        assert out.prev_sample.flatten().tolist() == pytest.approx(sum(xs, []), abs=1e-6)
        lat = out.prev_sample
    old_t, new_t = torch.cat(old_t), torch.cat(new_t)
    assert old_t.tolist() == pytest.approx(old_h, abs=1e-5)
    assert new_t.tolist() == pytest.approx(new_h, abs=1e-5)
    loss, m = flow_grpo_loss(new_t, old_t, torch.tensor(adv_h), clip_range=0.05, adv_clip_max=0.8)
    exp_loss, exp_clip = ppo_ref(new_h, old_h, adv_h, 0.05, 0.8)
    assert loss.item() == pytest.approx(exp_loss, abs=1e-5)
    assert m["train/pg_clipfrac"].item() == pytest.approx(exp_clip)
    assert 0 < exp_clip < 1  # the example exercises both branches


def test_flow_grpo_loss_numbers_and_metrics():
    new, old, adv = [0.1, -0.2, 0.05, 0.0], [0.0, 0.0, 0.0, 0.3], [2.0, -1.0, 10.0, -3.0]
    loss, m = flow_grpo_loss(
        torch.tensor(new), torch.tensor(old), torch.tensor(adv), clip_range=0.2, adv_clip_max=5.0
    )
    # pair 2: A clamped to 5; pair 4: ratio e^-0.3 = 0.741 < 0.8, A < 0 -> the clipped term 3 * 0.8 wins
    terms = [-2 * math.exp(0.1), math.exp(-0.2), -5 * math.exp(0.05), 3 * 0.8]
    assert loss.item() == pytest.approx(sum(terms) / 4, abs=1e-6)
    assert m["train/pg_clipfrac"].item() == pytest.approx(0.25)
    assert m["train/ppo_kl"].item() == pytest.approx((-0.1 + 0.2 - 0.05 + 0.3) / 4, abs=1e-7)
    assert m["train/log_prob_mean_abs_diff"].item() == pytest.approx((0.1 + 0.2 + 0.05 + 0.3) / 4, abs=1e-7)
    ratio_dev = [math.exp(0.1) - 1, 1 - math.exp(-0.2), math.exp(0.05) - 1, 1 - math.exp(-0.3)]
    assert m["train/ratio_abs_minus_1"].item() == pytest.approx(sum(ratio_dev) / 4, abs=1e-6)
    kl = kl_to_ref(torch.tensor([[1.0, 3.0]]), torch.tensor([[0.0, 1.0]]), torch.tensor([0.5]))
    assert kl.item() == pytest.approx(((1 + 4) / 2) / (2 * 0.25))
    with_kl, mk = flow_grpo_loss(
        torch.tensor(new), torch.tensor(old), torch.tensor(adv), clip_range=0.2, adv_clip_max=5.0,
        kl=torch.tensor([1.0, 2.0, 3.0, 6.0]), kl_beta=0.1,
    )  # fmt: skip
    assert with_kl.item() == pytest.approx(loss.item() + 0.1 * 3.0, abs=1e-6)
    assert mk["train/kl_loss"].item() == 3.0


def nft_ref(v_new, v_old, xt, x0, sigma, adv, beta, adv_max, adaptive, kl_beta=0.0, v_ref=None):
    total = 0.0
    for b in range(len(xt)):
        a = max(-adv_max, min(adv_max, adv[b]))
        r = min(1.0, max(0.0, a / adv_max / 2 + 0.5))
        branch = []
        for sign in (+1, -1):  # positive, implicit negative
            pred = [
                beta * n + (1 - beta) * o if sign > 0 else (1 + beta) * o - beta * n
                for n, o in zip(v_new[b], v_old[b])
            ]
            x0p = [x - sigma[b] * p for x, p in zip(xt[b], pred)]
            w = max(1e-5, sum(abs(p - t) for p, t in zip(x0p, x0[b])) / len(x0p)) if adaptive else 1.0
            branch.append(sum((p - t) ** 2 / w for p, t in zip(x0p, x0[b])) / len(x0p))
        total += adv_max * (r * branch[0] / beta + (1 - r) * branch[1] / beta)
        if kl_beta:
            total += kl_beta * sum((n - f) ** 2 for n, f in zip(v_new[b], v_ref[b])) / len(v_new[b])
    return total / len(xt)


@pytest.mark.parametrize("adaptive", [True, False])
def test_nft_loss_matches_diffusion_nft_by_hand(adaptive):
    x0, eps, sigma = [[0.5, -1.0], [0.2, 0.4]], [[1.0, 0.0], [-0.5, 2.0]], [0.6, 0.3]
    xt = [[(1 - s) * a + s * e for a, e in zip(xa, ea)] for xa, ea, s in zip(x0, eps, sigma)]
    v_new, v_old, v_ref = [[0.7, 0.9], [-0.6, 1.4]], [[0.4, 1.1], [-0.7, 1.0]], [[0.5, 1.0], [-0.2, 1.2]]
    adv = [2.0, -7.0]  # r = 0.7 and (clamped to -5) r = 0
    t = lambda vals: torch.tensor(vals, dtype=torch.float64).view(2, 1, 1, 2)  # noqa: E731
    r = nft_reward_weight(torch.tensor(adv), 5.0)
    assert r.tolist() == pytest.approx([0.7, 0.0])
    kw = dict(beta=0.5, adv_clip_max=5.0, adaptive_weight=adaptive)
    loss, m = nft_loss(t(v_new), t(v_old), t(xt), t(x0), torch.tensor(sigma), r, **kw)
    assert loss.item() == pytest.approx(
        nft_ref(v_new, v_old, xt, x0, sigma, adv, 0.5, 5.0, adaptive), rel=1e-6
    )
    loss_kl, mk = nft_loss(
        t(v_new), t(v_old), t(xt), t(x0), torch.tensor(sigma), r, kl_beta=0.1, v_ref=t(v_ref), **kw
    )
    expected = nft_ref(v_new, v_old, xt, x0, sigma, adv, 0.5, 5.0, adaptive, 0.1, v_ref)
    assert loss_kl.item() == pytest.approx(expected, rel=1e-6) and "train/kl_loss" in mk


# ---------------------------------------------------------------- (e) gradients and clipping


@pytest.mark.parametrize("backend", [FlowSdeStepBackend(), CpsSdeStepBackend()], ids=lambda b: b.name)
def test_gradient_reaches_model_output_and_clipping_stops_it(backend):
    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(2, 1, 2, 2, generator=g), torch.randn(2, 1, 2, 2, generator=g)
    out = backend.step(x, v, torch.tensor([0.8, 0.5]), torch.tensor([0.5, 0.2]), 0.8, 0.7, generator=g)
    v_new = (v + 0.01).requires_grad_(True)
    new = backend.sde_step_logprob(
        x, v_new, torch.tensor([0.8, 0.5]), torch.tensor([0.5, 0.2]), 0.8, 0.7, out.prev_sample
    )
    loss, _ = flow_grpo_loss(new.log_prob, out.log_prob, torch.ones(2), clip_range=1.0, adv_clip_max=5.0)
    loss.backward()
    assert torch.isfinite(v_new.grad).all() and v_new.grad.abs().sum() > 0
    # ratio e^0.5 > 1 + c with A > 0: the clipped (constant) branch wins, no gradient
    lp = torch.zeros(2, requires_grad=True)
    loss, m = flow_grpo_loss(
        lp, torch.tensor([-0.5, 0.0]), torch.tensor([1.0, 1.0]), clip_range=0.2, adv_clip_max=5.0
    )
    loss.backward()
    assert lp.grad[0].item() == 0.0 and lp.grad[1].item() == pytest.approx(-0.5)  # -A * ratio / P
    assert m["train/pg_clipfrac"].item() == 0.5


def test_nft_gradient_reaches_v_theta_only():
    v_theta = torch.randn(2, 1, 2, 2).requires_grad_(True)
    v_old = torch.randn(2, 1, 2, 2).requires_grad_(True)
    x0, xt = torch.randn(2, 1, 2, 2), torch.randn(2, 1, 2, 2)
    loss, _ = nft_loss(
        v_theta, v_old, xt, x0, torch.tensor([0.5, 0.3]), torch.tensor([0.9, 0.1]), beta=1.0, adv_clip_max=5.0
    )
    loss.backward()
    assert v_theta.grad.abs().sum() > 0 and v_old.grad is None


# ---------------------------------------------------------------- no NaN / inf, edge steps


@pytest.mark.parametrize("eta", [0.1, 0.7, 1.0])
def test_every_transition_of_a_schedule_is_finite(eta):
    sig = _shifted_sigmas(10)
    g = torch.Generator().manual_seed(4)
    for backend in (FlowSdeStepBackend(), CpsSdeStepBackend(), OdeStepBackend()):
        x = torch.randn(1, 2, 2, 2, generator=g)
        for i in range(10):  # a whole trajectory: sigma = 1 first, sigma = 0 last
            v = torch.randn(1, 2, 2, 2, generator=g).requires_grad_(True)
            out = backend.step(x, v.detach(), sig[i], sig[i + 1], sig[1], eta, generator=g)
            assert torch.isfinite(out.prev_sample).all(), (backend.name, i)
            assert torch.isfinite(out.log_prob).all(), (backend.name, i)
            if backend.deterministic:
                assert torch.equal(out.log_prob, torch.zeros(1))
                torch.testing.assert_close(out.prev_sample, x + (sig[i + 1] - sig[i]) * v.detach())
                x = out.prev_sample
                continue
            back = backend.sde_step_logprob(x, v, sig[i], sig[i + 1], sig[1], eta, out.prev_sample)
            back.log_prob.sum().backward()
            assert torch.isfinite(v.grad).all(), (backend.name, i)
            x = out.prev_sample
    assert [CpsSdeStepBackend().is_trainable(i, 10) for i in (0, 8, 9)] == [True, True, False]
    assert FlowSdeStepBackend().is_trainable(9, 10) and not OdeStepBackend().is_trainable(0, 10)
    with pytest.raises(ConfigError, match="--diffusion-sde-type"):
        OdeStepBackend().sde_step_logprob(x, x, 0.5, 0.2, 0.9, 0.7, x)
    with pytest.raises(ConfigError, match="--diffusion-noise-level 0.0"):
        FlowSdeStepBackend().step(x, x, 0.5, 0.2, 0.9, 0.0)


# ---------------------------------------------------------------- (f) advantages


def test_grpo_advantages_group_normalisation_and_flags():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0, 8.0])
    a = grpo_advantages(r, 3)  # group means 2, 6; unbiased stds 1, 2
    expected = [-1 / (1 + 1e-4), 0.0, 1 / (1 + 1e-4), -2 / (2 + 1e-4), 0.0, 2 / (2 + 1e-4)]
    assert a.tolist() == pytest.approx(expected, abs=1e-7)
    assert grpo_advantages(r, 3, std_normalization=False).tolist() == pytest.approx([-1, 0, 1, -2, 0, 2])
    batch_std = float(r.std())
    got = grpo_advantages(r, 3, globalize_std=True).tolist()
    assert got == pytest.approx([d / (batch_std + 1e-4) for d in (-1, 0, 1, -2, 0, 2)], abs=1e-6)
    got = grpo_advantages(r, 3, globalize_mean=True, std_normalization=False).tolist()
    assert got == pytest.approx([x - 4.0 for x in r.tolist()])
    # n = 1: no std; the group mean is the sample itself, the batch mean is not
    assert grpo_advantages(r, 1).tolist() == [0.0] * 6
    assert grpo_advantages(r, 1, globalize_mean=True, globalize_std=True).tolist() == pytest.approx(
        [x - 4.0 for x in r.tolist()]
    )
    with pytest.raises(ValueError, match="groups of 4"):
        grpo_advantages(r, 4)


# ---------------------------------------------------------------- (g) step strategies


def test_sde_window_is_seeded_contiguous_and_stays_in_range():
    args = SimpleNamespace(diffusion_num_sde_steps=3, diffusion_sde_window_range=None)
    windows = {tuple(sde_window(args, None, 10, seed)[0]) for seed in range(200)}
    assert sde_window(args, None, 10, 5) == sde_window(args, None, 10, 5)
    assert len(windows) == 7  # every start in [0, 9 - 3] reached, never the final step 9
    assert all(list(w) == list(range(w[0], w[0] + 3)) and 9 not in w for w in windows)
    args.diffusion_sde_window_range = "2,8"
    for seed in range(50):
        sde, ret = sde_window(args, None, 10, seed)
        assert sde == ret and 2 <= sde[0] and sde[-1] < 8
    args.diffusion_sde_window_range, args.diffusion_num_sde_steps = (0, 10), 10  # Miles' SD3 full window
    assert sde_window(args, None, 10, 0)[0] == list(range(10))
    for rng, k, msg in [("0,11", 2, "--diffusion-sde-window-range"), ("4,6", 3, "--diffusion-num-sde-steps")]:
        with pytest.raises(ConfigError, match=msg):
            sde_window(
                SimpleNamespace(diffusion_num_sde_steps=k, diffusion_sde_window_range=rng), None, 10, 0
            )


def test_epoch_global_random_choice_is_shared_per_seed_and_within_candidates():
    args = SimpleNamespace(diffusion_sde_candidate_steps="1,3,5,7", diffusion_num_sde_steps=2)
    picks = {tuple(epoch_global_random_choice(args, object(), 10, seed)[0]) for seed in range(100)}
    assert (
        all(len(p) == 2 and set(p) <= {1, 3, 5, 7} and list(p) == sorted(p) for p in picks) and len(picks) > 1
    )
    assert epoch_global_random_choice(args, "sample a", 10, 9) == epoch_global_random_choice(
        args, "sample b", 10, 9
    )
    args.diffusion_num_sde_steps = 0
    assert epoch_global_random_choice(args, None, 10, 0) == ([1, 3, 5, 7], [1, 3, 5, 7])
    with pytest.raises(ConfigError, match="--diffusion-sde-candidate-steps"):
        epoch_global_random_choice(SimpleNamespace(diffusion_sde_candidate_steps="1,10"), None, 10, 0)
    with pytest.raises(ConfigError, match="--diffusion-sde-candidate-steps"):
        epoch_global_random_choice(SimpleNamespace(), None, 10, 0)


def test_nft_timestep_strategies():
    args = SimpleNamespace(diffusion_nft_num_dropped_timesteps=3)
    a = drop_random_steps(args, 10, torch.Generator().manual_seed(1))
    assert a == drop_random_steps(args, 10, torch.Generator().manual_seed(1))
    assert len(a) == 7 == len(set(a)) and all(0 <= s < 10 for s in a)  # never index 10 (sigma = 0)
    assert drop_final_steps(args, 10, torch.Generator()) == list(range(7))
    assert sorted(drop_random_steps(SimpleNamespace(), 10, torch.Generator())) == list(range(10))
    with pytest.raises(ConfigError, match="--diffusion-nft-num-dropped-timesteps"):
        drop_final_steps(SimpleNamespace(diffusion_nft_num_dropped_timesteps=10), 10, torch.Generator())


# ---------------------------------------------------------------- (h) backend_for


def test_backend_for_builtins_errors_and_custom_path():
    assert isinstance(backend_for("sde"), FlowSdeStepBackend) and not backend_for("sde").log_prob_no_const
    assert backend_for("sde", log_prob_no_const=True).log_prob_no_const
    assert isinstance(backend_for("cps"), CpsSdeStepBackend) and backend_for("cps").log_prob_no_const
    assert backend_for("ode").deterministic
    with pytest.raises(ConfigError, match=r"--diffusion-sde-type 'sdee'.*sde, cps, ode"):
        backend_for("sdee")
    with pytest.raises(ConfigError, match=r"--sde-step-backend-path.*not a subclass"):
        backend_for("sde", "test_diffusion_sde.NotABackend")
    with pytest.raises(ConfigError, match=r"--sde-step-backend-path.*cannot import"):
        backend_for("sde", "no_such_pkg_for_sde.Backend")
    # tests/ is on sys.path (no __init__.py), so this module imports as test_diffusion_sde
    backend = backend_for("anything", "test_diffusion_sde.MyBackend")
    assert isinstance(backend, MyBackend) and isinstance(backend, SdeStepBackend) and backend.name == "mine"


# ---------------------------------------------------------------- EMA


def test_ema_decay_schedule_and_update():
    kw = dict(init=0.001, ramp=0.001, max=0.5, flat_steps=0)
    assert [ema_decay(s, **kw) for s in (0, 1, 300, 10_000)] == pytest.approx([0.001, 0.001, 0.3, 0.5])
    assert ema_decay(3, **{**kw, "flat_steps": 5}) == 0.001 and ema_decay(
        7, **{**kw, "flat_steps": 5}
    ) == pytest.approx(0.002)
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(3.0)
    ema = ema_init(model)
    for t in ema.values():
        t.fill_(1.0)
    ema_update(ema, model, 0.25)
    assert torch.allclose(ema["weight"], torch.full((1, 2), 2.5))  # 0.25 * 1 + 0.75 * 3
    shadow = torch.nn.Linear(2, 1)
    ema_update(shadow, model, 0.0)
    assert torch.equal(shadow.weight, model.weight) and not shadow.weight.grad_fn
