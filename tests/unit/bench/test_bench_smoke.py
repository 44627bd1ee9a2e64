"""`make bench` and the hand-run studies stay runnable: benchmarks are never part of `make test`,
so nothing else notices when one rots (bench_data raised a KeyError for days after the rollout
schema grew, and `make bench` reported the three learning studies as error rows)."""

import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import run_all  # noqa: E402

# each hand-run study and one flag of its own (argparse's help always has --help)
STUDIES = {"bench/bench_lora_learning.py": "--lora-lr", "bench/bench_diffusion_learning.py": "--seeds",
           "bench/bench_diffusion_precision.py": "--hf-checkpoint", "scripts/moe_learning.py": "--rollouts",
           "scripts/opd_learning.py": "--opd-kl-coef", "scripts/tool_learning.py": "--prompt-data",
           "scripts/family_learning.py": "--sft-iters", "scripts/overlap_learning.py": "--sft-threads"}  # fmt: skip


def test_make_bench_runs_the_row_modules_and_names_the_studies():
    every = {p.stem for p in (REPO / "bench").glob("bench_*.py")}
    runs, studies = set(run_all.discover()), dict(run_all.standalone())
    assert runs | set(studies) == every and not runs & set(studies)
    assert {"bench_data", "bench_e2e", "bench_rollout", "bench_train", "bench_weights"} <= runs
    assert set(studies) == {Path(s).stem for s in STUDIES if s.startswith("bench/")}
    for name, cmd in studies.items():  # the command line from the study's own docstring
        assert cmd.startswith(f"PYTHONPATH=. python -m bench.{name} "), cmd
    with pytest.raises(SystemExit):  # a study (or a typo) is refused by name, not an error row
        run_all.main(["--only", "bench_lora_learning"])


def test_bench_data_builds_a_store_of_the_current_schema_and_both_sides_agree():
    from bench import bench_data

    rows = bench_data.run(rows=2_000, rollouts=4)  # it asserts DuckDB and pandas return the same means
    assert [r.get("error") for r in rows] == [None, None, None]
    assert all(r["ours"] > 0 and r["baseline"] > 0 and r["ratio"] > 0 for r in rows)


@pytest.mark.parametrize("path", STUDIES)
def test_each_hand_run_study_imports_and_parses_its_flags(path, monkeypatch, capsys):
    flag = STUDIES[path]
    monkeypatch.setattr(sys, "argv", [path, "--help"])
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(REPO / path), run_name="__main__")
    assert e.value.code == 0
    assert flag in capsys.readouterr().out  # argparse's help, with the study's own flags


def _calls_into_the_platform(path: Path):
    """(line, function, keyword names) of each call in `path` of a function it imports from
    miles_platform by name, with the keys of a `**kw` built by `kw = dict(...)` in the file."""
    import ast
    import importlib

    tree = ast.parse(path.read_text())
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("miles_platform"):
            for a in node.names:
                obj = getattr(importlib.import_module(node.module), a.name, None)
                if callable(obj):
                    names[a.asname or a.name] = obj
    dicts = {  # kw = dict(a=..., b=...): what a later f(..., **kw) passes
        t.id: [k.arg for k in node.value.keywords if k.arg]
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name) and node.value.func.id == "dict"
        for t in node.targets if isinstance(t, ast.Name)
    }  # fmt: skip
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
            keywords = [k.arg for k in node.keywords if k.arg]
            for k in node.keywords:
                if k.arg is None and isinstance(k.value, ast.Name):
                    keywords += dicts.get(k.value.id, [])
            yield node.lineno, names[node.func.id], keywords


def test_the_benches_call_the_platform_with_keywords_it_takes():
    """A bench calls the platform with the arguments of the day: bench_rollout passed `args=` to
    `evaluate` for a session after evaluate took typed `rewards=` instead, and `make bench` gave an
    error row where its eval numbers were (tests never run the benches whole: too slow)."""
    import inspect

    wrong = []
    for path in sorted((REPO / "bench").glob("*.py")):
        for line, fn, keywords in _calls_into_the_platform(path):
            try:
                params = inspect.signature(fn).parameters
            except (TypeError, ValueError):
                continue
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            wrong += [f"{path.name}:{line} {fn.__name__}({k}=)" for k in keywords if k not in params]
    assert not wrong, wrong
