"""Shared bench helpers: timing, the row shape every bench returns, table printing, `--json` main.

A row is a dict(name, ours, baseline, ratio, unit). `ratio` is ours / baseline; the unit says
which way is better (e.g. "tok/s (ratio: x faster)", "s (ratio: share of total)"). A row that
could not be measured carries `error` and no numbers -- never a made-up value.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# As the Makefile's `unexport PYTHONDONTWRITEBYTECODE`: every process a bench starts (a `train`, its
# Ray workers and fork server, TRL, a bare loader) writes the .pyc of a module it compiles and reads
# it the next time, as in a user's venv after its first run (TRL's venv is byte-compiled at install).
# Where the variable is set (this machine's shell, CI) and a bench was run without make, each of our
# processes compiled every module it imported, every time: a whole `train` read ~24-25 s instead of
# ~17-18, its start-up 11-14 s instead of 5-6 (2026-12-07), and TRL's precompiled venv did not pay it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def project_env(**extra: str) -> dict[str, str]:
    """The environment of a bench's subprocess that runs this tree (`miles-platform train`, a bare
    loader): this checkout first on PYTHONPATH (its actors, forked from the run's fork server, import
    this tree's miles_platform too, not a shared venv's editable install), offline, quiet tokenizers."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        **extra,
    }


COLUMNS = ("name", "ours", "baseline", "ratio", "unit")


def best_of(fn: Callable[[], Any], repeats: int = 3) -> float:
    """Seconds of the fastest of `repeats` calls (min is the least noisy on a shared machine)."""
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def median_of(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Median seconds of `repeats` calls (for work whose cost varies run to run, e.g. sampled text)."""
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def row(name: str, ours: float, baseline: float, unit: str, **extra: Any) -> dict[str, Any]:
    """One result row; ratio = ours / baseline (None if the baseline is zero)."""
    ours, baseline = float(ours), float(baseline)
    ratio = ours / baseline if baseline else None
    return {"name": name, "ours": ours, "baseline": baseline, "ratio": ratio, "unit": unit, **extra}


def error_row(name: str, reason: str) -> dict[str, Any]:
    """A row for something that could not be measured: says why, carries no numbers."""
    return {"name": name, "ours": None, "baseline": None, "ratio": None, "unit": "", "error": reason}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v == 0:
            return "0"
        a = abs(v)
        if a >= 1e5 or a < 1e-3:
            return f"{v:.3e}"
        return f"{v:.4g}"
    return str(v)


def format_table(rows: list[dict[str, Any]]) -> str:
    """One aligned text table; an error row shows its reason in the unit column."""
    cells = [list(COLUMNS)]
    for r in rows:
        unit = r.get("unit", "")
        if r.get("error"):
            unit = r["error"] if str(r["error"]).startswith("unavailable") else f"error: {r['error']}"
        cells.append(
            [str(r.get("name", "?"))] + [_fmt(r.get(c)) for c in ("ours", "baseline", "ratio")] + [unit]
        )
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS) - 1)]
    lines = []
    for k, c in enumerate(cells):
        left = c[0].ljust(widths[0])
        nums = [c[i].rjust(widths[i]) for i in (1, 2, 3)]
        lines.append("  ".join([left, *nums, c[4]]).rstrip())
        if k == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(format_table(rows), flush=True)


def main(run: Callable[[], list[dict[str, Any]]], argv: list[str] | None = None) -> None:
    """Entry point of a bench module: `--json` prints the rows as one JSON line, last; else a table."""
    argv = sys.argv[1:] if argv is None else argv
    rows = run()
    if "--json" in argv:
        sys.stdout.flush()
        print(json.dumps(rows), flush=True)
    else:
        print_table(rows)
