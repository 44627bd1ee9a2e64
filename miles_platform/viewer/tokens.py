"""Per-token text and per-token shading of one sample's response.

Token text comes from the run's tokenizer (`tokenizer.json` of its HF dir, loaded once with the
`tokenizers` library: no transformers, no torch) and falls back to the token ids. A shade is one
value per response token and a colour rule:

- advantage:  the trainer's advantage (`train_samples.advantage`), green above 0, red below
- gap:        trainer minus rollout log-prob (`train_samples.log_probs - rollout_log_probs`)
- loss_mask:  the tokens the loss saw (`train_samples.loss_mask`, else the rollout's)
- teacher:    OPD: teacher minus rollout log-prob (`teacher_log_probs - rollout_log_probs`)
- logprob:    the engine's log-prob of the sampled token (`rollout_log_probs`): the darker, the less likely
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any

SHADES = {
    "advantage": "advantage (trainer)",
    "gap": "trainer − rollout log-prob",
    "loss_mask": "loss mask",
    "teacher": "teacher − rollout log-prob (OPD)",
    "logprob": "rollout log-prob",
}


@functools.lru_cache(maxsize=8)
def _tokenizer(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def token_texts(hf_dir: str | None, ids: list[int]) -> list[str] | None:
    """Each token's text by the tokenizer in `hf_dir`; None without one (callers show the ids)."""
    path = os.path.join(hf_dir, "tokenizer.json") if hf_dir else None
    if not path or not os.path.isfile(path):
        return None
    try:
        tok = _tokenizer(path)
        return [tok.decode([int(t)], skip_special_tokens=False) for t in ids]
    except Exception:  # noqa: BLE001 - a tokenizer that cannot read these ids: show the ids
        return None


def _per_token(value: Any, n: int) -> list[float | None] | None:
    """A per-token list of floats (None where missing), a scalar broadcast, or None."""
    if value is None:
        return None
    if isinstance(value, int | float | bool):
        return [float(value)] * n
    out = [None if v is None else float(v) for v in list(value)[:n]]
    return out + [None] * (n - len(out))


def _diff(a: list[float | None] | None, b: list[float | None] | None) -> list[float | None] | None:
    if a is None or b is None:
        return None
    return [None if x is None or y is None else x - y for x, y in zip(a, b)]


@dataclass
class TokenValues:
    """Every per-token series of one sample that the page can shade or show on hover."""

    n: int
    series: dict[str, list[float | None]]  # name -> one value per response token
    clipped: list[bool] | None

    def available(self) -> list[str]:
        return [s for s in SHADES if s in self.series]

    def default_shade(self) -> str:
        return next((s for s in ("advantage", "gap", "logprob", "loss_mask") if s in self.series), "")


def token_values(sample: dict[str, Any], train: dict[str, Any] | None) -> TokenValues:
    n = len(sample.get("response_tokens") or [])
    rollout = _per_token(sample.get("rollout_log_probs"), n)
    series: dict[str, list[float | None] | None] = {"logprob": rollout}
    if train is not None:
        trainer = _per_token(train.get("log_probs"), n)
        series["advantage"] = _per_token(train.get("advantage"), n)
        series["gap"] = _diff(trainer, _per_token(train.get("rollout_log_probs"), n) or rollout)
        series["loss_mask"] = _per_token(train.get("loss_mask"), n)
        series["trainer logprob"] = trainer
        series["ratio"] = _per_token(train.get("ratio"), n)
        series["ref_kl"] = _per_token(train.get("ref_kl"), n)
    if series.get("loss_mask") is None:
        series["loss_mask"] = _per_token(sample.get("loss_mask"), n)
    series["teacher"] = _diff(_per_token(sample.get("teacher_log_probs"), n), rollout)
    series["teacher logprob"] = _per_token(sample.get("teacher_log_probs"), n)
    clipped = train.get("clipped") if train is not None else None
    clipped = (
        [bool(c) for c in clipped][:n] if clipped is not None and not isinstance(clipped, bool) else None
    )
    kept = {k: v for k, v in series.items() if v is not None and any(x is not None for x in v)}
    return TokenValues(n, kept, clipped)


def shade_scale(values: list[float | None]) -> float:
    finite = [abs(v) for v in values if v is not None and math.isfinite(v)]
    return max(finite, default=1.0) or 1.0


def shade_color(shade: str, value: float | None, scale: float) -> str:
    """The background of a token with `value` under `shade` (CSS colour; "" for none)."""
    if value is None or not math.isfinite(value):
        return ""
    if shade == "loss_mask":
        return "rgba(0, 90, 220, 0.16)" if value else "rgba(110, 110, 110, 0.35)"
    if shade == "logprob":  # the less likely the token (1 - p), the deeper, on one scale for every sample
        alpha = 0.04 + 0.66 * (1.0 - math.exp(min(0.0, value)))
        return f"rgba(230, 120, 0, {alpha:.2f})"
    alpha = 0.08 + 0.62 * min(1.0, abs(value) / scale)
    return f"rgba(0, 150, 60, {alpha:.2f})" if value > 0 else f"rgba(215, 30, 30, {alpha:.2f})"


def routed_experts_of(sample: dict[str, Any]) -> tuple[list[list[int] | None], str] | None:
    """R3: per response token the experts of layer 0 it went through (None for the last token, which
    the engine never ran), and a summary `tokens x layers x top_k`; None when not recorded."""
    routes = sample.get("rollout_routed_experts")
    if not routes:
        return None
    p, n = len(sample.get("prompt_tokens") or []), len(sample.get("response_tokens") or [])
    layers = len(routes[0]) if routes[0] else 0
    top_k = len(routes[0][0]) if layers else 0
    per_token = []
    for i in range(n):
        pos = p + i  # the routes of the position holding response token i
        per_token.append(list(routes[pos][0]) if pos < len(routes) and routes[pos] else None)
    return per_token, f"{len(routes)} tokens × {layers} layers × top-{top_k}"
