"""No import cycle inside miles_platform, module-level or lazy (scripts/import_cycles.py)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_no_import_cycles():
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_cycles.py")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 module-level + lazy import cycle(s)" in r.stdout


def test_the_engine_never_imports_the_dagster_layer():
    """miles_platform/ imports neither dagster nor the Dagster layer (assets, ops, sensors, resources),
    not even lazily: the quickstart lives in ops/, and the CLI names it by string only."""
    import ast

    layer = {"dagster", "dagster_ray", "assets", "ops", "sensors", "resources", "definitions"}
    bad = []
    for path in sorted((ROOT / "miles_platform").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in layer]
    assert bad == []
