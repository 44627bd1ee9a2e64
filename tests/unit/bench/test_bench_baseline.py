"""`make bench` remembers its last results (bench/baseline.json) and flags a row whose ratio moved the
wrong way by more than its noise; the comparison logic only, no benchmark runs here."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import baseline, run_all  # noqa: E402

# units the modules report (docs/BENCHMARKS.md's tables) -> which way their ratio is better
UNITS = {
    "MB/s": "higher",
    "rows/s (ratio: x faster)": "higher",
    "MB (ratio: fraction of JSONL)": "lower",
    "s/step (ratio: ours / bare, goal <= 1.3; median of 10 steps after 1 warm-up)": "lower",
    "s/step (ratio: ours / TRL, goal < 1.0; median of 10 steps after 1 warm-up; TRL 1.16.0)": "lower",
    "s/step (ratio: async / sync; < 1 = overlap pays)": "lower",
    "s/step (ratio: share of our mean step; means over the measured steps)": "none",
    "tok/s (ratio: x faster than one model.generate per sample)": "higher",
    "GFLOP/s (ratio: fraction of peak; 2*2.82M params*4415 tok/s, threads=1)": "higher",
    "s/rollout (16x8, T=1, <=8 tok; ratio: x faster; medians of 9)": "higher",
    "s (ratio: x faster; pass@1 0.094 vs 0.094)": "higher",
    "tok/s (ratio: share of plain HF fwd+bwd+AdamW speed, goal >= 0.8; 128 samples)": "higher",
    "GB/s": "higher",
    "fraction of full": "lower",
    "fraction changed": "none",
    "s (ratio: startup / bare load)": "lower",
    "furlongs": "none",
}


@pytest.mark.parametrize("unit", UNITS)
def test_direction_is_read_from_the_unit(unit):
    assert baseline.direction({"unit": unit}) == UNITS[unit]


def test_an_explicit_better_wins_and_verdicts_respect_noise():
    assert baseline.direction({"unit": "GB/s", "better": "lower"}) == "lower"
    assert baseline.verdict(1.0, 0.85, "higher", 0.2) == "same"  # within 20%
    assert baseline.verdict(1.0, 0.8, "higher", 0.2) == "WORSE"  # 1 / 1.2 = 0.833
    assert baseline.verdict(1.0, 1.3, "higher", 0.2) == "better"
    assert baseline.verdict(1.0, 1.3, "lower", 0.2) == "WORSE"
    assert baseline.verdict(1.0, 0.5, "lower", 0.2) == "better"
    assert baseline.verdict(1.0, 9.0, "none", 0.2) == "info"


MACHINE = {"cpu_model": "Xeon X", "cpu_count": 2, "cuda": False}


def _rows(**ratios):
    return [{"module": "bench_engine", "name": n, "ours": 10 * r, "baseline": 10.0, "ratio": r, "unit": "tok/s"}
            for n, r in ratios.items()]  # fmt: skip


def test_compare_flags_worse_gone_and_failed_rows():
    old = {"machine": MACHINE, "commit": "abc1234", "date": "2026-12-05T12:00:00+00:00",
           "rows": _rows(a=1.0, b=1.0, c=1.0, gone=1.0)}  # fmt: skip
    new_rows = _rows(a=0.5, b=1.1, new=2.0) + [
        {"module": "bench_engine", "name": "c", "ratio": None, "error": "exit 1: boom"}
    ]
    cur = {"machine": MACHINE, "rows": new_rows}
    by = {e["name"]: e for e in baseline.compare(cur, old)}
    assert {n: e["verdict"] for n, e in by.items()} == {
        "a": "WORSE", "b": "same", "new": "new", "c": "ERROR", "gone": "gone"
    }  # fmt: skip
    assert by["a"]["noise"] == baseline.module_noise("bench_engine") == 0.2  # the module's NOISE
    assert by["a"]["ours_change"] == pytest.approx(-0.5)  # same machine: ours compared too
    text = baseline.format_comparison(list(by.values()), cur, old)
    assert "abc1234" in text and "DIFFERENT MACHINE" not in text
    assert text.splitlines()[3].startswith("WORSE") and "+10%" in text and "boom" in text  # worst first
    assert "3 row(s) moved the wrong way" in text


def test_another_machine_compares_ratios_only_and_a_row_noise_wins():
    old = {"machine": MACHINE, "rows": _rows(a=1.0)}
    cur = {"machine": {**MACHINE, "cpu_model": "EPYC Y", "cpu_count": 16}, "rows": _rows(a=0.5)}
    cur["rows"][0]["noise"] = 1.5  # measured by the module: a halving is within it
    (e,) = baseline.compare(cur, old)
    assert e["verdict"] == "same" and e["ours_change"] is None and e["same_machine"] is False
    text = baseline.format_comparison([e], cur, old)
    assert "DIFFERENT MACHINE" in text and "EPYC Y x16" in text and "ratios compared only" in text


def test_update_with_only_some_modules_keeps_the_others(tmp_path):
    old = {"machine": MACHINE, "rows": _rows(a=1.0) + [{"module": "bench_data", "name": "d", "ratio": 3.0}]}
    new = baseline.updated({"machine": MACHINE, "rows": _rows(a=2.0)}, old, "def5678")
    assert sorted((r["module"], r["ratio"]) for r in new["rows"]) == [
        ("bench_data", 3.0),
        ("bench_engine", 2.0),
    ]
    assert new["modules"]["bench_engine"]["commit"] == "def5678" and new["commit"] == "def5678"
    path = tmp_path / "baseline.json"
    baseline.write(new, path)
    assert baseline.load(path) == new and baseline.load(tmp_path / "none.json") is None


def test_run_all_compares_a_results_file_and_updates_the_baseline(tmp_path, capsys):
    base, res = tmp_path / "baseline.json", tmp_path / "results.json"
    res.write_text(json.dumps({"machine": MACHINE, "commit": "aaa1111", "rows": _rows(a=1.0)}))
    run_all.main(["--compare", str(res), "--baseline", str(base), "--update-baseline"])
    assert "no baseline" in capsys.readouterr().out and baseline.load(base)["commit"] == "aaa1111"
    res.write_text(json.dumps({"machine": MACHINE, "rows": _rows(a=0.4)}))
    run_all.main(["--compare", str(res), "--baseline", str(base)])
    out = capsys.readouterr().out
    assert "WORSE" in out and "aaa1111" in out and baseline.load(base)["rows"][0]["ratio"] == 1.0


def test_bench_startup_reads_the_runs_startup_line():
    from bench.bench_startup import parse_startup_line
    from miles_platform.startup import StartupClock, process_age_s

    clock = StartupClock(launch_s=0.5)
    for phase in ("preflight", "data"):
        clock.mark(phase)
    got = parse_startup_line(clock.summary())
    assert list(got) == ["launch", "preflight", "data", "total"] and got["launch"] == 0.5
    assert got["total"] == pytest.approx(clock.total(), abs=0.01)
    assert set(clock.metrics()) == {
        "perf/startup_time",
        *(f"perf/startup_{p}_time" for p in got if p != "total"),
    }
    assert 0 < process_age_s() < 3600  # this process's age, from /proc


def test_bench_processes_write_bytecode_where_the_shell_forbids_it():
    """A bench run outside make (PYTHONDONTWRITEBYTECODE set, as in this machine's shell) made each of
    our processes compile every module it imported, every run; TRL's venv is precompiled."""
    import os
    import subprocess
    import sys

    from bench.common import ROOT

    code = "import os, sys, bench.common; print(os.environ.get('PYTHONDONTWRITEBYTECODE'), sys.dont_write_bytecode)"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["None", "False"], out.stderr[-500:]
