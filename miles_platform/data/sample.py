"""Sample: one response to one prompt. Field names follow Miles' `Sample`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from miles_platform.data.images import image_hash


class Status(StrEnum):
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Sample:
    run: str = ""
    rollout_id: int = 0
    group_index: int = 0  # which prompt group within the rollout
    index: int = 0  # global sample index within the rollout
    prompt: str = ""
    prompt_tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_tokens: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    # sampling-support replay (top-k / top-p rollouts): per response token, the token ids it was
    # drawn from; rollout_log_probs are then renormalized over that support. None: full vocabulary.
    rollout_sampling_support: list[list[int]] | None = None
    loss_mask: list[int] = field(default_factory=list)
    label: str | None = None
    reward: float | dict[str, float] | None = None
    raw_reward: float | None = None
    status: str = Status.COMPLETED.value
    weight_version_start: int = 0
    weight_version_end: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    remove_sample: bool = False
    # on-policy distillation (docs/opd.md): per response token, the teacher's log-prob of the token
    # (sampled-token OPD) or the top-k reverse-KL estimate (--opd-log-prob-top-k > 0); None: not scored
    teacher_log_probs: list[float] | None = None
    opd_reverse_kl: list[float] | None = None
    # multi-turn episodes: one entry per assistant or tool turn, in order (see make_turn); None for
    # single-turn samples. Spans index response_tokens, so loss masks and log-probs of a turn are
    # response_tokens[start:end] of the same row.
    turns: list[dict[str, Any]] | None = None
    # R3 (MoE, --use-rollout-routing-replay): the engine's top-k experts of every token but the
    # last, [len(tokens) - 1][num_layers][top_k] (SGLang's routed_experts); None: not recorded
    rollout_routed_experts: list[list[list[int]]] | None = None
    # diffusion runs (miles_platform/diffusion): the generated image as PNG, and per recorded
    # denoising transition its step index and the engine's log-prob; None for LLM samples
    image_png: bytes | None = None
    diffusion_steps: list[int] | None = None
    diffusion_log_probs: list[float] | None = None
    # the engine's candidates per response token, [response_length][K] (rollout/candidates.py): the
    # sampler's top K, or under filtered sampling its whole support; unused slots and tool rows
    # hold id -1 / log-prob -inf. Score centering's H and q[H]; None: not recorded
    rollout_topk_token_ids: list[list[int]] | None = None
    rollout_topk_log_probs: list[list[float]] | None = None
    # vision-language prompts (--multimodal-keys): the prompt's images as data URIs (SGLang's
    # image_data), in order; prompt_tokens carry their expanded image pads. Shards keep only each
    # image's content hash (`image_hashes`, data/images.py). None: a text prompt
    image_data: list[str] | None = None

    def nonfinite_field(self) -> str | None:
        """The first training input of this sample that is NaN or infinite (the reward, or a
        log-prob at a trained token), or None. Such a sample is removed from the loss."""
        if self.raw_reward is not None and not math.isfinite(self.raw_reward):
            return "raw_reward"
        mask = self.loss_mask or [1] * len(self.rollout_log_probs)
        for name in ("rollout_log_probs", "teacher_log_probs", "opd_reverse_kl"):
            values = getattr(self, name)
            if values and any(m and not math.isfinite(v) for v, m in zip(values, mask, strict=False)):
                return name
        return None

    @property
    def tokens(self) -> list[int]:
        return list(self.prompt_tokens) + list(self.response_tokens)

    @property
    def response_length(self) -> int:
        return len(self.response_tokens)

    def scalar_reward(self, key: str | None = None) -> float:
        """The training reward: the float, or `reward[key]` for dict rewards (--reward-key)."""
        r = self.reward
        if isinstance(r, dict):
            if key is None:
                raise ValueError(f"reward is a dict {sorted(r)}; pass --reward-key to pick one")
            if key not in r:
                raise ValueError(f"--reward-key {key!r} not in reward dict keys {sorted(r)}")
            return float(r[key])
        return 0.0 if r is None else float(r)

    def to_row(self) -> dict[str, Any]:
        """Flat row for Parquet: reward dicts and metadata as JSON text."""
        # shallow: the row is read (Parquet, JSON) and dropped, never written back into; asdict's
        # deep copy of every token list was ~60 us a sample, most of a shard write
        row = {name: getattr(self, name) for name in _FIELDS if name not in _REPLACED}
        row.update({name: value(self) for name, value in ROW_COMPUTED.items()})
        return row

    def scalar_reward_or_none(self) -> float | None:
        r = self.reward
        if isinstance(r, dict):
            return None if self.raw_reward is None else float(self.raw_reward)
        return None if r is None else float(r)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Sample:
        row = dict(row)
        row.pop("response_length", None)
        row.pop("image_hashes", None)  # the images themselves are the prompt dataset's
        reward_json = row.pop("reward_json", None)
        if reward_json:
            row["reward"] = json.loads(reward_json)
        meta = row.get("metadata")
        if isinstance(meta, str):
            row["metadata"] = json.loads(meta) if meta else {}
        for k in ("prompt_tokens", "response_tokens", "rollout_log_probs", "loss_mask"):
            if row.get(k) is not None:
                row[k] = list(row[k])
        for k in ("teacher_log_probs", "opd_reverse_kl"):
            if row.get(k) is not None:
                row[k] = [float(x) for x in row[k]]
        if row.get("turns") is not None:
            row["turns"] = [_turn_from_row(t) for t in row["turns"]]
        if row.get("rollout_sampling_support") is not None:
            row["rollout_sampling_support"] = [[int(t) for t in s] for s in row["rollout_sampling_support"]]
        if row.get("rollout_topk_token_ids") is not None:
            row["rollout_topk_token_ids"] = [[int(t) for t in r] for r in row["rollout_topk_token_ids"]]
        if row.get("rollout_topk_log_probs") is not None:
            row["rollout_topk_log_probs"] = [[float(x) for x in r] for r in row["rollout_topk_log_probs"]]
        if row.get("rollout_routed_experts") is not None:
            row["rollout_routed_experts"] = [
                [[int(e) for e in k] for k in t] for t in row["rollout_routed_experts"]
            ]
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in row.items() if k in names})


_FIELDS = tuple(f.name for f in fields(Sample))
# json.dumps(x, default=str), its encoder built once (json.dumps builds one a call when given `default`)
_JSON_OR_STR = json.JSONEncoder(default=str).encode
# `to_row`'s columns computed from the sample (a shard's table builds them a column at a time:
# store/shards.samples_to_table); they replace the fields `_REPLACED` names and the metadata dict
ROW_COMPUTED: dict[str, Any] = {
    "image_hashes": lambda s: [image_hash(u) for u in s.image_data] if s.image_data else None,
    "reward": lambda s: s.scalar_reward_or_none(),
    "reward_json": lambda s: json.dumps(s.reward) if isinstance(s.reward, dict) else None,
    "metadata": lambda s: _JSON_OR_STR(s.metadata),
    "response_length": lambda s: len(s.response_tokens),
}
_REPLACED = frozenset({"image_data", *ROW_COMPUTED})


def make_turn(
    role: str,
    text: str,
    start: int,
    end: int,
    finish_reason: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A turn as stored (store/schemas.py TURN_TYPE): role "assistant" (the model's tokens) or "tool"
    (what the tools answered, loss mask 0); tool_calls on an assistant turn are the calls the parser
    read from it (name, arguments, result, error), on a tool turn the same calls with their result or
    error."""
    calls = [
        {
            "name": str(c["name"]),
            "arguments": c["arguments"] if isinstance(c["arguments"], str) else json.dumps(c["arguments"]),
            "result": c.get("result"),
            "error": c.get("error"),
        }
        for c in tool_calls or []
    ]
    return {
        "role": role,
        "text": text,
        "start": int(start),
        "end": int(end),
        "finish_reason": finish_reason,
        "tool_calls": calls,
    }


def _turn_from_row(t: dict[str, Any]) -> dict[str, Any]:
    t = dict(t)
    t["tool_calls"] = [dict(c) for c in t.get("tool_calls") or []]
    return t
