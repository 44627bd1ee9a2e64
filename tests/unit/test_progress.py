"""Progress of long commands (miles_platform/progress.py): the shared line (step/total, loss,
elapsed, ETA) and that `sft`, `quantize`, `eval` and `convert` write it to stderr on tiny inputs
(`MILES_PROGRESS=0`: a line per update, so a run of seconds shows every step)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from loop_helpers import warm_python

from miles_platform.errors import ConfigError
from miles_platform.progress import Progress, format_duration

REPO = Path(__file__).resolve().parents[2]
LINE = r"{name}: {unit} (\d+)/{total} \(\d+%\).* \| \d+s elapsed, (ETA \d+s|ETA \?|done)"


def _lines(text: str, name: str, unit: str, total: int | str) -> list[re.Match]:
    pattern = re.compile(LINE.format(name=re.escape(name), unit=unit, total=total))
    return [m for m in map(pattern.search, text.splitlines()) if m]


def test_a_line_per_update_with_loss_elapsed_and_eta(monkeypatch):
    monkeypatch.setenv("MILES_PROGRESS", "0")
    out = io.StringIO()
    with Progress("sft", 4, stream=out) as p:
        for step in range(4):
            p.update(loss=1.0 / (step + 1), lr=2e-4)
    lines = out.getvalue().splitlines()
    assert len(lines) == 5, lines  # 4 steps + done
    assert lines[0].startswith("sft: step 1/4 (25%) loss 1.0000 lr 2.00e-04 | 0s elapsed, ETA 0s")
    assert lines[-1].startswith("sft: step 4/4 (100%) loss 0.2500") and lines[-1].endswith("done")


def test_the_heartbeat_writes_while_a_step_runs_and_off_writes_nothing(monkeypatch):
    monkeypatch.setenv("MILES_PROGRESS", "0.05")
    out = io.StringIO()
    with Progress("convert", 3, stream=out) as p:
        p.update(stage="save torch_dist")
        time.sleep(0.3)  # one long phase: the heartbeat still reports
    beats = out.getvalue().splitlines()
    assert len(beats) >= 3 and "convert: step 1/3 (33%) save torch_dist |" in beats[0], beats
    assert "ETA" in beats[0] and beats[-1].endswith("done")
    monkeypatch.setenv("MILES_PROGRESS", "off")
    out = io.StringIO()
    with Progress("convert", 3, stream=out) as p:
        p.update()
    assert out.getvalue() == ""
    monkeypatch.setenv("MILES_PROGRESS", "often")
    with pytest.raises(ConfigError, match="MILES_PROGRESS='often'.*'off'"):
        Progress("x", 1)


def test_durations_read_as_a_person_writes_them():
    assert [format_duration(s) for s in (0.4, 42, 98, 3725)] == ["0s", "42s", "1m38s", "1h02m"]


# ---------------------------------------------------------------- the commands
def test_sft_reports_steps_loss_and_eta(tiny_hf_checkpoint, tmp_path, monkeypatch, capsys):
    from miles_platform.training.sft import cli_main

    monkeypatch.setenv("MILES_PROGRESS", "0")
    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{a}+2=", "response": str(a + 2)}) + "\n" for a in range(8))
    )
    argv = ["--hf-checkpoint", tiny_hf_checkpoint, "--prompt-data", str(data), "--save", str(tmp_path / "out"),
            "--train-iters", "3", "--global-batch-size", "4", "--micro-batch-size", "4", "--lr-warmup-iters", "0"]  # fmt: skip
    assert cli_main(argv) == 0
    lines = _lines(capsys.readouterr().err, "sft", "step", 3)
    assert [m.group(1) for m in lines] == ["1", "2", "3", "3"]
    assert all(" loss " in m.string for m in lines) and "ETA" in lines[0].string


def test_quantize_reports_tensors(tiny_hf_checkpoint, tmp_path, monkeypatch, capsys):
    from safetensors import safe_open

    from miles_platform.weights.quantize import cli_main

    monkeypatch.setenv("MILES_PROGRESS", "0")
    with safe_open(str(Path(tiny_hf_checkpoint) / "model.safetensors"), "pt") as f:
        n = len(list(f.keys()))
    argv = ["--format", "int4", "--hf-checkpoint", tiny_hf_checkpoint, "--save", str(tmp_path / "q"), "--group-size", "32"]  # fmt: skip
    assert cli_main(argv) == 0
    lines = _lines(capsys.readouterr().err, "quantize", "tensor", n)
    assert [int(m.group(1)) for m in lines] == [*range(1, n + 1), n, n]  # + writing, done
    assert "writing model.safetensors" in lines[-2].string


def test_eval_reports_responses(tiny_hf_checkpoint, tmp_path, monkeypatch, capsys):
    from miles_platform.rollout.evaluate import cli_main

    monkeypatch.setenv("MILES_PROGRESS", "0")
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "label": str(a + 1)}) + "\n" for a in range(3)))
    argv = ["--hf-checkpoint", tiny_hf_checkpoint, "--eval-prompt-data", "add", str(data),
            "--n-samples-per-eval-prompt", "2", "--eval-max-response-len", "2", "--json"]  # fmt: skip
    assert cli_main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["add"]["num_prompts"] == 3  # stdout stays the JSON alone
    lines = _lines(captured.err, "eval", "response", 9)  # 3 greedy + 3 x 2 sampled, one at a time
    assert [int(m.group(1)) for m in lines] == [*range(10), 9]
    assert "eval: response 0/9 (0%) add |" in lines[0].string


def test_convert_reports_its_phases(tiny_hf_checkpoint, tmp_path):
    env = dict(os.environ, MILES_PROGRESS="0", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    argv = [*warm_python(), "-m", "miles_platform.cli", "convert", "hf-to-torch-dist",
            "--hf-checkpoint", tiny_hf_checkpoint, "--save", str(tmp_path / "td")]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = _lines(proc.stderr, "convert hf-to-torch-dist", "step", r"\d+")
    assert len(lines) >= 3 and lines[-1].string.endswith("done"), proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["tensors"] > 0
