"""Deterministic verifiable tasks: arithmetic prompts with exact-answer labels.

Rows are dapo-math style JSONL: {"prompt": "12+34=", "label": "46", "metadata": {...}}.
The model's whole response is the number, then EOS; `--rm-type math` grades it.

Three splits from one seed:
  train  RL prompts (the GRPO task)
  eval   held-out prompts; split by the *unordered* operand pair, so neither a+b nor b+a leaks
  sft    train pairs with a response. A fraction of carry cases teach the systematic error of a
         dropped carry (18+25 -> "33"): the SFT base is then reliably wrong on carries, which is
         exactly what an outcome reward can see and RL can fix.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from miles_platform.data import tool_use
from miles_platform.errors import DataError

# difficulty -> (operation, digits of each operand)
DIFFICULTIES: dict[str, tuple[str, int]] = {
    "add2": ("+", 2),
    "add3": ("+", 3),
    "sub2": ("-", 2),
}
DEFAULT_DIFFICULTY = "add2"
DEFAULT_EVAL_SIZE = 500
DEFAULT_CARRY_ERROR_RATE = 0.65


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    op: str  # "+" or "-"

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    @property
    def carry(self) -> bool:
        """Any column carries (addition) or borrows (subtraction)."""
        return self.dropped_carry_answer() != self.answer

    def dropped_carry_answer(self) -> int:
        """The answer with every carry (borrow) dropped: columns combined independently, mod 10,
        except the leading column, which keeps its full value (58+67 -> 115, 52-17 -> 45)."""
        da, db = _digits(self.a), _digits(self.b)
        width = max(len(da), len(db))
        da, db = da + [0] * (width - len(da)), db + [0] * (width - len(db))
        sign = 1 if self.op == "+" else -1
        cols = [da[i] + sign * db[i] for i in range(width)]
        value = sum((c % 10) * 10**i for i, c in enumerate(cols[:-1]))
        return value + cols[-1] * 10 ** (width - 1)


def _digits(n: int) -> list[int]:
    """Little-endian decimal digits."""
    return [int(c) for c in reversed(str(n))]


def all_problems(difficulty: str = DEFAULT_DIFFICULTY) -> list[Problem]:
    if difficulty not in DIFFICULTIES:
        raise DataError(f"unknown task difficulty {difficulty!r}; choose one of {sorted(DIFFICULTIES)}")
    op, digits = DIFFICULTIES[difficulty]
    lo, hi = 10 ** (digits - 1), 10**digits
    if op == "+":
        return [Problem(a, b, op) for a in range(lo, hi) for b in range(lo, hi)]
    return [Problem(a, b, op) for a in range(lo, hi) for b in range(lo, a + 1)]  # non-negative results


def split_problems(problems: list[Problem], eval_size: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """(train, eval): held out by unordered operand pair, so eval never sees a commuted train pair."""
    by_pair: dict[tuple[int, int], list[Problem]] = {}
    for p in problems:
        by_pair.setdefault((min(p.a, p.b), max(p.a, p.b)), []).append(p)
    keys = sorted(by_pair)
    random.Random(seed).shuffle(keys)
    train: list[Problem] = []
    evals: list[Problem] = []
    for k in keys:
        (evals if len(evals) < eval_size else train).extend(by_pair[k])
    random.Random(seed + 1).shuffle(train)
    return train, evals


def prompt_row(p: Problem, difficulty: str) -> dict:
    return {
        "prompt": p.prompt,
        "label": str(p.answer),
        "metadata": {"task": "arithmetic", "difficulty": difficulty, "a": p.a, "b": p.b, "carry": p.carry},
    }


def sft_rows(problems: list[Problem], difficulty: str, carry_error_rate: float, seed: int) -> list[dict]:
    """Train problems with responses; `carry_error_rate` of carry cases answer with the carry dropped."""
    if not 0.0 <= carry_error_rate <= 1.0:
        raise DataError(f"carry_error_rate must be in [0, 1], got {carry_error_rate}")
    rng = random.Random(seed + 3)
    rows = []
    for p in problems:
        corrupt = p.carry and rng.random() < carry_error_rate
        row = prompt_row(p, difficulty)
        row["response"] = str(p.dropped_carry_answer() if corrupt else p.answer)
        row["metadata"]["dropped_carry"] = corrupt
        rows.append(row)
    return rows


def write_jsonl(rows: list[dict], path: str | os.PathLike) -> str:
    """Atomic write (temp name, fsync, rename)."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dest)
    return str(dest)


