"""Tool calls of the multi-turn generate: parse them from model text, run them, tokenize the answers.

--generate-tool-specs-path            <module>.<attr>: a list of OpenAI tool specs
                                      ({"type": "function", "function": {"name", "description", "parameters"}})
                                      or a function returning one
--generate-tool-call-parser           how tool calls look in model text (SGLang's parser names):
                                      qwen25 / qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
                                      qwen3_coder (Qwen3.5 / Qwen3-Next): <tool_call><function=NAME>
                                      <parameter=KEY>VALUE</parameter>...</function></tool_call>
--generate-execute-tool-function-path <module>.<fn>: async def execute_tool(name: str, params: dict) -> str
                                      (or a list of OpenAI content parts: text and image_url parts,
                                      a tool that renders; a vision-language model then sees the images)
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles_platform.config import ConfigError
from miles_platform.plugins import load_function, load_object

SPECS_FLAG = "--generate-tool-specs-path"
PARSER_FLAG = "--generate-tool-call-parser"
EXECUTE_FLAG = "--generate-execute-tool-function-path"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


class ToolFailure(Exception):
    """A tool raised, timed out or answered something other than a string: the episode fails.
    `done` holds the tool messages of the calls before the failing one, `call` is that one."""

    def __init__(self, message: str, call: ToolCall | None = None, done: list[dict[str, Any]] | None = None):
        super().__init__(message)
        self.call, self.done = call, list(done or [])


# ---------------------------------------------------------------- specs and parsers
def load_tool_specs(path: str) -> list[dict[str, Any]]:
    obj = load_object(path, SPECS_FLAG)
    try:
        specs = obj() if callable(obj) else obj
    except Exception as e:
        raise ConfigError(
            f"{SPECS_FLAG} {path!r}: expected a non-empty list of tool specs or a function of no arguments "
            f"returning one; calling it raised {type(e).__name__}: {e}"
        ) from e
    if not isinstance(specs, list | tuple) or not specs:
        raise ConfigError(
            f"{SPECS_FLAG} {path!r}: expected a non-empty list of tool specs, got {specs!r:.80}"
        )
    for i, spec in enumerate(specs):
        fn = spec.get("function", spec) if isinstance(spec, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ConfigError(
                f"{SPECS_FLAG} {path!r}: spec {i} has no function name; expected "
                '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
            )
    return list(specs)


def tool_names(specs: list[dict[str, Any]]) -> set[str]:
    return {spec.get("function", spec)["name"] for spec in specs}


_QWEN25_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def qwen25_parser(specs: list[dict[str, Any]]) -> Callable[[str], list[ToolCall]]:
    """Qwen 2.5 / Qwen 3 (SGLang's `qwen25`): one JSON object per <tool_call> block. A block left
    open at the end (generation stopped on the stop string `</tool_call>`) still counts. Blocks that
    are not JSON, or name a tool the specs do not declare, are skipped, as SGLang's detector does."""
    names = tool_names(specs)

    def parse(text: str) -> list[ToolCall]:
        calls = []
        for m in _QWEN25_BLOCK.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except json.JSONDecodeError:
                continue
            if not isinstance(obj, dict) or obj.get("name") not in names:
                continue
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    continue
            if isinstance(args, dict):
                calls.append(ToolCall(obj["name"], args))
        return calls

    return parse


_CODER_CALL = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)(?:</function>|</tool_call>|$)", re.DOTALL)
_CODER_PARAM = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def _coder_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A <parameter> body as its schema type says (SGLang's / vLLM's qwen3_coder conversion): one
    newline each side is the format's, "null" is None, strings stay as written, numbers and booleans
    parse, anything else is JSON (or a Python literal); a value that does not parse stays a string."""
    import ast

    v = raw[1:] if raw.startswith("\n") else raw
    v = v[:-1] if v.endswith("\n") else v
    if v.strip().lower() == "null":
        return None
    kind = str((schema or {}).get("type", "string")).lower()
    try:
        if kind in ("string", "str", "text", "varchar", "char", "enum"):
            return v
        if kind.startswith(("int", "uint", "long", "short")):
            return int(v.strip())
        if kind.startswith(("num", "float", "double")):
            f = float(v.strip())
            return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f
        if kind in ("boolean", "bool", "binary"):
            return {"true": True, "false": False}[v.strip().lower()]
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return ast.literal_eval(v.strip())
    except (ValueError, KeyError, SyntaxError):
        return v


def qwen3_coder_parser(specs: list[dict[str, Any]]) -> Callable[[str], list[ToolCall]]:
    """Qwen3-Coder / Qwen3.5 / Qwen3-Next (SGLang's `qwen3_coder`, what Miles' Qwen3.5 and Qwen3-Next
    TITO use): `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`,
    each value typed by the tool's JSON schema (`_coder_value`). A call left open at the end still
    counts; one naming a tool the specs do not declare is skipped, as the qwen25 parser does."""
    schemas = {
        spec.get("function", spec)["name"]: (spec.get("function", spec).get("parameters") or {}).get(
            "properties"
        )
        or {}
        for spec in specs
    }

    def parse(text: str) -> list[ToolCall]:
        calls = []
        for m in _CODER_CALL.finditer(text):
            name = m.group(1)
            if name not in schemas:
                continue
            args = {k: _coder_value(v, schemas[name].get(k)) for k, v in _CODER_PARAM.findall(m.group(2))}
            calls.append(ToolCall(name, args))
        return calls

    return parse


TOOL_CALL_PARSERS: dict[str, Callable[[list[dict[str, Any]]], Callable[[str], list[ToolCall]]]] = {
    "qwen25": qwen25_parser,
    "qwen": qwen25_parser,  # SGLang's alias for the same format
    "qwen3_coder": qwen3_coder_parser,
}


def make_parser(name: str | None, specs: list[dict[str, Any]]) -> Callable[[str], list[ToolCall]]:
    if name not in TOOL_CALL_PARSERS:
        raise ConfigError(
            f"{PARSER_FLAG} {name!r}: not a tool-call parser; valid: {sorted(TOOL_CALL_PARSERS)}"
        )
    return TOOL_CALL_PARSERS[name](specs)


def load_execute_tool(path: str) -> Callable[..., Any]:
    fn = load_function(path, EXECUTE_FLAG, required_params=2)
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(
            f"{EXECUTE_FLAG} {path!r}: must be `async def execute_tool(name: str, params: dict) -> str`"
        )
    return fn


# ---------------------------------------------------------------- running
async def execute_tool_calls(
    calls: list[ToolCall], execute: Callable[..., Any], timeout: float | None
) -> list[dict[str, Any]]:
    """Run the calls in order; each answer is a `tool` chat message. Raises ToolFailure."""
    messages = []
    for call in calls:
        try:
            result = await asyncio.wait_for(execute(call.name, dict(call.arguments)), timeout)
        except TimeoutError:
            raise ToolFailure(f"tool {call.name!r} timed out after {timeout} s", call, messages) from None
        except Exception as e:
            raise ToolFailure(f"tool {call.name!r} raised {type(e).__name__}: {e}", call, messages) from e
        if not isinstance(result, str | list):  # a list: content parts (multi_turn checks them)
            raise ToolFailure(
                f"tool {call.name!r} returned {type(result).__name__}, not str or a list of content parts",
                call, messages,
            )  # fmt: skip
        messages.append({"role": "tool", "name": call.name, "content": result})
    return messages


def tool_response_text(
    tokenizer: Any, messages: list[dict[str, Any]], chat_kwargs: dict | None = None
) -> str:
    """The text that follows a finished assistant turn: the tool messages and the next assistant
    turn's generation prompt, as the tokenizer's chat template renders them (the template applied
    to [user, assistant, *tools] minus the same without the tools; `chat_kwargs`: its extra
    arguments, --apply-chat-template-kwargs). Without a chat template:
    plain <tool_response> blocks."""
    if not getattr(tokenizer, "chat_template", None):
        return "".join(f"\n<tool_response>\n{m['content']}\n</tool_response>" for m in messages) + "\n"
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": m["name"], "arguments": {}}}
        for i, m in enumerate(messages)
    ]
    base = [{"role": "user", "content": "."}, {"role": "assistant", "content": "", "tool_calls": calls}]
    kw = chat_kwargs or {}
    without = tokenizer.apply_chat_template(base, tokenize=False, add_generation_prompt=False, **kw)
    full = tokenizer.apply_chat_template(base + messages, tokenize=False, add_generation_prompt=True, **kw)
    if not full.startswith(without):
        raise RuntimeError(
            "multi-turn: the chat template renders earlier messages differently once tool messages follow "
            "(a thinking model's template?); the trajectory must be append-only. Use a template that "
            f"keeps the prefix, or a custom generate function. Without: {without!r:.200} with: {full!r:.200}"
        )
    return full[len(without) :]
