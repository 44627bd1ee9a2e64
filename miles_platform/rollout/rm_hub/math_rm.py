"""`--rm-type math`: answer equivalence with math_verify (1.0 / 0.0).

Grades the last `\\boxed{}` of the response when there is one, else lets math_verify extract
the final answer from the text. Two plain numbers (`plain_number`) are compared exactly as
decimals without the parser: the same verdict math_verify gives them (tests/unit/rollout/
test_math_fast_path.py checks every row of the task datasets and the edge cases), at ~1 us
instead of ~1-5 ms. Everything else is parsed and compared by math_verify. `warm_up()` loads the
parser at run start (rm_hub.warm_up_rewards), not inside the first step that needs it.
"""

from __future__ import annotations

import functools
import re
import threading
from decimal import Decimal

from miles_platform.rollout.rm_hub.boxed import last_boxed, strip_boxed

# A plain number: optional minus, digits, optional fraction of 1-6 digits, nothing else but
# surrounding whitespace. Not plain (math_verify decides): "+5", "1e3", "1,000", "1 000", ".5",
# "5.", "$5$", "1/2", fractions beyond 6 digits (math_verify rounds floats to 6 places:
# 0.1234567 == 0.1234568 there) and more than 15 digits in all (sympy's float precision).
_PLAIN = re.compile(r"-?(\d+)(?:\.(\d{1,6}))?")
_MAX_DIGITS = 15


def plain_number(answer: str) -> Decimal | None:
    """The value of `answer` if it is a plain number (see _PLAIN), else None."""
    m = _PLAIN.fullmatch(answer.strip())
    if m is None or len(m.group(1)) + len(m.group(2) or "") > _MAX_DIGITS:
        return None
    return Decimal(m.group(0))


def fast_equal(pred: str, gold: str) -> bool | None:
    """math_verify's verdict where it is known without the parser, else None: two plain numbers
    (equal values: 01 == 1, -0 == 0, 3.0 == 3) and an empty answer (never equal)."""
    if not pred.strip():
        return False
    p = plain_number(pred)
    g = plain_number(gold) if p is not None else None
    return None if g is None else p == g


@functools.lru_cache(maxsize=1 << 16)  # pure; the n samples of a group often repeat an answer
def math_equal(pred: str, gold: str) -> bool:
    fast = fast_equal(pred, gold)
    return verify_equal(pred, gold) if fast is None else fast


def verify_equal(pred: str, gold: str) -> bool:
    """math_verify's verdict: both sides parsed (as LaTeX when short) and compared."""
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
