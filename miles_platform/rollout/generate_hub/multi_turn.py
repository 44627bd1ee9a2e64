"""Multi-turn tool calling over `/generate` (Miles' generate_hub/multi_turn.py).

One episode, token-in token-out:

    tokens = prompt
    for turn in range(--generate-max-turns):
        model turn  <- /generate(tokens), max_new_tokens = what is left of --rollout-max-response-len
        calls       <- --generate-tool-call-parser(model text); none: done
        answers     <- --generate-execute-tool-function-path(name, params) for each call
        tokens     += answers as the chat template renders them (+ the next assistant prompt)

Every turn is recorded in `sample.turns` (role, text, token span, finish reason, the tool calls
with their results or errors), so the rollout shard answers "how many tool calls per episode,
and which tools fail" in SQL (docs/rollout.md). Model tokens keep the engine's log-probs (loss mask 1); tool tokens get loss mask 0, log-prob 0
and, under sampling-support replay, the singleton support [token]. The trajectory never exceeds
the response budget (status `truncated`); a tool that raises or times out
(--generate-tool-timeout) ends the episode with status `failed`, which the rollout counts
(`rollout/failed`) and keeps out of the loss.

A tool may answer with OpenAI content parts (text and `image_url` parts: a tool that renders): on a
vision-language model each image becomes its vision tokens in the tool turn (pads expanded, as the
engine runs them) and joins `sample.image_data`, so the next turns' `/generate` and the trainer see
it; on a text model such an answer fails the episode, naming the tool.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from miles_platform.config import ConfigError
from miles_platform.config.rollout import template_kwargs
from miles_platform.data.sample import Sample, Status, make_turn
from miles_platform.errors import MilesError
from miles_platform.rollout import chat
from miles_platform.rollout.base_types import GenerateFnInput, GenerateFnOutput
from miles_platform.rollout.generate_hub import tool_call
from miles_platform.rollout.generate_hub.endpoint import (
    append_output,
    append_tool_tokens,
    finish_status,
    post,
    request_payload,
    routes_shape,
    topk_width,
    truncate,
)
from miles_platform.rollout.generate_hub.tool_call import ToolCall, ToolFailure

Parser = Callable[[str], list[ToolCall]]


async def generate(input: GenerateFnInput) -> GenerateFnOutput:
    a = input.args
    parser, execute = _tools(
        a.generate_tool_specs_path, a.generate_tool_call_parser, a.generate_execute_tool_function_path
    )
    sample = await run_episode(input, parser, execute, a.generate_max_turns, a.generate_tool_timeout)
    return GenerateFnOutput(samples=sample)


def validate_args(args: Any) -> None:
    """The three tool flags are set and load (called before any engine starts)."""
    flags = {
        tool_call.SPECS_FLAG: args.generate_tool_specs_path,
        tool_call.PARSER_FLAG: args.generate_tool_call_parser,
        tool_call.EXECUTE_FLAG: args.generate_execute_tool_function_path,
    }
    missing = [f for f, v in flags.items() if not v]
    if missing:
        raise ConfigError(f"--custom-generate-function-path multi_turn.generate needs {', '.join(missing)}")
    _tools.cache_clear()  # a fresh import check, not a cached result
    _tools(*flags.values())


@lru_cache(maxsize=8)
def _tools(specs_path: str, parser_name: str, execute_path: str) -> tuple[Parser, Callable[..., Any]]:
    specs = tool_call.load_tool_specs(specs_path)
    return tool_call.make_parser(parser_name, specs), tool_call.load_execute_tool(execute_path)


async def run_episode(
    input: GenerateFnInput,
    parse: Parser,
    execute: Callable[..., Any],
    max_turns: int,
    tool_timeout: float | None,
) -> Sample:
    """The episode loop. `parse(model_text) -> [ToolCall]` and `execute(name, params) -> str` are
    arguments so a generate function can reuse the loop with its own parsing or tools."""
    state, params = input.state, input.sampling_params
    sample = copy.deepcopy(input.sample)
    budget = int(params.get("max_new_tokens", 0))
    turns, calls_made = [], 0
    for turn in range(max_turns):
        body = request_payload(state, sample, _turn_params(params, turn), input.evaluation)
        if body is None:  # the budget is spent and the model was due another turn
            sample.status = Status.TRUNCATED.value
            break
        out = await post(state.url, body, state.api_key)
        start = len(sample.response_tokens)
        replay, topk = "return_sampling_mask" in body, topk_width(state, body)
        finish = append_output(sample, out, replay, routes_shape(state, body), topk)
        sample.status = finish_status(finish)
        text = out.get("text", "")
        calls = [] if finish in ("length", "abort") else parse(text)
        turns.append(make_turn("assistant", text, start, len(sample.response_tokens), finish, _calls(calls)))
        if not calls:
            break
        start = len(sample.response_tokens)
        try:
            messages = await tool_call.execute_tool_calls(calls, execute, tool_timeout)
        except ToolFailure as e:
            sample.status = Status.FAILED.value
            sample.metadata = {**sample.metadata, "tool_error": str(e)}
            done = _calls(calls[: len(e.done)], e.done)
            turns.append(
                make_turn("tool", "", start, start, tool_calls=done + _calls([e.call], error=str(e)))
            )
            calls_made += len(done) + 1
            break
        calls_made += len(calls)
        try:
            text, ids, images = _tool_tokens(state, messages)
        except (ValueError, OSError, MilesError) as e:  # bad parts, images on a text model
            sample.status = Status.FAILED.value
            sample.metadata = {**sample.metadata, "tool_error": f"tool answer: {type(e).__name__}: {e}"}
            turns.append(make_turn("tool", "", start, start, tool_calls=_calls(calls, messages)))
            break
        if images:  # a tool that renders: its images join the trajectory's
            sample.image_data = list(sample.image_data or []) + images
        append_tool_tokens(sample, ids, text)
        turns.append(
            make_turn("tool", text, start, len(sample.response_tokens), tool_calls=_calls(calls, messages))
        )
        if len(sample.response_tokens) >= budget:
            truncate(sample, budget, state.tokenizer)
            sample.status = Status.TRUNCATED.value
            _clip_turns(turns, budget)
            break
    model_turns = sum(t["role"] == "assistant" for t in turns)
    sample.turns = turns
    sample.metadata = {**sample.metadata, "turns": model_turns, "tool_call_count": calls_made}
    return sample


def _tool_tokens(state: Any, messages: list[dict[str, Any]]) -> tuple[str, list[int], list[str]]:
    """The tool turn's text and ids (image parts as their vision tokens, pads expanded) and images."""
    for m in messages:
        if isinstance(m["content"], list):
            chat.check_content_parts(m["content"], f"tool {m['name']!r}'s answer")
    kw = template_kwargs(getattr(state.args, "apply_chat_template_kwargs", None))
    text = tool_call.tool_response_text(state.tokenizer, chat.template_messages(messages), kw)
    ids = state.tokenizer.encode(text, add_special_tokens=False)
    images = chat.image_uris(messages)
    if images:
        ids = _vision(str(state.args.hf_checkpoint)).expand(ids, images)
    return text, ids, images


