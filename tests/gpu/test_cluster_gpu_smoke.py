"""scripts/gpu_smoke.sh: its flags are valid Miles flags for `miles-platform train` (CPU), and on a
CUDA machine the script itself runs (gpu marker: skipped on CPU)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from miles_platform.config import parse_run_config

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_smoke.sh"


def _train_argv() -> list[str]:
    text = SCRIPT.read_text()
    block = text[text.index("miles_platform.cli train") : text.index('"$@"')]
    block = block.replace("\\\n", " ").replace("miles_platform.cli train", "")
    return [t for t in shlex.split(block) if not t.startswith('"$') and "$" not in t]


def test_smoke_flags_parse_as_run_config():
    argv = _train_argv()
    filled = []
    for tok in argv:
        filled.append(tok)
        if tok in ("--hf-checkpoint", "--prompt-data", "--storage-root"):
            filled.append("/tmp/x")
    cfg = parse_run_config(filled)
    assert cfg.train_backend == "megatron" and cfg.rollout_engine == "sglang"
    assert cfg.update_weight_transfer_mode == "disk" and cfg.ci_test and cfg.num_rollout == 3
    assert cfg.ci_disable_weight_update_checker  # Qwen3 on SGLang has no get_weights_by_name
    assert cfg.input_key == "prompt" and cfg.label_key == "label"  # the rows `make-data` writes
    assert cfg.sglang_args == {"mem-fraction-static": "0.4"}


@pytest.mark.gpu
def test_gpu_smoke_script_runs():
    model = os.environ.get("MODEL")
    if not model:
        pytest.skip("set MODEL to an HF checkpoint dir to run scripts/gpu_smoke.sh")
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "perf/" in out.stdout and "gpu_smoke: OK" in out.stdout
