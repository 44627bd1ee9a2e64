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
        from miles_platform.models.checkpoint import load_tokenizer
        from miles_platform.rollout.tito import TitoTokenizer

        TitoTokenizer(load_tokenizer(cfg.hf_checkpoint), cfg.tito_model)


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


def check_sample(s: Any, flag: str, path: str) -> Sample:
    """A Sample a user function returned, with every per-token list as long as the response."""
    if not isinstance(s, Sample):
        raise ConfigError(f"{flag} {path!r} returned a {type(s).__name__}, not a Sample")
    n = len(s.response_tokens)
    lens = {"rollout_log_probs": len(s.rollout_log_probs), "loss_mask": len(s.loss_mask)}
    if s.rollout_sampling_support is not None:
        lens["rollout_sampling_support"] = len(s.rollout_sampling_support)
    bad = {k: v for k, v in lens.items() if v != n}
    if bad or not s.prompt_tokens:
        raise ConfigError(
            f"{flag} {path!r} returned a Sample with {n} response_tokens but "
            + ", ".join(f"{v} {k}" for k, v in bad.items())
            + ("" if s.prompt_tokens else " and no prompt_tokens")
            + ": every per-token list must have one entry per response token"
        )
    return s
