"""scripts/gpu_checks.py on a CUDA machine: every judged check passes (gpu marker: skipped on CPU,
deselected by `make test`). Needs megatron-core importable; transformer-engine is optional."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_checks.py"


@pytest.mark.gpu
def test_gpu_checks_report_passes(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--work", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads((out / "gpu_checks.json").read_text())
    checks = report["checks"]
    assert report["cuda"], "the report was not made on a CUDA machine"
    failed = {
        k: v.get("failures") or v.get("error") or v
        for k, v in checks.items()
        if v.get("status") not in ("pass", "skipped", "info")
    }
    assert not failed, json.dumps(failed, indent=1, default=str)[-6000:] + proc.stdout[-2000:]
    for name in (
        "megatron_local_spec",
        "megatron_test_run",
        "engine_logprobs_vs_device_forward",
        "kernels_fp8",
        "kernels_int4",
        "kernels_logprob",
        "kernels_xor_delta",
        "fsdp_plain_step",
        "fsdp2_fp32_step",
        "fsdp2_backend_bf16_rules",
    ):
        assert checks[name]["status"] == "pass" and checks[name]["ran_on_cuda"], name
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