@lru_cache(maxsize=4)
def _vision(hf_checkpoint: str):
    from miles_platform.models.vlm import PromptVision

    return PromptVision(hf_checkpoint)  # a text model: CheckpointError (no preprocessor_config.json)


def _calls(
    calls: list[ToolCall], messages: list[dict[str, Any]] | None = None, error: str | None = None
) -> list[dict[str, Any]]:
    out = []
    for i, c in enumerate(calls):
        result = messages[i]["content"] if messages is not None and i < len(messages) else None
        if isinstance(result, list):  # content parts: the text, each image as its vision tokens
            result = chat.content_text(result)
        out.append({"name": c.name, "arguments": c.arguments, "result": result, "error": error})
    return out


def _clip_turns(turns: list[dict[str, Any]], budget: int) -> None:
    """After truncation: spans end at the budget; a turn wholly past it is dropped."""
    turns[:] = [t for t in turns if t["start"] < budget or t["start"] == t["end"] == budget]
    for t in turns:
        t["end"] = min(t["end"], budget)


def _turn_params(params: dict[str, Any], turn: int) -> dict[str, Any]:
    """Each turn its own seed (the embedded engine's draws are a function of seed and position)."""
    seed = params.get("sampling_seed")
    if seed is None or turn == 0:
        return params
    return {**params, "sampling_seed": (int(seed) + 1_000_003 * turn) % (2**31)}
