"""The vectorized sampler: distribution, masks, greedy rows, and seeded draws that ignore batch mates."""

from __future__ import annotations

import torch

from miles_platform.rollout.sampling import sample_tokens, uniforms


def _draw(logits, seeds, steps, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0):
    n = logits.shape[0]
    return sample_tokens(logits, [temperature] * n, [top_p] * n, [top_k] * n, [min_p] * n, seeds, steps)


def test_uniforms_are_uniform_and_keyed_by_seed_and_step():
    u = uniforms(list(range(20000)), [3] * 20000)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    hist = torch.histc(u.float(), bins=10, min=0, max=1) / len(u)
    assert torch.all((hist - 0.1).abs() < 0.01), hist
    assert torch.equal(uniforms([5, 5], [0, 0]), uniforms([5, 5], [0, 0]))
    a, b, c = uniforms([5, 6, 5], [0, 0, 1])
    assert len({float(a), float(b), float(c)}) == 3


def test_sampled_frequencies_match_the_softmax():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    n = 40000
    logits = probs.log().expand(n, -1).clone()
    tokens = _draw(logits, seeds=list(range(n)), steps=[0] * n)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.01), freq


def test_temperature_top_k_top_p_min_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).expand(4000, -1).clone()
    seeds, steps = list(range(4000)), [0] * 4000
    assert set(_draw(logits, seeds, steps, top_k=2).tolist()) == {0, 1}
    # top_p 0.6: token 0 alone has p ~0.55 < 0.6, so tokens 0 and 1 survive
    assert set(_draw(logits, seeds, steps, top_p=0.6).tolist()) == {0, 1}
    assert set(_draw(logits, seeds, steps, min_p=0.3).tolist()) == {0, 1}  # p1/p0 = e^-1 > 0.3 > e^-1.5
    cold = _draw(logits, seeds, steps, temperature=0.05)
    assert (cold == 0).float().mean() > 0.99
    greedy = _draw(logits, seeds, steps, temperature=0.0)
    assert torch.equal(greedy, torch.zeros(4000, dtype=torch.long))


def test_a_seeded_row_does_not_depend_on_its_batch_mates():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    alone = [int(_draw(logits[i : i + 1].clone(), [100 + i], [7])[0]) for i in range(6)]
    together = _draw(logits, [100 + i for i in range(6)], [7] * 6).tolist()
    assert alone == together
    mixed = sample_tokens(logits, [1.0, 0.0, 1.0, 0.7, 1.0, 1.0], [1.0, 1.0, 0.9, 1.0, 1.0, 1.0],
                          [-1, -1, -1, -1, 5, -1], [0.0] * 6, [100 + i for i in range(6)], [7] * 6)  # fmt: skip
    assert int(mixed[1]) == int(logits[1].argmax())  # greedy row
    assert mixed[0] == together[0] and mixed[5] == together[5]  # untouched rows keep their draw
