"""Generate hub: how one sample is generated (Miles' `miles/rollout/generate_hub/`).

Built-ins, chosen with --custom-generate-function-path:
  (unset)                                                the fast path: RolloutManager batches every
                                                         sample of a round into one /generate
  miles_platform.rollout.generate_hub.single_turn.generate  one /generate per sample
  miles_platform.rollout.generate_hub.multi_turn.generate   tool calling over /generate: --generate-max-turns,
                                                         --generate-tool-specs-path, --generate-tool-call-parser,
                                                         --generate-execute-tool-function-path
  miles_platform.rollout.generate_hub.agentic_tool_call.generate  an OpenAI agent per sample in a TITO
                                                         session: --custom-agent-function-path, --use-session-server
(Miles' own dotted names, miles.rollout.generate_hub.*.generate, load these.) A user function in
either of Miles' forms goes through the same loader (plugins.load_generate_function). The
manager runs per-sample functions concurrently, at most --rollout-max-concurrency at a time.
"""

from __future__ import annotations

from argparse import Namespace
from dataclasses import fields
from typing import Any
from urllib.parse import urlsplit

from miles_platform.config import ConfigError, RunConfig
from miles_platform.data.sample import Sample
from miles_platform.plugins import (
    AGENTIC,
    GENERATE_FLAG,
    MILES_BUILTINS,
    ROLLOUT_FLAG,
    function_flags_parser,
    load_generate_function,
    load_rollout_function,
)
from miles_platform.rollout.generate_hub.endpoint import post

__all__ = ["MULTI_TURN", "check_sample", "function_args", "post", "validate_config"]

MULTI_TURN = "miles_platform.rollout.generate_hub.multi_turn.generate"


def validate_config(cfg: RunConfig) -> None:
    """Before any engine starts: the functions import and have a signature Miles documents; the
    multi-turn tool flags load (specs, parser, an async executor)."""
    if cfg.custom_generate_function_path:
        load_generate_function(cfg.custom_generate_function_path)
    if cfg.rollout_function_path:
        load_rollout_function(cfg.rollout_function_path)
    path = MILES_BUILTINS.get(cfg.custom_generate_function_path, cfg.custom_generate_function_path)
    if path == MULTI_TURN:
        from miles_platform.rollout.generate_hub import multi_turn

        multi_turn.validate_args(cfg)
    if path == AGENTIC:
        from miles_platform.rollout.generate_hub import agentic_tool_call

        agentic_tool_call.validate_args(cfg)
    if cfg.use_session_server:  # the chat template and --tito-model's end-of-turn token
        from miles_platform.config.rollout import template_kwargs
        from miles_platform.models.checkpoint import load_tokenizer
        from miles_platform.rollout.tito import TitoTokenizer

        TitoTokenizer(load_tokenizer(cfg.hf_checkpoint), cfg.tito_model).check_kwargs(
            template_kwargs(getattr(cfg, "apply_chat_template_kwargs", None)), "--apply-chat-template-kwargs"
        )


def function_args(cfg: RunConfig, url: str) -> Namespace:
    """The `args` user functions see (Miles passes its argparse Namespace): every RunConfig field,
    the flags their `add_arguments` registered (given values, else the defaults), and where
    /generate goes as Miles names it (`sglang_router_ip`, `sglang_router_port`)."""
    ns = Namespace(**{f.name: getattr(cfg, f.name) for f in fields(cfg)})
    parser = function_flags_parser(
        {GENERATE_FLAG: cfg.custom_generate_function_path, ROLLOUT_FLAG: cfg.rollout_function_path}
    )
    if parser is not None:
        for action in parser._actions:
            if action.dest not in RunConfig.__dataclass_fields__:
                setattr(ns, action.dest, action.default)
    for k, v in cfg.custom_function_args.items():
        setattr(ns, k, v)
    u = urlsplit(url)
    ns.sglang_router_ip, ns.sglang_router_port = u.hostname, u.port
    return ns


def check_sample(s: Any, flag: str, path: str, moe_shape: tuple[int, int] | None = None) -> Sample:
    """A Sample a user function returned, with every per-token list as long as the response.
    With `moe_shape` (R3, a training rollout) its `rollout_routed_experts` are checked too."""
    if not isinstance(s, Sample):
        raise ConfigError(f"{flag} {path!r} returned a {type(s).__name__}, not a Sample")
    n = len(s.response_tokens)
    lens = {"rollout_log_probs": len(s.rollout_log_probs), "loss_mask": len(s.loss_mask)}
    if s.rollout_sampling_support is not None:
        lens["rollout_sampling_support"] = len(s.rollout_sampling_support)
    for name in ("rollout_topk_token_ids", "rollout_topk_log_probs"):  # score centering's candidates
        if getattr(s, name) is not None:
            lens[name] = len(getattr(s, name))
    bad = {k: v for k, v in lens.items() if v != n}
    if bad or not s.prompt_tokens:
        raise ConfigError(
            f"{flag} {path!r} returned a Sample with {n} response_tokens but "
            + ", ".join(f"{v} {k}" for k, v in bad.items())
            + ("" if s.prompt_tokens else " and no prompt_tokens")
            + ": every per-token list must have one entry per response token"
        )
    if moe_shape is not None:
        check_routes(s, flag, path, moe_shape)
    return s


def check_routes(s: Sample, flag: str, path: str, moe_shape: tuple[int, int]) -> None:
    """R3: the sample carries the engine's routes, `[rows][num_layers][top_k]`, for every position
    the engine was fed. Positions after the last one fed (tool output appended after the final
    turn) get rows of -1, which the trainer routes itself: they only predict tokens no engine
    sampled, so those must have loss mask 0."""
    how = (
        "record them: post the body of generate_hub.endpoint.request_payload (it sets "
        "return_routed_experts) and pass moe_shape=endpoint.routes_shape(state, body) to append_output"
    )
    routes, n = s.rollout_routed_experts, len(s.tokens) - 1
    if routes is None and not any(s.loss_mask):  # nothing trained (e.g. a session with no call)
        routes = []
    if routes is None:
        raise ConfigError(f"--use-rollout-routing-replay: {flag} {path!r} returned a Sample without "
                          f"rollout_routed_experts; {how}")  # fmt: skip
    layers, top_k = moe_shape
    bad = [i for i, r in enumerate(routes) if len(r) != layers or any(len(x) != top_k for x in r)]
    if len(routes) > n or bad:
        raise ConfigError(
            f"--use-rollout-routing-replay: {flag} {path!r} returned rollout_routed_experts of "
            f"{len(routes)} rows for {n + 1} tokens"
            + (f", row {bad[0]} not [{layers}][{top_k}]" if bad else "")
            + f" (expected at most tokens - 1 rows of [num_layers][top_k]); {how}"
        )
    first_unrouted = len(routes) + 1 - len(s.prompt_tokens)  # response index of the first such token
    if any(s.loss_mask[max(first_unrouted, 0) :]):
        raise ConfigError(
            f"--use-rollout-routing-replay: {flag} {path!r} returned rollout_routed_experts for "
            f"{len(routes)} of {n} positions, but a token after them has loss mask 1 (the engine "
            f"sampled it, so it was fed everything before it); {how}"
        )
    s.rollout_routed_experts = list(routes) + [
        [[-1] * top_k for _ in range(layers)] for _ in range(n - len(routes))
    ]
