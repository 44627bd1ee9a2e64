"""The background SFT base starts only when the command line selects the learning test."""

from pathlib import Path

import pytest
from background_bases import LEARNING_FILE, _selected

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "want"),
    [
        ([], True),  # `make test`: testpaths
        (["tests"], True),
        (["tests/e2e"], True),
        (["tests/e2e/test_learning.py::test_grpo_at_tp2_learns_as_at_tp1"], True),
        ([str(ROOT / "tests/e2e/test_learning.py")], True),
        (["tests/unit", "tests/dagster"], False),  # `make test-fast`
        (["tests/e2e/test_loop.py"], False),
    ],
)
def test_the_build_starts_only_for_a_selection_with_the_learning_test(args, want):
    assert _selected(args, ROOT, LEARNING_FILE) is want