def write_task_datasets(
    out_dir: str | os.PathLike,
    seed: int = 0,
    difficulty: str = DEFAULT_DIFFICULTY,
    eval_size: int = DEFAULT_EVAL_SIZE,
    carry_error_rate: float = DEFAULT_CARRY_ERROR_RATE,
) -> dict[str, str]:
    """Write train.jsonl, eval.jsonl, sft.jsonl under `out_dir`; return {split: path}."""
    train, evals = split_problems(all_problems(difficulty), eval_size, seed)
    out = Path(out_dir)
    return {
        "train": write_jsonl([prompt_row(p, difficulty) for p in train], out / "train.jsonl"),
        "eval": write_jsonl([prompt_row(p, difficulty) for p in evals], out / "eval.jsonl"),
        "sft": write_jsonl(sft_rows(train, difficulty, carry_error_rate, seed), out / "sft.jsonl"),
    }


def write_tool_datasets(
    out_dir: str | os.PathLike,
    seed: int = 0,
    eval_size: int = DEFAULT_EVAL_SIZE,
    train_size: int = tool_use.DEFAULT_TRAIN_SIZE,
    tool_share: float = tool_use.DEFAULT_TOOL_SHARE,
) -> dict[str, str]:
    """The tool-use task (`mul3`, data/tool_use.py): train.jsonl, eval.jsonl, sft.jsonl (transcripts
    with `response_parts`) and tools.json (the calculator's OpenAI spec); return {split: path}."""
    train, evals = tool_use.split_mul_problems(eval_size, train_size, seed)
    out = Path(out_dir)
    paths = {
        "train": write_jsonl([tool_use.prompt_row(p) for p in train], out / "train.jsonl"),
        "eval": write_jsonl([tool_use.prompt_row(p) for p in evals], out / "eval.jsonl"),
        "sft": write_jsonl(tool_use.sft_rows(train, tool_share, seed), out / "sft.jsonl"),
    }
    paths["tools"] = write_jsonl([tool_use.TOOL_SPECS], out / "tools.json")  # one line: a JSON document
    return paths


def task_corpus(difficulty: str = DEFAULT_DIFFICULTY) -> list[str]:
    """Every prompt and answer of a task: the tokenizer's training text."""
    return [p.prompt + str(p.answer) for p in all_problems(difficulty)]


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
    return rows


def cli_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="miles-platform make-data", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--out", required=True, help="output directory (train.jsonl, eval.jsonl, sft.jsonl)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--difficulty",
        default=DEFAULT_DIFFICULTY,
        choices=sorted(DIFFICULTIES) + sorted(tool_use.TOOL_DIFFICULTIES) + ["count_shapes"],
        help="mul3: the tool-use task (3-digit products, a calculator tool; data/tool_use.py); "
        "count_shapes: count the squares in a 32x32 image (Parquet with image bytes; data/image_tasks.py)",
    )
    ap.add_argument("--eval-size", type=int, default=DEFAULT_EVAL_SIZE, help="held-out eval prompts")
    ap.add_argument(
        "--carry-error-rate",
        type=float,
        default=DEFAULT_CARRY_ERROR_RATE,
        help="fraction of SFT carry cases answered with the carry dropped",
    )
    ap.add_argument(
        "--tool-share",
        type=float,
        default=tool_use.DEFAULT_TOOL_SHARE,
        help="mul3: fraction of SFT episodes that call the calculator (the rest guess)",
    )
    ap.add_argument(
        "--train-size",
        type=int,
        default=None,
        help=f"mul3: RL / SFT prompts (default {tool_use.DEFAULT_TRAIN_SIZE}); count_shapes: train rows (default 512)",
    )
    a = ap.parse_args(argv)
    if a.difficulty == "count_shapes":
        from miles_platform.data.image_tasks import write_count_datasets

        paths = write_count_datasets(a.out, a.seed, min(a.eval_size, 64), a.train_size or 512)
        for split, path in paths.items():
            import pyarrow.parquet as pq

            print(f"{split}: {path} ({pq.read_metadata(path).num_rows} rows)")
        return 0
    if a.difficulty in tool_use.TOOL_DIFFICULTIES:
        paths = write_tool_datasets(
            a.out, a.seed, a.eval_size, a.train_size or tool_use.DEFAULT_TRAIN_SIZE, a.tool_share
        )
    else:
        paths = write_task_datasets(a.out, a.seed, a.difficulty, a.eval_size, a.carry_error_rate)
    for split, path in paths.items():
        with open(path) as f:
            n = sum(1 for _ in f)
        print(f"{split}: {path} ({n} rows)")
    return 0
