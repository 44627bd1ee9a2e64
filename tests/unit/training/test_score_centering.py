"""Score centering (training/score_centering.py): the loss's gradient against an independent dense
oracle, the centering identity, and one trainer step on the tiny model.

The oracle never uses H-only coefficients or alpha: it builds the tail model as a full distribution,
q~ = q on H and rho * p elsewhere (rho from the clamped tail masses), and takes the expected
weighted score E_{q~}[f(p / q~) grad_z log p] over the whole vocabulary in float64, with
grad_z log p[v] = (e_v - p) / T written out."""

from __future__ import annotations

import math

import pytest
import torch

from miles_platform.config import RunConfig
from miles_platform.training.loss import candidate_log_probs, token_log_probs
from miles_platform.training.score_centering import score_centering_loss

V, T = 12, 0.8


def _args(mode: str = "none", **kw) -> RunConfig:
    base = dict(rollout_batch_size=1, loss_type="score_centering", rollout_top_logprobs_num=4,
                use_rollout_logprobs=True, score_centering_is=mode)  # fmt: skip
    return RunConfig(**{**base, **kw}).validate()


def _f(x: float, args) -> float:
    if args.score_centering_is == "tis":
        return min(x, args.score_centering_tis_clip)
    if args.score_centering_is == "mis":
        return x if args.score_centering_mis_low <= x <= args.score_centering_mis_high else 0.0
    return 1.0


def _oracle_grad(z, zq, tok, head, adv, args):
    """d loss_t / d z of one position, float64, from the dense tail-model distribution."""
    p = torch.softmax(z.double() / T, -1)
    q = torch.softmax(zq.double() / T, -1)
    inside = torch.zeros(V, dtype=torch.bool)
    inside[head] = True
    rho = max(1 - float(q[inside].sum()), 1e-6) / max(1 - float(p[inside].sum()), 1e-6)
    q_tail = torch.where(inside, q, rho * p)  # what the sampler is modelled as
    eye = torch.eye(V, dtype=torch.float64)
    score = (eye - p) / T  # row v: grad_z log p[v]
    expected = sum(float(q_tail[v]) * _f(float(p[v] / q_tail[v]), args) * score[v] for v in range(V))
    return -adv * (_f(float(p[tok] / q[tok]), args) * score[tok] - expected)


def _loss_grad(z, zq, toks, heads, adv, args, per_token=False, support=None):
    """Gradient of the implementation's loss w.r.t. the logits [n, V] of one sample (n positions)."""
    z = z.detach().clone().float().requires_grad_(True)
    k = args.rollout_top_logprobs_num
    ids = torch.full((len(toks), k), -1, dtype=torch.long)
    for j, h in enumerate(heads):
        ids[j, : len(h)] = torch.tensor(h)
    q_all = torch.log_softmax(zq.double() / T, -1)
    if support is not None:  # support mode: q and p renormalized over the support
        keep = torch.full_like(q_all, float("-inf"))
        for j, h in enumerate(heads):
            keep[j, h] = 0.0
        q_all = torch.log_softmax(q_all + keep, -1)
    q_ids = torch.where(ids >= 0, q_all.gather(-1, ids.clamp(min=0)), float("-inf"))
    targets = torch.tensor(toks)
    lp, _ = token_log_probs(z[None], targets[None], T, support)
    cand = candidate_log_probs(z[None], ids[None], T, support)
    batch = {
        "advantages": [torch.full((len(toks),), float(adv))],
        "rollout_log_probs": [q_all.gather(-1, targets[:, None])[:, 0].float()],
        "loss_masks": [torch.ones(len(toks))],
        "candidate_log_probs": [cand[0]],
        "rollout_topk_token_ids": [ids],
        "rollout_topk_log_probs": [q_ids.float()],
    }
    loss, metrics = score_centering_loss(args, batch, [lp[0]])
    loss.backward()
    return z.grad.double(), metrics


