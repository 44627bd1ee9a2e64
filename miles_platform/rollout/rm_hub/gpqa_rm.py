"""`--rm-type gpqa`: multiple choice, Miles' rule-based GPQA scorer. The correct letter comes from
metadata `correct_letter`, a one-letter label, an integer label (an index into the letters) or the
label's text matched against metadata `choices`; the response's letter is the first "answer is X" /
"X is correct" / "final answer: X" after any `</think>`, else its last standalone valid capital. With
no letter to compare, the correct choice's text (or `correct_answer` / `answer_text`) anywhere in the
response, normalized, scores 1."""

from __future__ import annotations

import re
import string

LETTERS = list(string.ascii_uppercase[:8])
_PATTERNS = (
    r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])",
    r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)",
    r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])",
)


def _after_thinking(text: str) -> str:
    return text.rsplit("</think>", 1)[-1] if "</think>" in text else text


def _normalize(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def _letter_of(response: str, valid: list[str]) -> str | None:
    text = _after_thinking(response)
    for pattern in _PATTERNS:
        m = re.search(pattern, text, flags=re.IGNORECASE)
        if m and m.group(1).upper() in valid:
            return m.group(1).upper()
    for letter in reversed(re.findall(r"\b([A-Z])\b", text)):
        if letter in valid:
            return letter
    return None


def gpqa_reward(response: str, label, metadata: dict | None = None) -> float:
    if not response:
        return 0.0
    meta = dict(metadata or {})
    choices = meta.get("choices")
    choices = list(choices.values()) if isinstance(choices, dict) else (list(choices) if choices else None)
    if meta.get("valid_letters"):
        valid = [str(x).upper() for x in meta["valid_letters"]]
    else:
        valid = list(string.ascii_uppercase[: len(choices)]) if choices else LETTERS
    correct = meta["correct_letter"].strip().upper() if isinstance(meta.get("correct_letter"), str) else None
    text = None
    if isinstance(label, str):
        text = label.strip()
        if len(text) == 1 and text.upper() in valid and not correct:
            correct = text.upper()
    elif isinstance(label, int | float) and not isinstance(label, bool) and 0 <= int(label) < len(valid):
        correct = valid[int(label)]
    if not correct and choices and text:
        for i, choice in enumerate(choices):
            if _normalize(str(choice)) == _normalize(text):
                correct = valid[i]
                meta.setdefault("correct_answer", choice)
                break
    picked = _letter_of(response, valid)
    if picked and correct:
        return 1.0 if picked == correct else 0.0
    targets = []
    if correct and choices and correct in valid and valid.index(correct) < len(choices):
        targets.append(str(choices[valid.index(correct)]))
    targets += [str(meta[k]) for k in ("correct_answer", "answer_text") if meta.get(k)]
    if text:
        targets.append(text)
    said = _normalize(_after_thinking(response))
    if any(t and t in said for t in {_normalize(x) for x in targets if x}):
        return 1.0
    if picked and not correct and text:
        return 1.0 if picked == text.upper() else 0.0
    return 0.0


async def gpqa_rm(rewards, sample, response: str) -> float:
    return gpqa_reward(response, sample.label, sample.metadata if isinstance(sample.metadata, dict) else None)
