"""The log-prob contract between engine and trainer (docs/algorithms.md): tempered log-probs and
sampling-support replay. The engine reports log softmax(z / T) of the distribution it sampled from
(over the top-k / top-p support when one truncated it); the trainer scores the same, so at step 0
the two agree to fp32 rounding and the PPO ratio against the rollout is 1."""

from __future__ import annotations

import pytest
import torch

from miles_platform.config import ConfigError, RunConfig
from miles_platform.models.checkpoint import load_tokenizer
from miles_platform.rollout.engine_core import EngineCore
from miles_platform.rollout.sampling import draw
from miles_platform.training.actor import TrainBatch, TrainerActor
from miles_platform.training.loss import token_log_probs


def test_draw_reports_the_tempered_log_prob_and_the_support_it_sampled_from():
    torch.manual_seed(0)
    logits = torch.randn(64, 30)
    n = len(logits)
    d = draw(logits, [0.7] * n, [0.9] * n, [8] * n, [0.0] * n, list(range(n)), [0] * n, [True] * n)
    full = torch.log_softmax(logits / 0.7, -1)
    for i in range(n):
        t, sup = d.tokens[i], d.supports[i]
        assert d.logprobs[i] == pytest.approx(float(full[i, t]), abs=1e-6)
        top8 = set(logits[i].topk(8).indices.tolist())
        assert t in sup and set(sup) <= top8 and sup == sorted(sup)
        # SGLang's order: top-p on the full distribution's sorted mass, then the top-k cut
        p = full[i].exp().sort(descending=True).values
        assert len(sup) == min(8, int(((p.cumsum(0) - p) <= 0.9).sum()))
        renorm = full[i, t] - torch.logsumexp(full[i, sup], 0)
        assert d.support_logprobs[i] == pytest.approx(float(renorm), abs=1e-6)
    greedy = draw(logits[:2], [0.0, 1.0], [1.0, 1.0], [-1, 1], [0.0, 0.0], [1, 2], [0, 0], [True, True])
    assert greedy.supports == [[int(logits[0].argmax())], [int(logits[1].argmax())]]
    assert greedy.support_logprobs == [0.0, 0.0]
    assert greedy.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1).max()), abs=1e-6)


def test_trainer_gradient_is_the_tempered_policys_and_replay_renormalizes_over_the_support():
    torch.manual_seed(1)
    z = torch.randn(3, 5, 20, requires_grad=True)
    targets = torch.randint(0, 20, (3, 5))
    lp, _ = token_log_probs(z, targets, temperature=0.7)
    (g,) = torch.autograd.grad(lp.sum(), z)
    z2 = z.detach().clone().requires_grad_(True)
    ref = torch.distributions.Categorical(logits=z2 / 0.7).log_prob(targets)
    (g_ref,) = torch.autograd.grad(ref.sum(), z2)
    assert torch.allclose(lp, ref, atol=1e-6) and torch.allclose(g, g_ref, atol=1e-6)
    assert not torch.allclose(lp, torch.log_softmax(z, -1).gather(-1, targets[..., None])[..., 0], atol=1e-3)

    # replay: supports of 3-4 ids (ragged) at every position but the last (-1 row: full vocabulary)
    support = torch.full((3, 5, 4), -1, dtype=torch.long)
    for b in range(3):
        for j in range(4):
            others = [t for t in range(20) if t != int(targets[b, j])][: 2 + b % 2]
            support[b, j, : len(others) + 1] = torch.tensor(sorted([int(targets[b, j]), *others]))
    z3 = z.detach().clone().requires_grad_(True)
    lp_s, ent_s = token_log_probs(z3, targets, 0.7, support, with_entropy=True)
    (g_s,) = torch.autograd.grad(lp_s.sum(), z3)
    masked = torch.full_like(z3, float("-inf"))
    for b in range(3):
        for j in range(5):
            ids = [int(t) for t in support[b, j] if t >= 0] or list(range(20))
            masked[b, j, ids] = 0.0
    z4 = z.detach().clone().requires_grad_(True)
    dist = torch.distributions.Categorical(logits=z4 / 0.7 + masked)
    ref_s = dist.log_prob(targets)
    (g_ref_s,) = torch.autograd.grad(ref_s.sum(), z4)
    assert torch.allclose(lp_s, ref_s, atol=1e-6) and torch.allclose(g_s, g_ref_s, atol=1e-6)
    assert torch.allclose(ent_s, dist.entropy(), atol=1e-5)
    assert float(g_s[0, 0].abs()[[t for t in range(20) if t not in support[0, 0].tolist()]].max()) == 0.0


