"""`--rm-type f1`: token-level F1 between response and label (SQuAD normalization)."""

from __future__ import annotations

import re
import string
from collections import Counter


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_reward(response: str, label: str | None) -> float:
    if label is None:
        return 0.0
    pred, gold = normalize_answer(response).split(), normalize_answer(str(label)).split()
    common = Counter(pred) & Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)
