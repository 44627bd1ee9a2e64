"""`--rm-type dapo`: the last `Answer: ...` line against the label, as in Miles' DAPO scorer.

Returns Miles' dict `{"score": +1.0 | -1.0, "acc": 1.0 | 0.0}`; train on it with
`--reward-key score` (the DAPO recipe) or `acc`.
"""

from __future__ import annotations

import re

from miles_platform.rollout.rm_hub.boxed import strip_boxed

_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def normalize_final_answer(answer: str) -> str:
    s = answer.strip()
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\textbf\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\boxed\{(.*)\}", r"\1", s)
    s = s.replace("$", "").replace(" ", "").rstrip(".")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def dapo_reward(response: str, label: str | None) -> dict[str, float]:
    tail = response[-300:]  # Miles: the longest MATH-500 answer is ~160 chars
    found = _ANSWER.findall(tail)
    pred = normalize_final_answer(found[-1]) if found else "[INVALID]"
    gold = normalize_final_answer(strip_boxed(str(label))) if label is not None else None
    try:
        gold = str(int(float(gold)))  # DAPO answers are integers: "42.0" == "42"
    except (TypeError, ValueError, OverflowError):
        pass
    correct = gold is not None and pred == gold
    return {"score": 1.0 if correct else -1.0, "acc": 1.0 if correct else 0.0}
