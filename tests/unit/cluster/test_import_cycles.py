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
