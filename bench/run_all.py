"""`make bench`: run every bench/bench_*.py in its own subprocess, print one table, write results.json.

Each module runs as `python -m bench.<name> --json` (its rows as a JSON list on the last stdout
line); a module without that flag is run through `--one <name>` here, which imports it and calls
`run()`. A module that fails or times out becomes an error row and the suite goes on. A module with
neither (the multi-seed learning studies: bench_lora_learning, bench_diffusion_learning,
bench_diffusion_precision, each minutes to hours and run by hand as their docstrings say) is not
part of `make bench`; the runner names them at the end with their command line.

At the end the run is compared with bench/baseline.json (bench/baseline.py: a table flagging every
row whose ratio moved the wrong way beyond its noise); `--update-baseline` writes this run into it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from bench import baseline
from bench.common import error_row, print_table

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results.json"
# Ray's token auth stays on here as everywhere (docs/RELIABILITY.md)
ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def _speaks_json(name: str) -> bool:
    return "--json" in (BENCH_DIR / f"{name}.py").read_text()


def _has_run(name: str) -> bool:
    return re.search(r"^def run\(", (BENCH_DIR / f"{name}.py").read_text(), re.M) is not None


def _all_modules() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("bench_*.py"))


def discover() -> list[str]:
    """The modules that report rows (`--json` or `run()`): what `make bench` runs."""
    return [n for n in _all_modules() if _speaks_json(n) or _has_run(n)]


def standalone() -> list[tuple[str, str]]:
    """(name, command line from its docstring) of every bench module `make bench` does not run."""
    runs, out = set(discover()), []
    for n in _all_modules():
        if n in runs:
            continue
        text = (BENCH_DIR / f"{n}.py").read_text()
        m = re.search(r"^\s+(PYTHONPATH=\S+ python -m bench\.\S+.*)$", text, re.M)
        cmd = m.group(1).strip() if m else f"python -m bench.{n} --help (its docstring has no command line)"
        out.append((n, cmd))
    return out


def _last_json_list(stdout: str) -> list[dict] | None:
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("["):
            try:
                rows = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rows, list):
                return rows
    return None


def run_module(name: str, timeout_s: float) -> tuple[list[dict], float]:
    """(rows, seconds) of one bench module, isolated in a subprocess."""
    args = ["-m", f"bench.{name}", "--json"] if _speaks_json(name) else ["-m", "bench.run_all", "--one", name]
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in ENV.items()}}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return [error_row(f"{name}", f"timed out after {timeout_s:.0f}s")], time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    rows = _last_json_list(proc.stdout) if proc.returncode == 0 else None
    if rows is None:
        tail = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"])[-1]
        return [error_row(name, f"exit {proc.returncode}: {tail[:200]}")], seconds
    noise = baseline.module_noise(name)
    for r in rows:
        r.setdefault("module", name)
        if noise is not None and not r.get("error"):
            r.setdefault("noise", noise)
        if r.get("ratio") is None and not r.get("error"):
            r["error"] = "no ratio reported"
    return rows, seconds


def machine_info() -> dict:
    import torch

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        model = platform.processor()
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.is_available(),
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def run_one(name: str) -> None:
    """`--one <name>`: import bench.<name>, call run(), print its rows as the last JSON line."""
    rows = importlib.import_module(f"bench.{name}").run()
    sys.stdout.flush()
    print(json.dumps(rows), flush=True)


def trl_venv_note() -> str:
    """Whether bench_e2e's TRL row will run (it does whenever the TRL venv exists)."""
    from bench.bench_e2e import trl_python

    py = trl_python()
    if py:
        return f"TRL baseline: {py} (bench_e2e runs TRL's GRPOTrainer row)"
    return (
        "TRL baseline: no .venv-trl (`make bench-trl-env`, or MILES_TRL_PYTHON): its row will say unavailable"
    )


def report_against_baseline(results: dict, path: Path, update: bool) -> None:
    """Print the comparison with the remembered baseline; with `update`, write this run into it."""
    old = baseline.load(path)
    if old is None:
        print(f"\nno baseline at {path} yet: `python -m bench.run_all --update-baseline` writes one")
    else:
        print()
        print(baseline.format_comparison(baseline.compare(results, old), results, old))
    if update:
        baseline.write(baseline.updated(results, old, results.get("commit") or baseline.git_commit()), path)
        print(f"wrote the baseline {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--one", help="run one module in this process (used by the runner)")
    p.add_argument("--only", nargs="*", help="module names to run (default: all bench_*.py)")
    p.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds per module (bench_e2e with TRL: ~270 s on a busy 2-core box)",
    )
    p.add_argument("--out", default=str(RESULTS), help="results JSON path")
    p.add_argument(
        "--baseline", default=str(baseline.BASELINE), help="the remembered results to compare with"
    )
    p.add_argument("--update-baseline", action="store_true",
                   help="write this run into the baseline (with --only: those modules' rows only)")  # fmt: skip
    p.add_argument("--compare", metavar="RESULTS_JSON",
                   help="run nothing: compare a results file (e.g. bench/results.json) with the baseline")  # fmt: skip
    a = p.parse_args(argv)
    if a.one:
        run_one(a.one)
        return 0
    if a.compare:
        report_against_baseline(json.loads(Path(a.compare).read_text()), Path(a.baseline), a.update_baseline)
        return 0
    unknown = sorted(set(a.only or ()) - set(discover()))
    if unknown:
        p.error(
            f"not a row-reporting bench module: {', '.join(unknown)} (choose from {', '.join(discover())})"
        )
    names = a.only or discover()
    if "bench_e2e" in names:
        print(f"[bench] {trl_venv_note()}", flush=True)
    t0 = time.perf_counter()
    rows, timings = [], {}
    for name in names:
        print(f"[bench] {name} ...", flush=True)
        got, seconds = run_module(name, a.timeout)
        timings[name] = round(seconds, 2)
        print(f"[bench] {name}: {len(got)} rows in {seconds:.1f}s", flush=True)
        rows.extend(got)
    total = time.perf_counter() - t0
    print()
    print_table(rows)
    print(f"\n{len(rows)} rows from {len(names)} modules in {total:.0f}s")
    out = {
        "machine": machine_info(),
        "commit": baseline.git_commit(),
        "total_seconds": round(total, 2),
        "module_seconds": timings,
        "rows": rows,
    }
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")
    errors = sum(1 for r in rows if r.get("error"))
    if errors:
        print(f"{errors} row(s) could not be measured: see their unit column")
    report_against_baseline(out, Path(a.baseline), a.update_baseline)
    if not a.only:
        print("\nnot run by `make bench` (multi-seed studies, run by hand; docs/BENCHMARKS.md):")
        for name, cmd in standalone():
            print(f"  {name}: {cmd}")
    return 0  # benchmarks never gate anything


if __name__ == "__main__":
    sys.exit(main())
