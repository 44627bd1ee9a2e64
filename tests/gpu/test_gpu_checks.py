"""scripts/gpu_checks.py, the runner of the GPU checks: on any machine (no gpu marker) it runs the
chosen tests/gpu checks through pytest and writes gpu_checks.json with each test's status and the
numbers it recorded; on the CPU the report says so (`"cuda": false`, `ran_on_cuda` false)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_checks.py"


def test_runner_writes_status_and_recorded_values_per_test(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--work", str(tmp_path / "work"), "--only", "xor_bytes,unaligned", "--jobs", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    report = json.loads((out / "gpu_checks.json").read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + (out / "gpu_checks.log").read_text()[-3000:]
    checks = report["checks"]
    assert sorted(checks) == [
        "tests/gpu/test_kernels_gpu.py::test_unaligned_changed_positions_match_reference",
        "tests/gpu/test_kernels_gpu.py::test_xor_bytes_match_reference_and_apply_recovers_new",
    ]
    assert report["all_judged_pass"] and set(report["summary"].values()) == {"pass"}
    xor = checks["tests/gpu/test_kernels_gpu.py::test_xor_bytes_match_reference_and_apply_recovers_new"]
    assert xor["nonzero_bytes"] == xor["nonzero_bytes_cpu"] > 0  # the numbers the test measured
    assert report["cuda"] == torch.cuda.is_available() == xor["ran_on_cuda"]
    assert report["env"]["torch"] == torch.__version__ and "finished" in report
