"""The engine's candidate log-probs per generated token: `Sample.rollout_topk_token_ids` and
`rollout_topk_log_probs`, each [response_length][K] (Miles' fields). Score centering reads them as
H and q[H]; top-k OPD as the student's rollout top-k.

Two sources, as in Miles (docs/algorithms.md, "Score centering"):
  selected  unfiltered sampling, `top_logprobs_num` K: `meta_info.output_top_logprobs`, the K most
            likely tokens of the sampler distribution log_softmax(logits / T)
  support   filtered sampling (top-k / top-p), `sampling_logprobs_mode: "support"` with
            `return_sampling_mask`: the whole realized support (`output_token_sampling_mask`) with
            each id's post-filter log-prob (`output_token_sampling_logprobs` rows); the sampled
            token's rollout log-prob is read from its row
Unused slots and rows the model did not sample (tool output) hold id -1 and log-prob -inf. Every
per-token edit of a sample (tool tokens, truncation) keeps the rows aligned with response_tokens.
"""

from __future__ import annotations

from typing import Any

from miles_platform.data.sample import Sample

PAD_ID, PAD_LOG_PROB = -1, float("-inf")


def request_fields(k: int, replay: bool) -> dict[str, Any]:
    """The `/generate` body fields that ask for K candidates per generated token (none for K = 0):
    the whole support under sampling-support replay, else the sampler's top K."""
    if k <= 0:
        return {}
    return {"sampling_logprobs_mode": "support"} if replay else {"top_logprobs_num": k}


def _rows(ids: list[list[int]], lps: list[list[float]], width: int, source: str):
    out_ids, out_lps = [], []
    for i, (row_ids, row_lps) in enumerate(zip(ids, lps, strict=True)):
        if len(row_ids) > width:
            raise RuntimeError(
                f"{source}: token {i} has {len(row_ids)} candidates, more than the K = {width} the rows "
                "hold (--rollout-top-logprobs-num); raise K to at least --rollout-top-k"
            )
        pad = width - len(row_ids)
        out_ids.append([int(t) for t in row_ids] + [PAD_ID] * pad)
        out_lps.append([PAD_LOG_PROB if x is None else float(x) for x in row_lps] + [PAD_LOG_PROB] * pad)
    return out_ids, out_lps


def _extend(sample: Sample, ids: list[list[int]], lps: list[list[float]]) -> None:
    sample.rollout_topk_token_ids = list(sample.rollout_topk_token_ids or []) + ids
    sample.rollout_topk_log_probs = list(sample.rollout_topk_log_probs or []) + lps


def append_top_rows(sample: Sample, top: list[list], width: int = 0) -> None:
    """`output_top_logprobs` (per token, entries [log-prob, id, text]) as rows of `width` slots
    (0: the widest row's). A null log-prob (-inf through JSON) is stored as -inf."""
    width = width or max((len(e) for e in top), default=0)
    ids = [[e[1] for e in entries] for entries in top]
    lps = [[e[0] for e in entries] for entries in top]
    _extend(sample, *_rows(ids, lps, width, "output_top_logprobs"))


def append_support_rows(
    sample: Sample, token_ids: list[int], supports: list[list[int]], rows: list[list[float]], width: int
) -> list[float]:
    """Support mode: the supports and their log-prob rows as candidate rows; returns the sampled
    tokens' log-probs, each read from its row."""
    if any(not isinstance(r, list) or len(r) != len(s) for r, s in zip(rows, supports, strict=True)):
        raise RuntimeError(
            "score centering with filtered sampling: output_token_sampling_logprobs must hold one row per "
            "token, one log-prob per support id (sampling_logprobs_mode 'support': SGLang with PR #40932 "
            "or the embedded engine)"
        )
    picked = []
    for i, (t, sup, row) in enumerate(zip(token_ids, supports, rows, strict=True)):
        if t not in sup:
            raise RuntimeError(f"output_token_sampling_mask: token {i} ({t}) is not in its own support")
        picked.append(float(row[sup.index(t)]))
    _extend(sample, *_rows(supports, rows, width, "output_token_sampling_mask"))
    return picked


def append_unsampled_rows(sample: Sample, n: int) -> None:
    """Rows for `n` tokens the model did not sample (tool output): no candidates."""
    if sample.rollout_topk_token_ids is None:
        return
    width = len(sample.rollout_topk_token_ids[0]) if sample.rollout_topk_token_ids else 0
    _extend(sample, [[PAD_ID] * width for _ in range(n)], [[PAD_LOG_PROB] * width for _ in range(n)])


def truncate_rows(sample: Sample, n: int) -> None:
    if sample.rollout_topk_token_ids is not None:
        sample.rollout_topk_token_ids = sample.rollout_topk_token_ids[:n]
        sample.rollout_topk_log_probs = (sample.rollout_topk_log_probs or [])[:n]