def _case(seed: int, tiny_tail: bool = False):
    """Trainer and sampler logits that disagree enough for the tis clip and the mis mask to act."""
    g = torch.Generator().manual_seed(seed)
    n = 4
    z = torch.randn(n, V, generator=g, dtype=torch.float64) * 2
    zq = z + torch.randn(n, V, generator=g, dtype=torch.float64) * 1.5
    if tiny_tail:  # the last 4 ids carry < 1e-9 of both distributions
        z[:, -4:] -= 40
        zq[:, -4:] -= 40
    return z, zq


@pytest.mark.parametrize("mode", ["none", "tis", "mis"])
@pytest.mark.parametrize("tiny_tail", [False, True], ids=["tail", "tiny_tail"])
def test_gradient_matches_the_dense_oracle(mode, tiny_tail):
    args = _args(mode, rollout_top_logprobs_num=8)
    z, zq = _case(3 + tiny_tail, tiny_tail)
    heads = [[int(t) for t in zq[j].topk(8 if tiny_tail else 5).indices] for j in range(len(z))]
    # positions 0, 1: sampled inside H; 2, 3: sampled outside (its q[tok] is still the recorded one)
    outside = [[v for v in range(V) if v not in h] for h in heads]
    toks = [heads[0][1], heads[1][0], outside[2][0], outside[3][-1]]
    adv = 0.7
    got, m = _loss_grad(z, zq, toks, heads, adv, args)
    want = torch.stack([_oracle_grad(z[j], zq[j], toks[j], heads[j], adv, args) for j in range(len(z))])
    want = want / len(z)  # the per-sample token mean
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-4), (got - want).abs().max()
    ratios = [float((torch.softmax(z[j] / T, -1) / torch.softmax(zq[j] / T, -1))[toks[j]]) for j in range(4)]
    if mode == "tis":
        assert any(r > 2 for r in ratios), ratios  # the clip acts in this case
    if mode == "mis":
        assert any(not 0.5 <= r <= 5 for r in ratios), ratios  # the mask acts
    for key in ("sc_train_head_mass", "sc_rollout_head_mass"):
        assert (float(m[key]) > 1 - 1e-6) if tiny_tail else (0 < float(m[key]) < 1), (key, m[key])
    assert float(m["sc_correction"]) > 0 and math.isfinite(float(m["sc_tail_ratio"]))


def test_a_wrong_tail_model_or_weight_is_caught():
    """The oracle sees the difference between the tail model's alpha and a plain (un-tailed) centering."""
    args = _args("tis", rollout_top_logprobs_num=8)
    z, zq = _case(3)
    heads = [[int(t) for t in zq[j].topk(5).indices] for j in range(len(z))]
    toks = [h[0] for h in heads]
    got, _ = _loss_grad(z, zq, toks, heads, 1.0, args)
    want = torch.stack([_oracle_grad(z[j], zq[j], toks[j], heads[j], 1.0, args) for j in range(4)]) / 4
    none = torch.stack([_oracle_grad(z[j], zq[j], toks[j], heads[j], 1.0, _args()) for j in range(4)]) / 4
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-4)
    assert not torch.allclose(got, none, atol=1e-3)  # f matters: the oracle tells tis from none


@pytest.mark.parametrize("mode", ["none", "tis", "mis"])
def test_constant_reward_with_the_whole_vocabulary_as_h_cancels_exactly(mode):
    """Full-vocabulary H: the centering term is the exact expectation, so E_q[grad] of a constant
    reward is 0 for every f; the uncentered REINFORCE gradient (H empty) is not."""
    args = _args(mode, rollout_top_logprobs_num=V)
    z, zq = _case(11)
    z, zq = z[:1], zq[:1]
    q = torch.softmax(zq[0] / T, -1)
    every = [list(range(V))]
    centered = sum(float(q[t]) * _loss_grad(z, zq, [t], every, 1.0, args)[0] for t in range(V))
    assert float(centered.abs().max()) < 1e-6
    plain = sum(float(q[t]) * _loss_grad(z, zq, [t], [[]], 1.0, args)[0] for t in range(V))
    assert float(plain.abs().max()) > 1e-2  # off-policy REINFORCE drifts under a constant reward


