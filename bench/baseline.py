"""Benchmarks that remember: bench/baseline.json holds the last accepted `make bench` rows, and
each run is compared with it, row by row, in one table a reviewer can read.

The baseline file: {"machine", "commit", "date", "modules": {name: {machine, commit, date}},
"rows": [...]}. `python -m bench.run_all --update-baseline` writes it (a run with `--only`
replaces only its modules' rows). The comparison is on each row's `ratio` (ours against a
baseline measured in the same run, so it travels between machines better than seconds do); on
the same machine (same CPU model and count) the change of `ours` is shown too, on another one
the table says so and compares ratios only.

Which way is better: the row's `better` ("higher", "lower" or "none": a share or a property with
no good direction), else read from its unit (`direction`): "x faster" and "goal >= ..." are
higher-is-better, "goal < ..." and "< 1 = ..." lower; "share of ..." and "fraction changed" have
no direction; otherwise the unit's quantity decides: a rate (".../s") is higher-is-better (ratio =
ours / baseline of rates), seconds and sizes (s, ms, MB, "fraction of full") lower.

Noise: the row's `noise` (relative spread the module measured, e.g. bench_grading's repeats),
else its module's `NOISE = <float>` (a documented tolerance: how far that module's ratios moved
between two runs of the same commit on the same machine), else DEFAULT_NOISE. A row is WORSE when
its ratio moved the wrong way by more than that: higher-is-better new < old / (1 + noise),
lower-is-better new > old * (1 + noise).
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import re
import subprocess
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
BASELINE = BENCH_DIR / "baseline.json"
DEFAULT_NOISE = 0.3  # a module that documents nothing: this 2-core VM's typical run-to-run spread
KEEP = ("module", "name", "ours", "baseline", "ratio", "unit", "better", "noise", "error")

_GOAL = re.compile(r"goal\s*(>=|<=|>|<)")
_RATE = re.compile(r"^\s*[\w.]+/s\b")  # tok/s, GB/s, rows/s, GFLOP/s
_TIME_OR_SIZE = re.compile(r"^\s*(s|ms|us|min|MB|GB|KB|bytes)\b(?!/s)|^\s*s/|^\s*fraction of full")


def direction(row: dict[str, Any]) -> str:
    """'higher', 'lower' or 'none': which way the row's ratio is better (see the module docstring)."""
    if row.get("better") in ("higher", "lower", "none"):
        return row["better"]
    unit = str(row.get("unit") or "")
    if "x faster" in unit:
        return "higher"
    goal = _GOAL.search(unit)
    if goal:
        return "higher" if goal.group(1).startswith(">") else "lower"
    if "< 1 =" in unit:
        return "lower"
    if "share of" in unit or "fraction changed" in unit:
        return "none"
    if _RATE.search(unit):
        return "higher"
    if _TIME_OR_SIZE.search(unit):
        return "lower"
    return "none"


@functools.lru_cache(maxsize=64)
def module_noise(name: str) -> float | None:
    """The module's documented tolerance: a top-level `NOISE = <float>` in bench/<name>.py."""
    path = BENCH_DIR / f"{name}.py"
    ok = re.fullmatch(r"bench_\w+", name) and path.exists()
    m = re.search(r"^NOISE\s*=\s*([0-9.]+)", path.read_text(), re.M) if ok else None
    return float(m.group(1)) if m else None


def noise_of(row: dict[str, Any]) -> float:
    """The row's measured noise, else its module's NOISE, else DEFAULT_NOISE."""
    if isinstance(row.get("noise"), (int, float)):
        return float(row["noise"])
    documented = module_noise(str(row.get("module", ""))) if row.get("module") else None
    return DEFAULT_NOISE if documented is None else documented


def verdict(old: float, new: float, better: str, noise: float) -> str:
    """'WORSE', 'better' or 'same' (within noise); 'info' for a row with no direction."""
    if better == "none":
        return "info"
    if old <= 0 or new <= 0:
        return "same" if old == new else ("better" if (new > old) == (better == "higher") else "WORSE")
    up, down = new > old * (1 + noise), new < old / (1 + noise)
    if not (up or down):
        return "same"
    return "better" if up == (better == "higher") else "WORSE"


def same_machine(a: dict | None, b: dict | None) -> bool:
    keys = ("cpu_model", "cpu_count", "cuda")
    return bool(a and b) and all(a.get(k) == b.get(k) for k in keys)


def _key(row: dict) -> tuple[str, str]:
    return str(row.get("module", "")), str(row.get("name", ""))


