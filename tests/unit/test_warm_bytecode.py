"""scripts/warm_bytecode.py: `make test` compiles the modules its collection imports once, in
parallel, before the xdist workers start (each would compile all of them)."""

import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("warm_bytecode", REPO / "scripts" / "warm_bytecode.py")
wb = importlib.util.module_from_spec(spec)
sys.modules["warm_bytecode"] = wb  # its process pool pickles `_compile` by module name
spec.loader.exec_module(wb)


def _pyc(f: Path) -> Path:
    return Path(importlib.util.cache_from_source(str(f)))


def test_listed_files_resolve_under_the_first_root_that_has_them(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "pkg").mkdir(parents=True)
    (b / "pkg").mkdir(parents=True)
    (a / "pkg" / "m.py").write_text("x = 1\n")
    (b / "pkg" / "m.py").write_text("x = 2\n")
    (b / "pkg" / "n.py").write_text("y = 1\n")
    lines = ["# a comment", "", "pkg/m.py", "pkg/n.py", "pkg/gone.py"]
    assert wb.listed_files(lines, [a, b]) == [str(a / "pkg" / "m.py"), str(b / "pkg" / "n.py")]


def test_warm_compiles_in_parallel_once_and_leaves_fresh_pycs_alone(tmp_path):
    files = []
    for i in range(120):  # over the serial cut-off: the process pool
        f = tmp_path / f"m{i}.py"
        f.write_text(f"def f():\n    return {i}\n")
        files.append(str(f))
    wb.warm(files, jobs=2)
    pycs = [_pyc(Path(f)) for f in files]
    assert all(p.is_file() for p in pycs)
    stamps = [p.stat().st_mtime_ns for p in pycs]
    os.utime(files[0], ns=(0, 0))  # a source whose pyc is stale is compiled again, the rest are not
    wb.warm(files, jobs=2)
    again = [p.stat().st_mtime_ns for p in pycs]
    assert again[1:] == stamps[1:] and again[0] != stamps[0]


def test_the_committed_list_matches_this_environment():
    """Recorded against the pinned dependencies: most of what it lists exists here (a list recorded
    against another set of versions would compile the wrong files), and it holds the heavy imports."""
    lines = [ln for ln in wb.LIST.read_text().splitlines() if ln and not ln.startswith("#")]
    found = wb.listed_files(lines, wb._roots())
    assert len(found) >= 0.9 * len(lines), (len(found), len(lines))
    for must in (
        "torch/__init__.py",
        "transformers/__init__.py",
        "dagster/__init__.py",
        "miles_platform/config/__init__.py",
    ):
        assert must in lines, must
    assert not any(ln.startswith("tests/") for ln in lines)  # pytest rewrites the test modules itself
