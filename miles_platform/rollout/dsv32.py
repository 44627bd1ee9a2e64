"""DeepSeek-V3.2's prompt format (`--tito-model deepseekv32` on a checkpoint of model_type
deepseek_v32 or without a jinja chat template, as V3.2 ships none): DeepSeek's official
`encoding_dsv32` encoder, which Miles renders V3.2 through, written here as the session server needs
it. Miles pins `drop_thinking=False` (every assistant turn keeps its thinking block, so a user turn
appended later does not rewrite history); so does this renderer, and `drop_thinking=True` is refused.

  system     CONTENT [+ two newlines + the tools block]  (tools go into a system message; one is
                                                        added first when the chat has none)
  user       <｜User｜>CONTENT<｜Assistant｜><think>        (chat mode: </think>)
  assistant  [REASONING</think>]CONTENT[<｜DSML｜function_calls> block]<｜end▁of▁sentence｜>
  tool       <function_results> <result>CONTENT</result>... </function_results> <think>
"""

from __future__ import annotations

import json
from typing import Any

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
TOOLS_BLOCK = """## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{dsml}function_calls>" block like the following as part of your reply to the user:
<{dsml}function_calls>
<{dsml}invoke name="$FUNCTION_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$FUNCTION_NAME2">
...
</{dsml}invoke>
</{dsml}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<{dsml}function_calls>
...
</{dsml}function_calls>
<function_results>
...
</function_results>
<think>...thinking about results</think>
Here are the functions available in JSONSchema format:
<functions>
{tool_schemas}
</functions>
"""


class Dsv32Error(ValueError):
    """Messages the V3.2 format cannot render."""


def _json(v: Any) -> str:
    try:
        return json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(v, ensure_ascii=True)


def thinking_on(kwargs: dict[str, Any]) -> bool:
    """Miles' mode resolution: `thinking_mode`, else `enable_thinking` / `thinking`; on by default."""
    mode = kwargs.get("thinking_mode")
    for k in ("enable_thinking", "thinking"):
        if mode is None and kwargs.get(k) is not None:
            mode = "thinking" if kwargs[k] else "chat"
    mode = mode or "thinking"
    if mode not in ("thinking", "chat"):
        raise Dsv32Error(f"thinking_mode {mode!r}: must be thinking or chat")
    return mode == "thinking"


def _tool_calls(calls: list[dict[str, Any]]) -> str:
    invokes = []
    for c in calls:
        fn = c.get("function", c)
        args = fn.get("arguments") or {}
        args = json.loads(args) if isinstance(args, str) else args
        if not isinstance(args, dict):
            raise Dsv32Error("assistant tool call arguments must be a JSON object")
        params = "\n".join(
            f'<{DSML}parameter name="{k}" string="{str(isinstance(v, str)).lower()}">'
            f"{v if isinstance(v, str) else _json(v)}</{DSML}parameter>"
            for k, v in args.items()
        )
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n{params}\n</{DSML}invoke>')
    return f"\n\n<{DSML}function_calls>\n" + "\n".join(invokes) + f"\n</{DSML}function_calls>"


def _message(i: int, msgs: list[dict[str, Any]], think: bool) -> str:
    m, opener = msgs[i], THINK if think else END_THINK
    role, content = m.get("role"), m.get("content") or ""
    if role == "system":
        out = content
        if m.get("tools"):
            funcs = "\n".join(_json(t.get("function", t)) for t in m["tools"])
            out += "\n\n" + TOOLS_BLOCK.format(dsml=DSML, tool_schemas=funcs)
        return out
    if role == "user":
        return f"{USER}{content}{ASSISTANT}{opener}"
    if role == "assistant":
        reasoning = (m.get("reasoning_content") or "") + END_THINK if think else ""
        return reasoning + content + (_tool_calls(m["tool_calls"]) if m.get("tool_calls") else "") + EOS
    if role == "tool":
        j = i - 1
        while j >= 0 and msgs[j].get("role") == "tool":
            j -= 1
        calls = msgs[j].get("tool_calls") if j >= 0 and msgs[j].get("role") == "assistant" else None
        order = i - j
        if not calls or len(calls) < order:
            raise Dsv32Error(f"message {i}: a tool result with no tool call of the assistant before it")
        out = "\n\n<function_results>" if order == 1 else ""
        out += f"\n<result>{content}</result>"
        if order == len(calls):
            out += "\n</function_results>\n\n" + opener
        return out
    raise Dsv32Error(f"message {i}: role {role!r} (V3.2 renders system, user, assistant, tool)")


def render(messages: list[dict[str, Any]], tools: list | None, kwargs: dict[str, Any],
           add_generation_prompt: bool) -> str:  # fmt: skip
    """The prompt text of `messages` (tool-call arguments as objects or JSON strings)."""
    if kwargs.get("drop_thinking", False):
        raise Dsv32Error(
            "drop_thinking=True: --tito-model deepseekv32 keeps every turn's thinking (Miles pins "
            "drop_thinking=False; dropping it rewrites history, which is not append-only)"
        )
    think = thinking_on(kwargs)
    msgs = [dict(m) for m in messages]
    if tools:
        if not msgs or msgs[0].get("role") != "system":
            msgs.insert(0, {"role": "system", "content": ""})
        msgs[0]["tools"] = tools
    text = BOS + "".join(_message(i, msgs, think) for i in range(len(msgs)))
    if add_generation_prompt or not msgs:
        return text
    opener = THINK if think else END_THINK
    tail = {"user": ASSISTANT + opener, "tool": "\n\n" + opener}.get(msgs[-1].get("role"))
    return text[: -len(tail)] if tail and text.endswith(tail) else text