def compare(current: dict, baseline: dict) -> list[dict[str, Any]]:
    """One entry per row of this run (and per baseline row of a module that ran but lost it):
    module, name, old/new ratio, change, noise, better, same_machine, verdict."""
    old = {_key(r): r for r in baseline.get("rows", [])}
    modules = baseline.get("modules", {})
    ran = {str(r.get("module", "")) for r in current.get("rows", [])}
    out = []
    for r in current.get("rows", []):
        mod = str(r.get("module", ""))
        b = old.pop(_key(r), None)
        meta = modules.get(mod, {})
        same = same_machine(meta.get("machine", baseline.get("machine")), current.get("machine"))
        better = direction(r if r.get("unit") or b is None else b)  # an error row has no unit
        entry = {"module": mod, "name": r.get("name"), "better": better, "noise": noise_of(r),
                 "same_machine": same, "old": None, "new": r.get("ratio"), "ours_change": None}  # fmt: skip
        if b is None or b.get("ratio") is None:
            entry["verdict"] = "error" if r.get("error") else "new"
        elif r.get("error") or r.get("ratio") is None:
            reason = str(r.get("error", "no ratio"))
            flag = "unavailable" if reason.startswith("unavailable") else "ERROR"
            entry.update(old=b["ratio"], verdict=flag, note=reason[:100])
        else:
            entry["old"] = b["ratio"]
            entry["noise"] = max(entry["noise"], float(b.get("noise") or 0.0))
            entry["verdict"] = verdict(b["ratio"], r["ratio"], better, entry["noise"])
            if same and b.get("ours") and r.get("ours") is not None:
                entry["ours_change"] = r["ours"] / b["ours"] - 1
        out.append(entry)
    for (mod, name), b in old.items():
        if mod in ran:  # a row its module no longer reports
            out.append({"module": mod, "name": name, "better": direction(b), "noise": noise_of(b),
                        "same_machine": None, "old": b.get("ratio"), "new": None, "ours_change": None,
                        "verdict": "gone"})  # fmt: skip
    return out


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3e}" if v and (abs(v) >= 1e5 or abs(v) < 1e-3) else f"{v:.4g}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.0f}%"


def format_comparison(entries: list[dict], current: dict, baseline: dict) -> str:
    """The header (baseline's commit, date, machine; same machine or not) and one line per row."""
    bm, cm = baseline.get("machine") or {}, current.get("machine") or {}
    lines = [
        f"against bench/baseline.json: commit {baseline.get('commit', '?')}, {baseline.get('date', '?')}, "
        f"{bm.get('cpu_model', '?')} x{bm.get('cpu_count', '?')}"
    ]
    if not same_machine(bm, cm):
        lines.append(
            f"DIFFERENT MACHINE: this run on {cm.get('cpu_model', '?')} x{cm.get('cpu_count', '?')}; "
            "ratios compared only (each is ours / a baseline of the same run), absolute numbers not"
        )
    cells = [["verdict", "name", "base ratio", "ratio", "change", "noise", "better", "ours", "note"]]
    order = ["WORSE", "ERROR", "gone", "unavailable", "better", "new", "error", "same", "info"]
    for e in sorted(entries, key=lambda e: order.index(e["verdict"]) if e["verdict"] in order else 99):
        change = e["new"] / e["old"] - 1 if e["old"] and e["new"] is not None else None
        cells.append([e["verdict"], str(e["name"]), _num(e["old"]), _num(e["new"]), _pct(change),
                      f"{e['noise'] * 100:.0f}%", e["better"], _pct(e["ours_change"]), e.get("note", "")])  # fmt: skip
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    for k, c in enumerate(cells):
        just = [v.ljust(w) if i in (0, 1, 8) else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))]
        lines.append("  ".join(just).rstrip())
        if k == 0:
            lines.append("-" * len(lines[-1]))
    worse = [e for e in entries if e["verdict"] in ("WORSE", "ERROR", "gone")]
    lines.append(
        f"{len(worse)} row(s) moved the wrong way beyond their noise, failed or went missing"
        if worse
        else "no row moved the wrong way beyond its noise"
    )
    missing = sum(e["verdict"] == "unavailable" for e in entries)
    if missing:
        lines.append(f"{missing} row(s) unavailable in this run (see their note), compared with nothing")
    return "\n".join(lines)


def load(path: Path = BASELINE) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def git_commit(cwd: Path = BENCH_DIR) -> str:
    """HEAD's short hash, '+dirty' when tracked files have changes; '?' outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + ("+dirty" if dirty else "")


def updated(current: dict, baseline: dict | None, commit: str, now: dt.datetime | None = None) -> dict:
    """The new baseline: this run's rows replace the rows of the modules it ran; others stay."""
    date = (now or dt.datetime.now(dt.UTC)).isoformat(timespec="seconds")
    ran = {str(r.get("module", "")) for r in current.get("rows", [])}
    base = baseline or {}
    keep = [r for r in base.get("rows", []) if str(r.get("module", "")) not in ran]
    rows = keep + [{k: r[k] for k in KEEP if r.get(k) is not None} for r in current.get("rows", [])]
    modules = {m: v for m, v in base.get("modules", {}).items() if m not in ran}
    for m in ran:
        modules[m] = {"machine": current.get("machine"), "commit": commit, "date": date}
    return {"machine": current.get("machine"), "commit": commit, "date": date,
            "modules": dict(sorted(modules.items())), "rows": rows}  # fmt: skip


def write(data: dict, path: Path = BASELINE) -> None:
    """Atomic: temp name, then rename."""
    tmp = Path(path).with_name(f".{Path(path).name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
