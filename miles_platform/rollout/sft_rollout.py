"""SFT as Miles runs it through train.py: `--rollout-function-path miles.rollout.sft_rollout.generate_rollout
--loss-type sft_loss --debug-train-only` (Miles' name maps here, plugins.MILES_BUILTINS). Nothing is
generated and no engine starts: each prompt record is a finished conversation (`--input-key
messages`: a list of {role, content}), rendered with the tokenizer's chat template, and the loss
covers the assistant turns (their content and end-of-turn token, not the role header), as Miles'
MultiTurnLossMaskGenerator does: an assistant message with `"step_loss_mask": 0` is context, and
the record's `tools` (under --metadata-key) go to the template. Each record is a group of one
sample with reward 0.

The conversation is rendered turn by turn (the template applied to the first i messages, i = 1..n),
so every message is one tokenized segment whose mask is its role's; a template that does not render
a conversation as a prefix of its continuation is refused.
"""

from __future__ import annotations

import json
from typing import Any

from miles_platform.data.sample import Sample
from miles_platform.errors import ConfigError, DataError

__all__ = ["conversation_tokens", "generate_rollout"]

_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(path: str):
    if path not in _TOKENIZERS:
        from miles_platform.models.checkpoint import load_tokenizer

        _TOKENIZERS[path] = load_tokenizer(path)
    return _TOKENIZERS[path]


def _render(tok, messages: list[dict], generation_prompt: bool = False, tools: list | None = None) -> str:
    if not messages:
        return ""
    kw = {"tools": tools} if tools else {}
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kw)


def _trained(m: dict, i: int, where: str) -> int:
    """1 for an assistant message unless its `step_loss_mask` (Miles' per-turn switch) is 0."""
    step = m.get("step_loss_mask", 1)
    if step not in (0, 1):
        raise DataError(f"{where}: message {i} has step_loss_mask {step!r}: 0 or 1")
    return int(m["role"] == "assistant" and step == 1)


def conversation_tokens(
    tok, messages: list[dict], where: str = "", tools: list | None = None
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a conversation: 1 on each assistant message's content and end of
    turn, 0 on everything else (system / user / tool messages, role headers, an assistant message
    with `step_loss_mask` 0). `tools`: the tool schemas the template renders (Miles: the record's
    metadata["tools"])."""
    if not getattr(tok, "chat_template", None):
        raise DataError(f"{where}: SFT on messages needs a tokenizer with a chat template")
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise DataError(f"{where}: message {i} needs a role")
        text = _render(tok, messages[: i + 1], tools=tools)
        header = ""
        if m["role"] == "assistant":  # the role header is the prompt's, not the answer's
            opened = _render(tok, messages[:i], generation_prompt=True, tools=tools)
            header = opened[len(done) :] if opened.startswith(done) else ""
        if not text.startswith(done + header):
            raise DataError(
                f"{where}: the chat template does not render messages[:{i + 1}] as a continuation of "
                f"messages[:{i}]; Miles' SFT masks need one that does"
            )
        for part, trained in ((header, 0), (text[len(done) + len(header) :], _trained(m, i, where))):
            if part:
                t = tok.encode(part, add_special_tokens=False)
                ids += t
                mask += [trained] * len(t)
        done = text
    return ids, mask


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> list[list[Sample]]:
    """`--rollout-batch-size` conversations from the data source, one group of one sample each:
    prompt = everything before the first trained token, response = the rest, loss mask per token."""
    if evaluation:
        raise ConfigError("miles.rollout.sft_rollout.generate_rollout has no eval: drop --eval-interval")
    tok = _tokenizer(args.hf_checkpoint)
    groups = []
    for rec in data_source.get_samples(args.rollout_batch_size):
        where = f"--prompt-data {args.prompt_data} (record {rec.id})"
        try:
            messages = json.loads(rec.prompt)
        except json.JSONDecodeError:
            raise DataError(
                f"{where}: SFT records are conversations: a messages list under --input-key"
            ) from None
        if not isinstance(messages, list):
            raise DataError(f"{where}: SFT records are conversations: a messages list under --input-key")
        ids, mask = conversation_tokens(tok, messages, where, tools=(rec.metadata or {}).get("tools"))
        if 1 not in mask[1:]:
            raise DataError(f"{where}: no assistant message to train on")
        first = mask.index(1, 1)
        groups.append([
            Sample(
                rollout_id=rollout_id, prompt=rec.prompt, prompt_tokens=ids[:first], response_tokens=ids[first:],
                response=tok.decode(ids[first:]), loss_mask=mask[first:], label=rec.label,
                reward=0.0, raw_reward=0.0, metadata={**rec.metadata, "prompt_id": rec.id},
            )
        ])  # fmt: skip
    return groups
