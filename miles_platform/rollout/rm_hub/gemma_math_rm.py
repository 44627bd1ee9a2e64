"""`--rm-type gemma_math`: Gemma-4 closes its thinking with `<channel|>`; the last boxed answer after
the last one is graded like `math` (Miles' `get_gemma_math_reward`; no thinking marker: the whole
response is graded)."""

from __future__ import annotations

from miles_platform.rollout.rm_hub.boxed import last_boxed, strip_boxed
from miles_platform.rollout.rm_hub.math_rm import math_equal


def gemma_math_reward(response: str, label: str | None) -> float:
    if label is None or str(label).strip() == "":
        return 0.0
    answer = last_boxed(response.split("<channel|>")[-1])
    if answer is None:
        return 0.0
    return 1.0 if math_equal(answer, strip_boxed(str(label))) else 0.0
