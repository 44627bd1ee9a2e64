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
           "scripts/opd_learning.py": "--opd-kl-coef", "scripts/tool_learning.py": "--prompt-data"}  # fmt: skip


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
    assert [r.get("error") for r in rows] == [None, None]
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