def test_support_mode_centers_over_the_support_exactly():
    """Filtered sampling: H is the realized support and p, q are renormalized over it; the constant
    reward's expected gradient over the support is 0 and no logit outside it moves."""
    args = _args("tis", rollout_top_logprobs_num=6, rollout_top_k=6)
    z, zq = _case(5)
    z, zq = z[:1], zq[:1]
    sup = sorted(int(t) for t in zq[0].topk(6).indices)
    support = torch.full((1, 1, 6), -1, dtype=torch.long)
    support[0, 0] = torch.tensor(sup)
    q = torch.softmax(zq[0, sup] / T, -1)
    grads = [_loss_grad(z, zq, [t], [sup], 1.0, args, support=support) for t in sup]
    total = sum(float(qi) * g for qi, (g, _) in zip(q, grads, strict=True))
    assert float(total.abs().max()) < 1e-6
    assert float(grads[0][0][0, [v for v in range(V) if v not in sup]].abs().max()) == 0.0
    m = grads[0][1]
    assert float(m["sc_train_head_mass"]) == pytest.approx(1, abs=1e-5)
    assert float(m["sc_tail_ratio"]) == pytest.approx(1, abs=1e-6)


def test_on_policy_the_centering_term_vanishes():
    """q = p: alpha = 1 and every coefficient q[h] - p[h] is 0, so the loss is plain REINFORCE."""
    args = _args(rollout_top_logprobs_num=5)
    z, _ = _case(7)
    heads = [[int(t) for t in z[j].topk(5).indices] for j in range(len(z))]
    toks = [h[2] for h in heads]
    got, m = _loss_grad(z, z, toks, heads, 1.0, args)
    plain, _ = _loss_grad(z, z, toks, [[]] * len(z), 1.0, args)
    assert torch.allclose(got, plain, atol=1e-6)
    assert float(m["sc_correction"]) < 1e-5 and float(m["sc_tail_ratio"]) == pytest.approx(1, abs=1e-4)


def _engine_samples(ckpt, top_k: int, top_p: float, k: int, temperature: float = 0.7):
    """Samples from the embedded engine with candidates, through the rollout's own recording
    (append_output) and a rollout shard's Parquet row and back."""
    from miles_platform.data.sample import Sample
    from miles_platform.models.checkpoint import load_tokenizer
    from miles_platform.rollout.candidates import request_fields
    from miles_platform.rollout.engine_core import EngineCore
    from miles_platform.rollout.generate_hub.endpoint import append_output
    from miles_platform.store.shards import samples_to_table

    tok = load_tokenizer(ckpt)
    replay = top_k > 0 or top_p < 1
    core = EngineCore(ckpt, num_threads=1)
    try:
        prompts = [tok.encode(f"{i}+{i}=", add_special_tokens=False) for i in range(4)]
        sp = [{"temperature": temperature, "top_k": top_k, "top_p": top_p, "max_new_tokens": 5,
               "sampling_seed": 40 + i, "ignore_eos": True} for i in range(4)]  # fmt: skip
        body = {
            "input_ids": prompts,
            "sampling_params": sp,
            "return_logprob": True,
            **request_fields(k, replay),
        }
        if replay:
            body["return_sampling_mask"] = True
        futures, _ = core.submit_json(body)
        outs = [f.result(60) for f in futures]
    finally:
        core.stop()
    samples = []
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        s = Sample(index=i, prompt_tokens=p, reward=float(i % 2), raw_reward=float(i % 2))
        append_output(s, out, replay, topk=k)
        samples.append(s)
    return [Sample.from_row(r) for r in samples_to_table(samples).to_pylist()]


