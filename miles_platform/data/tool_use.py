"""Tool-use task (`mul3`): 3-digit multiplication, which the tiny model cannot do, and a calculator
tool, which it can call (docs/rollout.md, "Worked example: teach a tiny model to call a calculator").

Rows are dapo-math style JSONL like the arithmetic task's: {"prompt": "123*456=", "label": "56088",
"metadata": {...}}. An episode under the multi-turn generator (qwen25 tool calls):

    123*456=<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call><|im_end|>
    <|im_start|>tool\\n56088<|im_end|>\\n<|im_start|>assistant\\n          (the tool's answer: loss mask 0)
    56088<|im_end|>                                                     (the final answer)

or, without the tool, the answer straight away. `--rm-type final_answer` grades the last number of
the final assistant turn.

Splits from one seed, held out by unordered operand pair (neither a*b nor b*a of eval is in train):
  train  RL prompts
  eval   held-out prompts
  sft    train prompts with a full transcript. A systematic majority (1 - --tool-share) skip the
         tool and guess (the product of the operands rounded to tens: the right size, never the
         answer); the rest call the calculator and copy its answer. The SFT base then calls the
         tool in about --tool-share of its samples and is right exactly when it does: a reward
         that sees it, and RL that can raise it.
`miles-platform make-data --difficulty mul3` writes them (data/tasks.py) and `tools.json` beside
them: the OpenAI tool specs (the flags take the importable TOOL_SPECS).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

from miles_platform.errors import DataError

TOOL_DIFFICULTIES = ("mul3",)
DEFAULT_TOOL_SHARE = 0.3
DEFAULT_TRAIN_SIZE = 20000
TOOL_NAME = "calculator"
EOS_TEXT = "<|im_end|>"  # the model's turn ends with EOS (miles_platform.models.tokenizer.EOS)

TOOL_SPECS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Evaluate an integer expression: two integers joined by +, - or * (e.g. 123*456).",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": "e.g. 123*456",
                        "pattern": r"^-?\d+[-+*]-?\d+$",
                    }
                },
                "required": ["expression"],
                "additionalProperties": False,
            },
        },
    }
]

_EXPRESSION = re.compile(r"\s*(-?\d{1,18})\s*([-+*])\s*(-?\d{1,18})\s*")


async def execute_tool(name: str, params: dict) -> str:
    """The calculator (--generate-execute-tool-function-path). A bad call answers an error string the
    model can learn from; it never raises (a raise would fail the episode)."""
    if name != TOOL_NAME:
        return f"error: unknown tool {name!r}; the tools are [{TOOL_NAME!r}]"
    expr = params.get("expression") if isinstance(params, dict) else None
    if not isinstance(expr, str):
        return 'error: calculator takes {"expression": "<int><op><int>"}, e.g. {"expression": "123*456"}'
    m = _EXPRESSION.fullmatch(expr)
    if m is None:
        return f"error: cannot evaluate {expr[:40]!r}; expected two integers joined by +, - or *"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


@dataclass(frozen=True)
class MulProblem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}*{self.b}="

    @property
    def answer(self) -> int:
        return self.a * self.b

    def guess(self) -> int:
        """The operands rounded to tens, multiplied: the right size, never the answer."""
        est = _round10(self.a) * _round10(self.b)
        return est if est != self.answer else est + 10


def _round10(n: int) -> int:
    return (n + 5) // 10 * 10


def tool_call_text(p: MulProblem) -> str:
    """The model's tool-call turn (qwen25 format), without its EOS."""
    call = {"name": TOOL_NAME, "arguments": {"expression": f"{p.a}*{p.b}"}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def tool_response_text(result: str) -> str:
    """What follows the tool-call turn: the tool message and the next assistant prompt, as
    multi_turn appends them with the platform's chat template (generate_hub.tool_call.tool_response_text;
    tests/unit/rollout/test_tool_use.py checks the two agree)."""
    return f"<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"


def transcript_parts(p: MulProblem, use_tool: bool) -> list[list]:
    """The response of one SFT episode as [text, trained] parts (the final EOS is added by SFT)."""
    if not use_tool:
        return [[str(p.guess()), 1]]
    return [
        [tool_call_text(p) + EOS_TEXT, 1],
        [tool_response_text(str(p.answer)), 0],  # the tool's answer: context, not a target
        [str(p.answer), 1],
    ]


# ---------------------------------------------------------------- splits
def split_mul_problems(
    eval_size: int, train_size: int, seed: int
) -> tuple[list[MulProblem], list[MulProblem]]:
    """(train, eval) over 3-digit operand pairs, disjoint by unordered pair; each pair appears once,
    in a random order of its operands."""
    pairs = [(a, b) for a in range(100, 1000) for b in range(a, 1000)]
    if eval_size + train_size > len(pairs):
        raise DataError(f"mul3 has {len(pairs)} operand pairs; eval {eval_size} + train {train_size} is more")
    rng = random.Random(seed)
    chosen = rng.sample(pairs, eval_size + train_size)
    probs = [MulProblem(a, b) if rng.random() < 0.5 else MulProblem(b, a) for a, b in chosen]
    return probs[eval_size:], probs[:eval_size]


def prompt_row(p: MulProblem, difficulty: str = "mul3") -> dict:
    return {
        "prompt": p.prompt,
        "label": str(p.answer),
        "metadata": {"task": "tool_use", "difficulty": difficulty, "a": p.a, "b": p.b},
    }


def sft_rows(problems: list[MulProblem], tool_share: float, seed: int) -> list[dict]:
    """Train problems with transcripts; `tool_share` of them call the calculator, the rest guess."""
    if not 0.0 <= tool_share <= 1.0:
        raise DataError(f"--tool-share must be in [0, 1], got {tool_share}")
    rng = random.Random(seed + 3)
    rows = []
    for p in problems:
        use_tool = rng.random() < tool_share
        parts = transcript_parts(p, use_tool)
        row = prompt_row(p)
        row["response"] = "".join(t for t, _ in parts)
        row["response_parts"] = parts
        row["metadata"]["uses_tool"] = use_tool
        rows.append(row)
    return rows


# ---------------------------------------------------------------- tokenizer
TOOL_TOKENS = ("<tool_call>", "</tool_call>")  # single tokens, kept in decoded text (as in Qwen's vocab)


def tool_corpus(n: int = 2000, seed: int = 0) -> list[str]:
    """Episodes of both kinds: the tool tokenizer's training text."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = MulProblem(rng.randrange(100, 1000), rng.randrange(100, 1000))
        out.append(p.prompt + "".join(t for t, _ in transcript_parts(p, True)))
        out.append(p.prompt + str(p.guess()))
    return out
