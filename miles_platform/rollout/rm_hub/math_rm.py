"""`--rm-type math`: answer equivalence with math_verify (1.0 / 0.0).

Grades the last `\\boxed{}` of the response when there is one, else lets math_verify extract
the final answer from the text. Normalized string equality is checked first (cheap, and most
correct answers hit it); only then are both sides parsed and compared symbolically. `warm_up()`
loads the parser at run start (rm_hub.warm_up_rewards), not inside the first step that needs it.
"""

from __future__ import annotations

import functools
import re
import threading
from decimal import Decimal

from miles_platform.rollout.rm_hub.boxed import last_boxed, strip_boxed

_SPACES = re.compile(r"\s+")
_NUMBER = re.compile(r"-?\d+(\.\d+)?")


def normalize(answer: str) -> str:
    s = answer.strip().strip("$").strip()
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = s.replace("dfrac", "frac").replace("tfrac", "frac").replace("^\\circ", "").replace("^{\\circ}", "")
    s = _SPACES.sub("", s).rstrip(".")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s


@functools.lru_cache(maxsize=1 << 16)  # pure; the n samples of a group often repeat an answer
def math_equal(pred: str, gold: str) -> bool:
    p, g = normalize(pred), normalize(gold)
    if p == g:
        return True
    if not p:  # an empty answer (EOS straight away) equals no non-empty gold: skip the parser
        return False
    if _NUMBER.fullmatch(p) and _NUMBER.fullmatch(g):  # two plain numbers: no parser needed
        return Decimal(p) == Decimal(g)
    from math_verify import parse, verify

    timeout = _timeout()
    try:
        gold_parsed = parse(_as_latex(gold), parsing_timeout=timeout)
        pred_parsed = parse(_as_latex(pred), parsing_timeout=timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:  # a parser crash or timeout on model output is a wrong answer, not a failed run
        return False


_warm = False


def warm_up() -> None:
    """Load the symbolic grader now (import math_verify + sympy, first parse: ~0.35 s on a 2-core
    CPU) so that the first answer that is not a plain number does not stall a training step. Once
    per process (a fork of the warm fork server inherits it done)."""
    global _warm
    if _warm:
        return
    from math_verify import parse, verify

    timeout = _timeout()
    verify(
        parse("$x+1$", parsing_timeout=timeout),
        parse("$1+x$", parsing_timeout=timeout),
        timeout_seconds=timeout,
    )
    _warm = True


def _timeout() -> int | None:
    """math_verify times out with signal.alarm, which only works on the main thread (a run driven
    from a thread, as in concurrent LoRA runs, grades without the alarm)."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def _as_latex(answer: str) -> str:
    s = answer.strip()
    if "\\boxed" in s or s.startswith("$"):
        return s
    return f"${s}$" if len(s) < 200 else s


def math_reward(response: str, label: str | None) -> float:
    if label is None or str(label).strip() == "":
        return 0.0
    gold = strip_boxed(str(label))
    boxed = last_boxed(response)
    pred = boxed if boxed is not None else response
    return 1.0 if math_equal(pred, gold) else 0.0