@pytest.mark.parametrize("top_k,top_p", [(-1, 1.0), (4, 0.9)], ids=["selected", "support"])
def test_one_trainer_step_on_the_tiny_model(tiny_hf_checkpoint, tmp_path, top_k, top_p):
    """At step 0 the trainer is the policy that sampled: rollout and trainer log-probs agree, the
    centering coefficients vanish, the tail ratio is 1; the step is finite and moves the weights."""
    from miles_platform.training.actor import TrainBatch, TrainerActor

    k = 6
    batch = TrainBatch.from_samples(_engine_samples(tiny_hf_checkpoint, top_k, top_p, k))
    cfg = RunConfig(
        hf_checkpoint=tiny_hf_checkpoint, rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4,
        micro_batch_size=2, lr=1e-3, save=str(tmp_path / "ck"), loss_type="score_centering",
        rollout_top_logprobs_num=k, use_rollout_logprobs=True, rollout_temperature=0.7, rollout_top_k=top_k,
        rollout_top_p=top_p, score_centering_is="tis", entropy_coef=0.01,
    ).validate()  # fmt: skip
    actor = TrainerActor(cfg)
    before = {n: p.detach().clone() for n, p in actor.backend.named_parameters()}
    m = actor.train(0, batch)
    for key in ("loss", "pg_loss", "sc_correction", "sc_train_head_mass", "sc_rollout_head_mass",
                "sc_tail_ratio", "sc_importance_weight", "train_rollout_logprob_abs_diff", "grad_norm"):  # fmt: skip
        assert math.isfinite(m[f"train/{key}"]), (key, m)
    assert m["train/grad_norm"] > 0
    assert m["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert m["train/sc_correction"] < 1e-4 and m["train/sc_tail_ratio"] == pytest.approx(1, abs=1e-3)
    assert m["train/sc_importance_weight"] == pytest.approx(1, abs=1e-4)
    head = m["train/sc_train_head_mass"]
    assert head == pytest.approx(m["train/sc_rollout_head_mass"], abs=1e-5)
    assert (head == pytest.approx(1, abs=1e-5)) if top_k > 0 else (0 < head < 1)
    after = dict(actor.backend.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_the_trainer_refuses_samples_without_aligned_candidates():
    from miles_platform.training.actor import TrainBatch
    from miles_platform.training.score_centering import rollout_candidates

    def batch(ids, lps, mask=(1, 1)):
        return TrainBatch([[1, 2, 3, 4]], [2], [list(mask)], [0.0], [[-1.0, -1.0]], rollout_topk_token_ids=[ids],
                          rollout_topk_log_probs=[lps])  # fmt: skip

    good = batch([[3, 4], [5, -1]], [[-0.1, -2.0], [-0.5, float("-inf")]])
    ids, lps = rollout_candidates(good, 0, 2)
    assert ids.tolist() == [[3, 4], [5, -1]] and lps.shape == (2, 2)
    with pytest.raises(ValueError, match="sample 0 has no rollout_topk_token_ids"):
        rollout_candidates(batch(None, None), 0, 2)
    assert (rollout_candidates(batch(None, None, (0, 0)), 0, 2)[0] == -1).all()  # nothing trained
    with pytest.raises(ValueError, match="--rollout-top-logprobs-num 2"):
        rollout_candidates(batch([[3, 4]], [[-0.1, -2.0]]), 0, 2)  # one row for two tokens
    with pytest.raises(ValueError, match="widths"):
        rollout_candidates(batch([[3, 4, 5], [5, 6, 7]], [[-1.0] * 3] * 2), 0, 2)
    with pytest.raises(ValueError, match="repeats a candidate id"):
        rollout_candidates(batch([[3, 3], [5, -1]], [[-0.1, -0.1], [-0.5, float("-inf")]]), 0, 2)
