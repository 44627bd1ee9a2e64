"""Vocab-parallel scores (training/megatron_logprobs.py) on 2 gloo ranks, each holding half of a padded
vocabulary, equal the loss hub's full-vocabulary formulas: log-probs at a temperature, entropy,
sampling-support replay (with rows without a support) and candidate log-probs, and the gradient
each rank's logits get from a loss of all of them equals that slice of the full gradient."""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
from loop_helpers import spawn_ranks
from safetensors.torch import load_file, save_file

from miles_platform.cluster.ports import free_port

VOCAB, PADDED, B, T, K = 130, 256, 3, 7, 4


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, PADDED, generator=g) * 3
    logits[..., VOCAB:] = 0.0  # the padded rows of the output layer are zero
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    support = torch.randint(0, VOCAB, (B, T - 1, K), generator=g)
    support[..., 0] = ids[:, 1:]  # the sampled token is in its support
    support[0, 2, 2:] = -1  # a shorter support
    support[1] = -1  # a row sampled from the full vocabulary
    cands = torch.randint(0, VOCAB, (B, T - 1, K), generator=g)
    cands[2, :, 3] = -1
    return logits, ids, support, cands


def _request(ids, support, cands):
    from miles_platform.training.backend import ScoreRequest

    return ScoreRequest(ids, torch.arange(T).expand(B, T), 0.7, support, True, cands)


def _loss(s):
    return s.log_probs.sum() + 0.3 * s.entropy.sum() + 0.2 * s.candidates.sum()


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from miles_platform.cluster.ports import gloo_on_loopback, tcp_store
    from miles_platform.training.megatron_logprobs import VocabShard, vocab_parallel_scores

    try:
        gloo_on_loopback("127.0.0.1")
        store = tcp_store("127.0.0.1", port, world, rank == 0, timeout_s=120.0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        logits, ids, support, cands = _inputs()
        width = PADDED // world
        mine = logits[..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
        s = vocab_parallel_scores(
            mine, _request(ids, support, cands), VocabShard(width, VOCAB, rank, world, None)
        )
        _loss(s).backward()
        save_file({"lp": s.log_probs.detach(), "ent": s.entropy.detach(), "cand": s.candidates.detach(),
                   "grad": mine.grad}, f"{out}/rank{rank}.safetensors")  # fmt: skip
    except Exception:
        Path(f"{out}/rank{rank}.error").write_text(traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_vocab_parallel_scores_equal_full_vocabulary(tmp_path):
    from miles_platform.training.backend import scores_from_logits

    spawn_ranks(_worker, (2, free_port(), str(tmp_path)), 2)
    errors = [p.read_text() for p in tmp_path.glob("*.error")]
    assert not errors, errors[0]
    logits, ids, support, cands = _inputs()
    full = logits[..., :VOCAB].clone().requires_grad_(True)
    ref = scores_from_logits(full, _request(ids, support, cands))
    _loss(ref).backward()
    grad = torch.cat([full.grad, torch.zeros(B, T, PADDED - VOCAB)], dim=-1)  # padding: no gradient
    for rank in range(2):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        torch.testing.assert_close(got["lp"], ref.log_probs.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(got["ent"], ref.entropy.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(got["cand"], ref.candidates.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(got["grad"], grad[..., rank * 128 : (rank + 1) * 128], atol=1e-5, rtol=0)
    assert ref.log_probs[1].ne(ref.log_probs[0]).any()  # the support changed what row 0 scores
