"""The math reward's plain-number fast path gives math_verify's verdict, on every row of the task
datasets (their labels, the SFT answers and the tool task's guesses: the answers the demo's models
give) and on hand-picked edge cases; whatever is not a plain number goes to math_verify."""

from __future__ import annotations

import functools

import pytest

from miles_platform.data import tasks, tool_use
from miles_platform.data.image_tasks import MAX_SHAPES
from miles_platform.rollout.rm_hub import math_rm
from miles_platform.rollout.rm_hub.math_rm import fast_equal, math_reward, plain_number, verify_equal


def _dataset_pairs() -> set[tuple[str, str]]:
    """(answer, label) of every row: the demo's add2 train / eval / sft splits, sub2's eval split,
    100 rows of the tool task's eval split and the counting task's labels; each label against itself and
    against the wrong answer the SFT data teaches (a dropped carry, a rounded guess)."""
    pairs: set[tuple[str, str]] = set()
    train, evals = tasks.split_problems(tasks.all_problems("add2"), tasks.DEFAULT_EVAL_SIZE, seed=0)
    for r in tasks.sft_rows(train, "add2", tasks.DEFAULT_CARRY_ERROR_RATE, seed=0):
        pairs.add((r["response"], r["label"]))
    for p in [*train, *evals, *tasks.split_problems(tasks.all_problems("sub2"), 500, seed=0)[1]]:
        pairs |= {(str(p.answer), str(p.answer)), (str(p.dropped_carry_answer()), str(p.answer))}
    for p in tool_use.split_mul_problems(500, 0, seed=0)[1][:100]:  # ~2.7 ms to parse each 6-digit number
        pairs |= {(str(p.answer), str(p.answer)), (str(p.guess()), str(p.answer))}
    pairs |= {(str(k), str(k)) for k in range(1, MAX_SHAPES + 1)} | {("3", "4")}
    return pairs


def test_fast_path_equals_math_verify_on_every_dataset_row():
    from math_verify import parse, verify

    parsed = functools.cache(lambda s: parse(math_rm._as_latex(s)))  # verify_equal, each label parsed once
    pairs = _dataset_pairs()
    assert len(pairs) > 500
    for pred, gold in sorted(pairs):
        fast = fast_equal(pred, gold)
        assert fast is not None, (pred, gold)  # every answer of these tasks takes the fast path
        assert fast == verify(parsed(gold), parsed(pred)), (pred, gold)
    assert sum(p == g for p, g in pairs) < len(pairs)  # wrong answers are in the set too


# (answer, label, takes the fast path): the verdict must be math_verify's either way
EDGE = [
    ("12", "12", True), ("01", "1", True), ("007", "7", True), ("-0", "0", True), ("-0.0", "0", True),
    ("3.0", "3", True), ("3", "3.000000", True), ("0.1", "0.10", True), (" 12 \n", "12", True),
    ("-12", "12", True), ("12", "-12", True), ("2.000001", "2", True), ("123456789012345", "123456789012345", True),
    ("", "12", True), ("  ", "0", True),
    # not plain: math_verify decides (and often differs from a naive rule)
    ("1e3", "1000", False), ("1,000", "1000", False), ("1 000", "1000", False), ("1,00", "100", False),
    ("1 2", "12", False), ("12 12", "12", False), ("1\\,000", "1000", False), ("+5", "5", False), (".5", "0.5", False),
    ("5.", "5", False), ("$12$", "12", False), ("1/2", "0.5", False), ("\\frac{1}{2}", "0.5", False),
    ("0.5", "\\frac{1}{2}", False), ("50%", "50", False), ("12a", "12", False), ("x", "x", False),
    ("0.1234567", "0.1234568", False), ("2.0000001", "2", False),  # math_verify rounds floats to 6 places
    ("1234567890123456", "1234567890123457", False),  # past sympy's 15-digit floats
]  # fmt: skip


@pytest.mark.parametrize("pred,gold,fast", EDGE, ids=[f"{p!r}~{g!r}" for p, g, _ in EDGE])
def test_edge_cases_take_the_fast_path_only_where_it_agrees(pred, gold, fast):
    got = fast_equal(pred, gold)
    assert (got is not None) == fast
    want = verify_equal(pred, gold)
    if got is not None:
        assert got == want
    assert math_rm.math_equal(pred, gold) == want


def test_plain_number_definition_and_the_boxed_answer():
    assert plain_number(" -12.50 ") == plain_number("-12.5")
    assert [plain_number(s) for s in ("1e3", "1,000", "+1", ".5", "5.", "0x10", "1.2345678")] == [None] * 7
    assert math_reward("\\boxed{12}", "12") == 1.0 and math_reward("\\boxed{012}", "\\boxed{12}") == 1.0
    assert math_reward("\\boxed{12}", "13") == 0.0 and math_reward("12", "12.0") == 1.0
    assert math_reward("1 2", "12") == 0.0  # math_verify's verdict: a space is not a thousands separator
