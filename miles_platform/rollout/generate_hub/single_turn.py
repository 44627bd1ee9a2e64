"""One `/generate` per sample (Miles' generate_hub/single_turn.py).

The default rollout does the same thing batched (RolloutManager's fast path, one request per
round); this is the per-sample form, and the shape to copy for a custom generate function.
"""

from __future__ import annotations

import copy

from miles_platform.data.sample import Status
from miles_platform.rollout.base_types import GenerateFnInput, GenerateFnOutput
from miles_platform.rollout.generate_hub.endpoint import (
    append_output,
    finish_status,
    post,
    request_payload,
    routes_shape,
    topk_width,
)


async def generate(input: GenerateFnInput) -> GenerateFnOutput:
    state, sample = input.state, copy.deepcopy(input.sample)
    body = request_payload(state, sample, input.sampling_params, input.evaluation)
    if body is None:  # max_new_tokens 0
        sample.status = Status.TRUNCATED.value
        return GenerateFnOutput(samples=sample)
    out = await post(state.url, body, state.api_key)
    replay = "return_sampling_mask" in body
    finish = append_output(sample, out, replay, routes_shape(state, body), topk_width(state, body))
    sample.status = finish_status(finish)
    return GenerateFnOutput(samples=sample)