def _rollout(ckpt, temperature, top_k=-1, top_p=1.0, n=8):
    """Samples from the embedded engine, as the rollout manager makes them."""
    tok = load_tokenizer(ckpt)
    core = EngineCore(ckpt, num_threads=1)
    try:
        prompts = [tok.encode(f"{i}+{i}=", add_special_tokens=False) for i in range(n)]
        sp = [{"temperature": temperature, "top_k": top_k, "top_p": top_p, "max_new_tokens": 6,
               "sampling_seed": 17 + i} for i in range(n)]  # fmt: skip
        outs = core.generate(prompts, sp, return_logprob=True, return_sampling_mask=True)
    finally:
        core.stop()
    replay = top_k > 0 or top_p < 1
    key = "output_token_sampling_logprobs" if replay else None
    lps = [
        o["meta_info"][key] if key else [x[0] for x in o["meta_info"]["output_token_logprobs"]] for o in outs
    ]
    supports = [o["meta_info"]["output_token_sampling_mask"] for o in outs] if replay else None
    for o in outs:
        assert all(t in s for t, s in zip(o["output_ids"], o["meta_info"]["output_token_sampling_mask"]))
        if top_k > 0:
            assert all(len(s) <= top_k for s in o["meta_info"]["output_token_sampling_mask"])
    resp = [o["output_ids"] for o in outs]
    return TrainBatch(
        tokens=[p + r for p, r in zip(prompts, resp, strict=True)],
        response_lengths=[len(r) for r in resp],
        loss_masks=[[1] * len(r) for r in resp],
        rewards=[float(i % 2) for i in range(n)],
        rollout_log_probs=lps,
        rollout_sampling_supports=supports,
    )


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(0.7, -1, 1.0), (1.0, 5, 1.0), (0.7, 8, 0.9)], ids=["T0.7", "k5", "k8p0.9"]
)
def test_step0_trainer_agrees_with_the_engine_that_sampled(
    tiny_hf_checkpoint, tmp_path, temperature, top_k, top_p
):
    batch = _rollout(tiny_hf_checkpoint, temperature, top_k, top_p)
    # what the engine reported is the sampling distribution's log-prob, from an independent HF forward
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_hf_checkpoint, dtype=torch.float32)
    for i, toks in enumerate(batch.tokens):
        with torch.no_grad():
            z = hf(torch.tensor([toks])).logits[0, :-1].float() / temperature
        resp = batch.response_lengths[i]
        z = z[len(toks) - resp - 1 :]
        if batch.rollout_sampling_supports is not None:
            keep = torch.full_like(z, float("-inf"))
            for j, sup in enumerate(batch.rollout_sampling_supports[i]):
                keep[j, sup] = 0.0
            z = z + keep
        want = torch.log_softmax(z, -1).gather(1, torch.tensor(toks[-resp:])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(batch.rollout_log_probs[i]), want, atol=1e-5)
    kw = dict(hf_checkpoint=tiny_hf_checkpoint, rollout_batch_size=4, n_samples_per_prompt=2,
              global_batch_size=8, micro_batch_size=4, lr=1e-3, num_rollout=2, ci_test=True,
              rollout_temperature=temperature, rollout_top_k=top_k, rollout_top_p=top_p)  # fmt: skip
    m = TrainerActor(RunConfig(**kw, save=str(tmp_path / "a")).validate()).train(0, batch)
    assert abs(m["train/step0_ppo_kl"]) < 1e-9
    assert m["train/train_rollout_logprob_abs_diff"] < 1e-5, m["train/train_rollout_logprob_abs_diff"]
    # the PPO ratio against the rollout's own log-probs (--use-rollout-logprobs) is 1 at step 0
    ro = TrainerActor(RunConfig(**kw, use_rollout_logprobs=True, save=str(tmp_path / "b")).validate())
    m = ro.train(0, batch)
    assert abs(m["train/step0_ppo_kl"]) < 1e-6 and m["train/step0_pg_clipfrac"] == 0.0
    # scored without the support (the old, full-vocabulary objective) the two disagree
    if batch.rollout_sampling_supports is not None:
        full = TrainBatch(**{**batch.__dict__, "rollout_sampling_supports": None})
        m = TrainerActor(RunConfig(**kw, save=str(tmp_path / "c")).validate()).train(0, full)
        assert m["train/train_rollout_logprob_abs_diff"] > 1e-2


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(rollout_temperature=0.0), "--rollout-temperature 0.0"),
        (dict(rollout_top_p=0.9), "needs a positive --rollout-top-k"),
        (dict(rollout_top_k=5, use_kl_loss=True), "--use-kl-loss with sampling-support replay"),
        (dict(rollout_top_k=5, rollout_top_p=0.9, kl_coef=0.1), "--kl-coef 0.1 with sampling-support replay"),
        # the megatron backend trains in fp32 without recompute: the precision flags are refused
        (
            dict(train_backend="megatron", train_forward_dtype="bf16", rollout_dtype="bf16"),
            "--train-forward-dtype bf16: not supported by --train-backend megatron",
        ),
        (dict(train_backend="megatron", fsdp_master_dtype="bf16"), "--fsdp-master-dtype bf16"),
        (dict(train_backend="megatron", fsdp_reduce_dtype="bf16"), "--fsdp-reduce-dtype bf16"),
        (dict(train_backend="megatron", fsdp_precision_rules="module:*norm*=fp32"), "--fsdp-precision-rules"),
        (
            dict(train_backend="megatron", gradient_checkpointing=True),
            "--gradient-checkpointing: not supported",
        ),
    ],
)
def test_objectives_the_trainer_cannot_compute_are_refused(kw, needle):
    with pytest.raises(ConfigError, match=needle.replace("+", r"\+")):
        RunConfig(hf_checkpoint="x", rollout_batch_size=2, **kw).validate()
