"""Tool calls of the multi-turn generate: parse them from model text, run them, tokenize the answers.

--generate-tool-specs-path            <module>.<attr>: a list of OpenAI tool specs
                                      ({"type": "function", "function": {"name", "description", "parameters"}})
                                      or a function returning one
--generate-tool-call-parser           how tool calls look in model text (SGLang's parser names):
                                      qwen25 / qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
                                      qwen3_coder (Qwen3.5 / Qwen3-Next): <tool_call><function=NAME>
                                      <parameter=KEY>VALUE</parameter>...</function></tool_call>
                                      glm47 (GLM-4.7): <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>
                                      ...</tool_call>
                                      minimax-m2 (MiniMax-M2/M2.5): <minimax:tool_call><invoke name="NAME">
                                      <parameter name="K">V</parameter>...</invoke></minimax:tool_call>
                                      deepseekv32 (DeepSeek-V3.2, DSML): <｜DSML｜function_calls><｜DSML｜invoke
                                      name="NAME"><｜DSML｜parameter name="K" string="true|false">V
                                      </｜DSML｜parameter>...</｜DSML｜invoke></｜DSML｜function_calls>
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


def _schemas(specs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """tool name -> its parameters' JSON-schema properties."""
    return {
        spec.get("function", spec)["name"]: (spec.get("function", spec).get("parameters") or {}).get(
            "properties"
        )
        or {}
        for spec in specs
    }


def _xml_parser(call_re: re.Pattern, param_re: re.Pattern, strip: bool = False):
    """A parser of calls `call_re` (groups: name, body) whose body holds `param_re` (groups: key, value),
    each value typed by the tool's schema (`_coder_value`); a call naming an undeclared tool is skipped."""

    def make(specs: list[dict[str, Any]]) -> Callable[[str], list[ToolCall]]:
        schemas = _schemas(specs)

        def parse(text: str) -> list[ToolCall]:
            calls = []
            for m in call_re.finditer(text):
                name = m.group(1).strip()
                if name not in schemas:
                    continue
                args = {
                    k.strip(): _coder_value(v.strip() if strip else v, schemas[name].get(k.strip()))
                    for k, v in param_re.findall(m.group(2))
                }
                calls.append(ToolCall(name, args))
            return calls

        return parse

    return make


# GLM-4.7 (SGLang's `glm47`): <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>;
# GLM-4.5's newlines between the parts are tolerated (stripped), as the detector does
_GLM_CALL = re.compile(r"<tool_call>([^<\n]+?)\s*((?:<arg_key>.*?)?)\s*(?:</tool_call>|$)", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.DOTALL)
glm47_parser = _xml_parser(_GLM_CALL, _GLM_ARG, strip=True)
glm47_parser.__doc__ = "GLM-4.7 (SGLang's `glm47`, Miles' glm47 TITO): values typed by the tool's schema."

# MiniMax-M2 / M2.5 (SGLang's `minimax-m2`): <minimax:tool_call> holds one or more <invoke name="NAME">
_MINIMAX_BLOCK = re.compile(r"<minimax:tool_call>(.*?)(?:</minimax:tool_call>|$)", re.DOTALL)
_MINIMAX_CALL = re.compile(r'<invoke name="?([^">]+)"?>(.*?)(?:</invoke>|$)', re.DOTALL)
_MINIMAX_PARAM = re.compile(r'<parameter name="?([^">]+)"?>(.*?)(?:</parameter>|(?=<parameter)|$)', re.DOTALL)
_minimax_calls = _xml_parser(_MINIMAX_CALL, _MINIMAX_PARAM, strip=True)


def minimax_m2_parser(specs: list[dict[str, Any]]) -> Callable[[str], list[ToolCall]]:
    """MiniMax-M2 / M2.5 (SGLang's `minimax-m2`, Miles' minimax_m25 TITO): invokes inside
    <minimax:tool_call> blocks only; values typed by the tool's schema."""
    inner = _minimax_calls(specs)
    return lambda text: [c for b in _MINIMAX_BLOCK.findall(text) for c in inner(b)]


# DeepSeek-V3.2 (SGLang's `deepseekv32`): DSML; string="true" values are raw text, others JSON
_DSML = "｜DSML｜"
_DSML_BLOCK = re.compile(rf"<{_DSML}function_calls>(.*?)(?:</{_DSML}function_calls>|$)", re.DOTALL)
_DSML_CALL = re.compile(rf'<{_DSML}invoke name="([^"]+)">(.*?)(?:</{_DSML}invoke>|$)', re.DOTALL)
_DSML_PARAM = re.compile(
    rf'<{_DSML}parameter name="([^"]+)"(?: string="(true|false)")?>(.*?)(?:</{_DSML}parameter>|$)', re.DOTALL
)


def deepseekv32_parser(specs: list[dict[str, Any]]) -> Callable[[str], list[ToolCall]]:
    """DeepSeek-V3.2 (SGLang's `deepseekv32`, Miles' deepseekv32 TITO): DSML invokes inside a
    <｜DSML｜function_calls> block; a parameter with string="true" is its raw text, any other is
    JSON (one that does not parse skips the call, as the detector's json.loads fails it)."""
    names = tool_names(specs)

    def parse(text: str) -> list[ToolCall]:
        calls = []
        for block in _DSML_BLOCK.findall(text):
            for name, body in _DSML_CALL.findall(block):
                if name not in names:
                    continue
                try:
                    args = {k: v if s == "true" else json.loads(v) for k, s, v in _DSML_PARAM.findall(body)}
                except json.JSONDecodeError:
                    continue
                calls.append(ToolCall(name, args))
        return calls

    return parse


TOOL_CALL_PARSERS: dict[str, Callable[[list[dict[str, Any]]], Callable[[str], list[ToolCall]]]] = {
    "qwen25": qwen25_parser,
    "qwen": qwen25_parser,  # SGLang's alias for the same format
    "qwen3_coder": qwen3_coder_parser,
    "glm47": glm47_parser,
    "minimax-m2": minimax_m2_parser,
    "deepseekv32": deepseekv32_parser,
}
# where a parser's first call begins: the text before it is the message's content
CALL_START = {"qwen25": "<tool_call>", "qwen": "<tool_call>", "qwen3_coder": "<tool_call>", "glm47": "<tool_call>",
              "minimax-m2": "<minimax:tool_call>", "deepseekv32": f"<{_DSML}function_calls>"}  # fmt: skip


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
