"""`--rm-type deepscaler`: needs a `</think>`; the boxed answer after it is graded like `math`."""

from __future__ import annotations

from miles_platform.rollout.rm_hub.boxed import last_boxed, strip_boxed
from miles_platform.rollout.rm_hub.math_rm import math_equal


def deepscaler_reward(response: str, label: str | None) -> float:
    if "</think>" not in response or label is None or str(label).strip() == "":
        return 0.0
    answer = last_boxed(response.split("</think>")[-1])
    if answer is None:
        return 0.0
    return 1.0 if math_equal(answer, strip_boxed(str(label))) else 0.0
