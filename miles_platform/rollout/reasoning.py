"""SGLang's reasoning parsers (`--reasoning-parser`, Miles' `--sglang-reasoning-parser`) for the
embedded engine's /v1/chat/completions: a chat answer's thinking goes to `message.reasoning_content`
and the rest stays `content`, as SGLang's serving_chat splits it (sglang/srt/parser/reasoning_parser.py,
the `<think>`-style detectors; re-written here, same rules).

    text --split_reasoning(parser, force)--> (reasoning, content)

`force` (the answer starts inside the thinking block, the start tag being in the prompt) is SGLang's
`template force_reasoning or _get_reasoning_from_request`: `force_reasoning(parser, template, kwargs)`.
A request with `separate_reasoning: false` keeps the whole text as content (SGLang's field).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from miles_platform.errors import ConfigError


@dataclass(frozen=True)
class ReasoningFormat:
    start: str  # the thinking block's opening tag
    end: str  # and its closing tag
    # None: the request decides (`request_rule`); True / False: the detector fixes it (SGLang's
    # DeepSeekR1Detector always starts inside, KimiDetector never)
    fixed_force: bool | None = None
    tool_start: str | None = None  # a tool call that opens before the closing tag ends the thinking
    request_rule: str = "default"  # SGLang's _get_reasoning_from_request branch (`_request_forces`)
    prepend_start: bool = False  # minimax-append-think: no split, the start tag put back in front


_THINK = ("<think>", "</think>")
_QWEN3 = ReasoningFormat(*_THINK, tool_start="<tool_call>", request_rule="enable_thinking")
# SGLang's ReasoningParser.DetectorMap, the <think>-style ones (gpt-oss's harmony channels, kimi_k2's
# and the newer detectors with their own tokens are not built: refused by name)
REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat(*_THINK, fixed_force=True),
    "step3": ReasoningFormat(*_THINK, fixed_force=True),
    "deepseek-v3": ReasoningFormat(*_THINK, tool_start="<tool_call>", request_rule="explicit_thinking"),
    "qwen3": _QWEN3,
    "qwen3-thinking": ReasoningFormat(*_THINK, fixed_force=True, tool_start="<tool_call>"),
    "interns1": _QWEN3,
    "mimo": ReasoningFormat(*_THINK, tool_start="<tool_call>", request_rule="explicit_enable_thinking"),
    "glm45": ReasoningFormat(*_THINK, tool_start="<tool_call>", request_rule="enable_thinking"),
    "nemotron_3": ReasoningFormat(*_THINK, tool_start="<tool_call>", request_rule="enable_thinking"),
    "minimax": ReasoningFormat(*_THINK, fixed_force=True, tool_start="<tool_call>"),
    "minimax-append-think": ReasoningFormat(*_THINK, prepend_start=True),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷", fixed_force=False),
}
REASONING_FLAG = "--sglang-reasoning-parser"


def check_reasoning_parser(name: Any, flag: str = REASONING_FLAG) -> str:
    """The parser's name, or ConfigError naming the flag and the built ones."""
    if name not in REASONING_PARSERS:
        raise ConfigError(
            f"{flag} {name!r}: not a reasoning parser of the embedded engine; built: "
            f"{sorted(REASONING_PARSERS)} (SGLang's others, e.g. gpt-oss, kimi_k2: --rollout-engine sglang)"
        )
    return name


def template_forces_reasoning(template: str | None) -> bool:
    """SGLang's TemplateManager.force_reasoning: the template opens the answer inside `<think>`
    (`<|im_start|>assistant\\n<think>\\n` in its source), or defaults `enable_thinking` to true."""
    if not template:
        return False
    forced = re.search(r"<\|im_start\|>assistant\\n<think>\\n", template) is not None
    m = re.search(r"enable_thinking\s*\|\s*default\((true|false|.*?)\)", template)
    if m is not None:
        forced = m.group(1) == "true"
    return forced


def _request_forces(rule: str, kwargs: dict[str, Any]) -> bool:
    if rule == "explicit_thinking":  # deepseek-v3: thinks only when asked (`thinking: true`)
        return kwargs.get("thinking") is True
    if rule == "explicit_enable_thinking":  # mimo
        return kwargs.get("enable_thinking") is True
    if rule == "enable_thinking":  # qwen3, glm45, ...: thinks unless `enable_thinking: false`
        return kwargs.get("enable_thinking") is not False
    return True


def force_reasoning(name: str, template: str | None, kwargs: dict[str, Any] | None) -> bool:
    """Whether the answer starts inside the thinking block (no start tag needed)."""
    fmt = REASONING_PARSERS[name]
    if fmt.fixed_force is not None:
        return fmt.fixed_force
    return template_forces_reasoning(template) or _request_forces(fmt.request_rule, kwargs or {})


def split_reasoning(text: str, name: str, force: bool) -> tuple[str, str]:
    """(reasoning, content) of a whole answer: SGLang's detect_and_parse. Outside a thinking block
    (not forced, no start tag) all is content; inside, the text up to the closing tag is the
    reasoning (all of it when the answer stopped before closing it, or up to a tool call's opening
    tag where the format has one), the rest the content. Leading start tags are dropped."""
    fmt = REASONING_PARSERS[name]
    if fmt.prepend_start:
        return "", fmt.start + text
    if fmt.fixed_force is not None:  # the detector's own (deepseek-r1 always inside, kimi never)
        force = fmt.fixed_force
    if not (force or fmt.start in text):
        return "", text
    rest = text
    while rest.startswith(fmt.start):
        rest = rest[len(fmt.start) :]
    if fmt.end in rest:
        reasoning, _, content = rest.partition(fmt.end)
        return reasoning, content
    if fmt.tool_start and fmt.tool_start in rest:
        i = rest.find(fmt.tool_start)
        return rest[:i], rest[i:]
    return rest, ""


def partial_tags(name: str) -> list[str]:
    """The tags a streamed text must not cut in half (a tail that may still become one waits)."""
    fmt = REASONING_PARSERS[name]
    return [t for t in (fmt.start, fmt.end, fmt.tool_start) if t]
