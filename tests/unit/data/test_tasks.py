import json

import pytest

from miles_platform.data.tasks import (
    Problem,
    all_problems,
    cli_main,
    read_jsonl,
    split_problems,
    write_task_datasets,
)
from miles_platform.errors import DataError


def test_dropped_carry_is_the_systematic_error():
    assert Problem(18, 25, "+").dropped_carry_answer() == 33
    assert Problem(58, 67, "+").dropped_carry_answer() == 115
    assert Problem(12, 34, "+").dropped_carry_answer() == 46 and not Problem(12, 34, "+").carry
    assert Problem(52, 17, "-").dropped_carry_answer() == 45 and Problem(52, 17, "-").answer == 35
    assert Problem(199, 1, "+").dropped_carry_answer() == 190


def test_splits_are_disjoint_and_deterministic(tmp_path):
    a = write_task_datasets(tmp_path / "a", seed=3)
    b = write_task_datasets(tmp_path / "b", seed=3)
    for split in ("train", "eval", "sft"):
        assert open(a[split]).read() == open(b[split]).read()
    train, evals = read_jsonl(a["train"]), read_jsonl(a["eval"])

    def pair(r):
        return min(r["metadata"]["a"], r["metadata"]["b"]), max(r["metadata"]["a"], r["metadata"]["b"])

    assert not {pair(r) for r in train} & {pair(r) for r in evals}  # not even commuted
    assert len(train) + len(evals) == 90 * 90 and 500 <= len(evals) <= 501
    row = evals[0]
    assert set(row) == {"prompt", "label", "metadata"} and row["prompt"].endswith("=")
    assert int(row["label"]) == row["metadata"]["a"] + row["metadata"]["b"]
    c = write_task_datasets(tmp_path / "c", seed=4)
    assert open(c["eval"]).read() != open(a["eval"]).read()


def test_sft_split_drops_the_carry_on_the_configured_fraction(tmp_path):
    paths = write_task_datasets(tmp_path, seed=0, carry_error_rate=0.65)
    rows = read_jsonl(paths["sft"])
    carry = [r for r in rows if r["metadata"]["carry"]]
    wrong = [r for r in carry if r["response"] != r["label"]]
    assert 0.6 < len(wrong) / len(carry) < 0.7
    assert all(int(r["response"]) == int(r["label"]) - 10 for r in wrong)  # 2-digit: exactly the lost carry
    assert all(r["response"] == r["label"] for r in rows if not r["metadata"]["carry"])
    clean = read_jsonl(write_task_datasets(tmp_path / "clean", carry_error_rate=0.0)["sft"])
    assert all(r["response"] == r["label"] for r in clean)


def test_other_difficulties_and_bad_input():
    sub = all_problems("sub2")
    assert all(p.answer >= 0 for p in sub)
    train, evals = split_problems(sub, 100, seed=0)
    assert not {(p.a, p.b) for p in train} & {(p.a, p.b) for p in evals}
    with pytest.raises(DataError, match="unknown task difficulty"):
        all_problems("add9")


def test_cli_writes_three_splits(tmp_path, capsys):
    assert cli_main(["--out", str(tmp_path), "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "train:" in out and "eval:" in out and "sft:" in out
    assert json.loads(open(tmp_path / "sft.jsonl").readline())["response"].isdigit()
