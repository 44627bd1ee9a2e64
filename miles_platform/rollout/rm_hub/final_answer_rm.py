"""`--rm-type final_answer`: the exact final answer of a multi-turn (tool-calling) response, 1.0 / 0.0.

The final assistant turn is the text after the last tool answer: after the chat template's next
assistant prompt (`<|im_start|>assistant\\n`, as multi_turn appends it) or, without a chat template,
after the last `</tool_response>`; a single-turn response is all final turn. Its last integer must
equal the label, so the tool's own output never counts as the model's answer. A truncated episode
(status `truncated`) gets 0: it ran out of budget before a final answer.
"""

from __future__ import annotations

import re

from miles_platform.data.sample import Status

TURN_MARKERS = ("<|im_start|>assistant\n", "</tool_response>")
_INT = re.compile(r"-?\d+")


def final_turn(response: str) -> str:
    """The text after the last tool answer (the whole response when there is none)."""
    cut = max((response.rfind(m) + len(m) for m in TURN_MARKERS if m in response), default=0)
    return response[cut:]


def final_answer_reward(response: str, label: str | None) -> float:
    if label is None or not str(label).strip():
        return 0.0
    numbers = _INT.findall(final_turn(response))
    if not numbers:
        return 0.0
    gold = str(label).strip()
    return 1.0 if numbers[-1] == gold or (_INT.fullmatch(gold) and int(numbers[-1]) == int(gold)) else 0.0


async def final_answer_rm(rewards, sample, response: str) -> float:
    if sample.status == Status.TRUNCATED.value:
        return 0.0
    return final_answer_reward(response, sample.label)
