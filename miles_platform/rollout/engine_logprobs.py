"""SGLang's log-prob extras for the embedded engine: input (prefill) log-probs, top-logprobs and
log-probs of chosen token ids, with SGLang's request fields and `meta_info` shapes.

Request fields (top level of a `/generate` body, a list per prompt in a batch or one value for all):
  logprob_start_len   first input position to score (-1, the default: none; 0: the whole input)
  top_logprobs_num    k: the k most likely tokens at every scored position
  token_ids_logprob   token ids to report at every scored position
  return_text_in_logprobs   the token's text instead of None in each entry

Answer (`meta_info`, only with `return_logprob`), entries `[logprob, token_id, text-or-None]`:
  input_token_logprobs       one per input token from logprob_start_len; position 0 has no
                             left context, so its logprob is None (as in SGLang)
  input_top_logprobs         per input position, the top-k entries (None at position 0)
  input_token_ids_logprobs   per input position, the entries of token_ids_logprob (None at 0)
  output_top_logprobs / output_token_ids_logprobs   the same per generated token

A prefill-only request (`max_new_tokens` 0, `return_logprob`, `logprob_start_len` >= 0) is how a
teacher scores a student's tokens (on-policy distillation, docs/opd.md). Log-probs are
log_softmax(logits / T) over the full vocabulary with the request's temperature (0 scores at T = 1),
the same contract as `output_token_logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# logits of one scoring forward kept under this many floats (B x L x V); bigger batches are chunked
_MAX_LOGIT_FLOATS = 64 * 1024 * 1024


@dataclass(frozen=True)
class LogprobOptions:
    start_len: int = -1
    top_k: int = 0
    token_ids: tuple[int, ...] = ()
    with_text: bool = False

    @property
    def wants_input(self) -> bool:
        return self.start_len >= 0

    @property
    def wants_extras(self) -> bool:
        return self.top_k > 0 or bool(self.token_ids)


def parse_logprob_options(body: dict, n: int, is_batch: bool, vocab_size: int, error) -> list[LogprobOptions]:
    """The per-prompt LogprobOptions of a `/generate` body; `error(msg)` raises the engine's 400.
    A body that sets none of them shares one (frozen) default among its prompts."""
    text = bool(body.get("return_text_in_logprobs", False))
    if all(body.get(k) is None for k in ("logprob_start_len", "top_logprobs_num", "token_ids_logprob")):
        return [LogprobOptions(with_text=text)] * n

    def per_prompt(name, default, is_one):
        v = body.get(name)
        if v is None:
            return [default] * n
        if is_batch and isinstance(v, list) and not is_one(v):
            if len(v) != n:
                error(f"{name} has {len(v)} entries for {n} prompts")
            return [default if x is None else x for x in v]
        return [v] * n

    def is_id_list(v):  # a flat list of ids is one value (broadcast), a list of lists is per prompt
        return not v or not all(x is None or isinstance(x, list) for x in v)

    starts = per_prompt("logprob_start_len", -1, lambda v: False)
    tops = per_prompt("top_logprobs_num", 0, lambda v: False)
    ids = per_prompt("token_ids_logprob", [], is_id_list)
    out = []
    for s, k, t in zip(starts, tops, ids, strict=True):
        if not isinstance(s, int) or isinstance(s, bool) or s < -1:
            error(f"logprob_start_len={s!r}: must be -1 (output only) or an integer >= 0")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= vocab_size:
            error(f"top_logprobs_num={k!r}: must be an integer in [0, {vocab_size}]")
        if not isinstance(t, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in t):
            error(f"token_ids_logprob={t!r}: must be a list of token ids (a list of such lists in a batch)")
        bad = [x for x in t if not 0 <= x < vocab_size]
        if bad:
            error(f"token_ids_logprob {bad[:5]} out of vocabulary [0, {vocab_size})")
        out.append(LogprobOptions(s, k, tuple(t), text))
    return out


def _entries(lps: list[float], ids: list[int], opts: LogprobOptions, tokenizer) -> list[list]:
    return [
        [lp, t, tokenizer.decode([t]) if opts.with_text else None] for lp, t in zip(lps, ids, strict=True)
    ]


def step_extras(log_probs: torch.Tensor, opts: LogprobOptions, tokenizer) -> tuple[list | None, list | None]:
    """[P, V] log-probs of P positions -> (top-k entries per position, token-id entries per position)."""
    top = ids = None
    if opts.top_k > 0:
        v, i = log_probs.topk(opts.top_k, dim=-1)
        top = [_entries(a, b, opts, tokenizer) for a, b in zip(v.tolist(), i.tolist(), strict=True)]
    if opts.token_ids:
        want = list(opts.token_ids)
        vals = log_probs[:, want].tolist()
        ids = [_entries(row, want, opts, tokenizer) for row in vals]
    return top, ids


def temperature_of(t: float) -> float:
    return t if t > 0 else 1.0


@torch.no_grad()
def input_logprobs(model, contexts: list[list[int]], options: list[LogprobOptions], temps: list[float], tokenizer) -> list[dict]:  # fmt: skip
    """The input log-prob fields of `meta_info` for each context, from batched full forwards."""
    vocab = int(model.config.vocab_size)
    out: list[dict] = []
    i = 0
    while i < len(contexts):
        width, j = 0, i  # the largest chunk whose padded logits fit the budget (at least one row)
        while j < len(contexts):
            w = max(width, len(contexts[j]))
            if j > i and (j - i + 1) * w * vocab > _MAX_LOGIT_FLOATS:
                break
            width, j = w, j + 1
        out += _score_chunk(model, contexts[i:j], options[i:j], temps[i:j], tokenizer, width)
        i = j
    return out


def _score_chunk(model, contexts, options, temps, tokenizer, width) -> list[dict]:
    ids = torch.zeros(len(contexts), width, dtype=torch.long)
    mask = torch.zeros(len(contexts), width, dtype=torch.long)
    for r, c in enumerate(contexts):  # right padding: positions 0..len-1 are the real tokens
        ids[r, : len(c)] = torch.tensor(c)
        mask[r, : len(c)] = 1
    full = bool(mask.all())
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)  # staged on the host, one copy each
    logits = model(input_ids=ids, attention_mask=None if full else mask, use_cache=False).logits
    results = []
    for r, (c, opts, t) in enumerate(zip(contexts, options, temps, strict=True)):
        start = opts.start_len
        # position p - 1 predicts token p: rows start-1 .. len-2 score tokens start .. len-1
        lo = max(start, 1)
        lp = torch.log_softmax(logits[r, lo - 1 : len(c) - 1].float() / temperature_of(t), dim=-1)
        targets = torch.tensor(c[lo:], dtype=torch.long, device=device)
        picked = lp.gather(-1, targets[:, None]).squeeze(-1).tolist() if len(targets) else []
        head = [[None, c[0], tokenizer.decode([c[0]]) if opts.with_text else None]] if start == 0 else []
        meta = {"input_token_logprobs": head + _entries(picked, c[lo:], opts, tokenizer)}
        top, tid = step_extras(lp, opts, tokenizer)
        pad = [None] if start == 0 else []
        if opts.top_k > 0:
            meta["input_top_logprobs"] = pad + top
        if opts.token_ids:
            meta["input_token_ids_logprobs"] = pad + tid
        results.append(meta)
    return results
