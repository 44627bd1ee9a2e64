"""Log-probabilities of chosen tokens and entropy from logits, chunked over the sequence.

A full `log_softmax` materializes [T, V] in fp32 (V ~ 150k for Qwen3: 0.6 MB per token). The
chunked path computes logsumexp and the gathered logit per chunk of positions, so peak extra
memory is [chunk, V]. All math is fp32 whatever the logits dtype (bf16 logits lose ~3 digits).
"""

from __future__ import annotations

import torch


def log_probs_reference(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(-1, tokens.unsqueeze(-1).long()).squeeze(-1)


def selective_log_softmax(logits: torch.Tensor, tokens: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """log p(tokens[..., t] | logits[..., t, :]) in fp32; logits [..., T, V], tokens [..., T]."""
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} disagree")
    flat = logits.reshape(-1, logits.shape[-1])
    tok = tokens.reshape(-1).long()
    out = torch.empty(tok.shape, dtype=torch.float32, device=logits.device)
    for s in range(0, flat.shape[0], chunk_size):
        chunk = flat[s : s + chunk_size].float()
        picked = chunk.gather(-1, tok[s : s + chunk_size, None]).squeeze(-1)
        out[s : s + chunk_size] = picked - torch.logsumexp(chunk, dim=-1)
    return out.reshape(tokens.shape)


def entropy_reference(logits: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits.float(), dim=-1)
    return -(lp.exp() * lp).sum(-1)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy per position in fp32: logsumexp(z) - sum softmax(z) * z, chunked."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for s in range(0, flat.shape[0], chunk_size):
        z = flat[s : s + chunk_size].float()
        lse = torch.logsumexp(z, dim=-1)
        p = torch.exp(z - lse[:, None])
        out[s : s + chunk_size] = lse - (p * z).sum(-1)
    return out.reshape(logits.shape[:-1])
