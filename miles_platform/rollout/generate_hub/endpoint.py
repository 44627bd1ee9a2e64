"""SGLang `/generate` helpers shared by every generate function (Miles' generate_endpoint_utils).

A trajectory is token-in, token-out: each turn sends `prompt_tokens + response_tokens` as
`input_ids`, so what the engine scored is exactly what the trainer will see (no re-tokenizing).
"""

from __future__ import annotations

from typing import Any

from miles_platform.data.sample import Sample, Status
from miles_platform.rollout import candidates
from miles_platform.rollout import client as engine_client
from miles_platform.rollout.base_types import GenerateState

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


async def post(url: str, payload: dict, api_key: str | None = None) -> dict | list[dict]:
    """POST a `/generate` body to `url` (the router or an engine; a trailing /generate is fine),
    with the run's retries, over the run's connection pool when called from a generate function."""
    return await engine_client.post_generate(url, payload, api_key)


def request_payload(
    state: GenerateState, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> dict | None:
    """The next turn's body: the trajectory so far as input_ids, `max_new_tokens` capped by what is
    left of the response budget (`sampling_params["max_new_tokens"]` covers the whole trajectory,
    tool tokens included). None when nothing is left: the trajectory is truncated."""
    left = int(sampling_params.get("max_new_tokens", 0)) - len(sample.response_tokens)
    if left <= 0:
        return None
    body = {
        "input_ids": list(sample.prompt_tokens) + list(sample.response_tokens),
        "sampling_params": {**sampling_params, "max_new_tokens": left},
        "return_logprob": True,
    }
    if sample.image_data:  # a vision-language prompt: its images ride along (SGLang's image_data)
        body["image_data"] = list(sample.image_data)
    if state.sampling_support_replay and not evaluation:
        body["return_sampling_mask"] = True
    if state.lora_path is not None:
        body["lora_path"] = state.lora_path
    if state.moe_shape is not None and not evaluation:
        body["return_routed_experts"] = True
    if state.rollout_top_logprobs_num and not evaluation:  # score centering's candidates
        _check_fixed_sampling(state, body["sampling_params"])
        body.update(candidates.request_fields(state.rollout_top_logprobs_num, state.sampling_support_replay))
    return body


def _check_fixed_sampling(state: GenerateState, params: dict[str, Any]) -> None:
    """Score centering's q is the engine's record at the run's temperature, without min-p: a turn
    that samples otherwise would be centered against a distribution the trainer does not score."""
    want = state.sampling_params.get("temperature")
    if params.get("temperature", want) != want or float(params.get("min_p", 0) or 0) > 0:
        raise RuntimeError(
            f"--loss-type score_centering: a request sampled with temperature {params.get('temperature')} / "
            f"min_p {params.get('min_p', 0)}; every training call must use --rollout-temperature {want} "
            "and min_p 0"
        )


def topk_width(state: GenerateState, body: dict) -> int:
    """`append_output`'s `topk` for the answer to `body`: K when it asked for candidates."""
    asked = "top_logprobs_num" in body or body.get("sampling_logprobs_mode") == "support"
    return state.rollout_top_logprobs_num if asked else 0


def routes_shape(state: GenerateState, body: dict) -> tuple[int, int] | None:
    """`append_output`'s `moe_shape` for the answer to `body`: the model's when it asked for routes."""
    return state.moe_shape if body.get("return_routed_experts") else None


def append_output(
    sample: Sample, output: dict, replay: bool, moe_shape: tuple[int, int] | None = None, topk: int = 0
) -> str:
    """Append one `/generate` answer to the sample: model tokens (loss mask 1) with the engine's
    log-probs (the support-normalized ones and each token's support under replay), the text, the
    weight versions. With `moe_shape` (R3: the request set return_routed_experts) the answer's
    `routed_experts` become the sample's `rollout_routed_experts`: the request fed the whole
    trajectory, so they cover every token of it but the last. The engine's candidates
    (`output_top_logprobs`, or support rows) become `rollout_topk_*` rows of `topk` slots
    (rollout/candidates.py). Returns the finish reason type ("stop", "length", "abort")."""
    meta = output.get("meta_info") or {}
    token_lps = meta.get("output_token_logprobs") or []
    ids = [int(t) for t in output.get("output_ids") or [x[1] for x in token_lps]]
    lps = [float(x[0]) for x in token_lps]
    if len(lps) != len(ids):
        raise RuntimeError(
            f"/generate returned {len(ids)} tokens and {len(lps)} log-probs (return_logprob must be true)"
        )
    if replay:  # the support-normalized log-prob is the behaviour policy's (Miles)
        support, lps = meta.get("output_token_sampling_mask"), meta.get("output_token_sampling_logprobs")
        if support is None or lps is None or len(support) != len(ids) or len(lps) != len(ids):
            raise RuntimeError(
                "sampling-support replay (--rollout-top-k > 0 or --rollout-top-p < 1): the engine "
                "returned no complete output_token_sampling_mask / output_token_sampling_logprobs; "
                "it needs SGLang with return_sampling_mask (sglang-miles) or the embedded engine"
            )
        sample.rollout_sampling_support = (sample.rollout_sampling_support or []) + [
            [int(t) for t in s] for s in support
        ]
        if topk and lps and isinstance(lps[0], list):  # sampling_logprobs_mode "support": rows
            lps = candidates.append_support_rows(sample, ids, support, lps, topk)
        lps = [float(x) for x in lps]
    top = meta.get("output_top_logprobs")
    if top is not None:  # score centering's candidates, or top-k OPD's student top-k
        candidates.append_top_rows(sample, top, topk)
    first = not sample.response_tokens
    sample.response_tokens = list(sample.response_tokens) + ids
    sample.rollout_log_probs = list(sample.rollout_log_probs) + lps
    sample.loss_mask = list(sample.loss_mask) + [1] * len(ids)
    sample.response += output.get("text", "")
    if moe_shape is not None:
        sample.rollout_routed_experts = _routes(meta, moe_shape, len(sample.tokens))
    v_start = int(meta.get("weight_version_start", meta.get("weight_version", 0)) or 0)
    v_end = int(meta.get("weight_version_end", meta.get("weight_version", 0)) or 0)
    sample.weight_version_start = v_start if first else min(sample.weight_version_start, v_start)
    sample.weight_version_end = max(sample.weight_version_end, v_end)
    return (meta.get("finish_reason") or {}).get("type", "stop")


def _routes(meta: dict, moe_shape: tuple[int, int], n_tokens: int) -> list:
    """R3: the answer's meta_info.routed_experts, checked: one row per token fed (all but the last)."""
    from miles_platform.models.moe import decode_routes

    data = meta.get("routed_experts")
    if data is None:
        raise RuntimeError(
            "--use-rollout-routing-replay: the engine returned no meta_info.routed_experts (an SGLang "
            "server needs --enable-return-routed-experts; the embedded engine returns them for MoE models)"
        )
    routes = decode_routes(data, *moe_shape)
    if len(routes) != n_tokens - 1:
        raise RuntimeError(
            f"routed_experts has {len(routes)} rows for {n_tokens} tokens (expected tokens - 1)"
        )
    return routes.tolist()


def append_tool_tokens(sample: Sample, ids: list[int], text: str) -> None:
    """Append tokens the model did not sample (tool output, chat markup): loss mask 0, log-prob 0,
    and under replay the singleton support [token] (Miles: tool tokens have singleton support).
    Routed experts (R3) are left as they are: the next turn's answer covers these tokens, and
    tokens no request ever fed are routed by the trainer (`check_sample`)."""
    sample.response_tokens = list(sample.response_tokens) + list(ids)
    sample.rollout_log_probs = list(sample.rollout_log_probs) + [0.0] * len(ids)
    sample.loss_mask = list(sample.loss_mask) + [0] * len(ids)
    if sample.rollout_sampling_support is not None:
        sample.rollout_sampling_support = sample.rollout_sampling_support + [[int(t)] for t in ids]
    candidates.append_unsampled_rows(sample, len(ids))
    sample.response += text


def truncate(sample: Sample, max_len: int, tokenizer=None) -> None:
    """Cut the response to `max_len` tokens, every per-token list with it; status truncated.
    With a tokenizer the text is decoded again from the tokens kept."""
    if len(sample.response_tokens) <= max_len:
        return
    sample.response_tokens = sample.response_tokens[:max_len]
    sample.rollout_log_probs = sample.rollout_log_probs[:max_len]
    sample.loss_mask = sample.loss_mask[:max_len]
    if sample.rollout_sampling_support is not None:
        sample.rollout_sampling_support = sample.rollout_sampling_support[:max_len]
    candidates.truncate_rows(sample, max_len)
    if sample.rollout_routed_experts is not None:  # one row per token but the last
        sample.rollout_routed_experts = sample.rollout_routed_experts[: len(sample.tokens) - 1]
    if tokenizer is not None:
        sample.response = tokenizer.decode(sample.response_tokens, skip_special_tokens=True)
    sample.status = Status.TRUNCATED.value


def finish_status(finish_type: str) -> str:
    return FINISH_STATUS.get(finish_type, Status.COMPLETED).value
