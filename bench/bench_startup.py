"""Start-up: `miles-platform train` invocation -> the first rollout's generation, vs a bare load.

Ours: `python -m miles_platform.cli train --config run.yaml` with the quickstart's recipe
(`DEMO_RL`, one rollout) on the demo-sized tiny Qwen3 (random weights: start-up does not depend on
them) and the arithmetic prompts; its `[startup]` log line (miles_platform/startup.py) gives the
seconds from the process start to the first rollout's generation, by phase. Baseline: a bare
`python -c 'import torch, transformers; tokenizer + model from_pretrained'` of the same checkpoint,
timed the same way (process start -> model loaded). Each is run RUNS times in a fresh process;
medians, and the spread as the row's noise. The phase rows are medians as shares of our median
(no direction: where the time goes, docs/BENCHMARKS.md "Start-up").
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, error_row, main, project_env, row

RUNS = 3
ROW = "startup: train invocation -> first rollout generation vs bare torch+transformers model load"

# the baseline: what any Python trainer pays before its first generate (process age from /proc, as ours)
BARE = """
import os, sys, time
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
AutoTokenizer.from_pretrained(sys.argv[1]); AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
start = int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19]) / os.sysconf('SC_CLK_TCK')
print(f'[bare] {time.clock_gettime(time.CLOCK_BOOTTIME) - start:.3f}')
"""


def _setup(d: str) -> Path:
    """The demo-sized checkpoint, the task's prompts and a one-rollout DEMO_RL config."""
    import yaml

    from miles_platform.data.tasks import write_task_datasets
    from miles_platform.models.checkpoint import save_hf_checkpoint
    from miles_platform.models.qwen3 import build_model, tiny_qwen3_config
    from miles_platform.models.tokenizer import build_task_tokenizer
    from miles_platform.recipes import DEMO_RL
    from miles_platform.training.sft import default_sft_recipe

    tok = build_task_tokenizer()
    save_hf_checkpoint(
        build_model(tiny_qwen3_config(len(tok), **default_sft_recipe().model)), tok, f"{d}/base"
    )
    data = write_task_datasets(f"{d}/task")
    # random weights sample at ~5.5 nats per token: over --ci-test's entropy bound, which is not timed here
    cfg = dict(DEMO_RL, run_name="startup", hf_checkpoint=f"{d}/base", prompt_data=data["train"],
               num_rollout=1, ci_entropy_max=20.0)  # fmt: skip
    path = Path(d, "run.yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def ours_once(config: Path, storage: str) -> dict[str, float]:
    """One `train` in a fresh process: {phase: seconds, "total": seconds} from its `[startup]` line."""
    cmd = [
        sys.executable,
        "-m",
        "miles_platform.cli",
        "train",
        "--config",
        str(config),
        "--storage-root",
        storage,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=project_env(), capture_output=True, text=True, timeout=600)
    line = next((x for x in (proc.stdout + proc.stderr).splitlines() if x.startswith("[startup]")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"train exit {proc.returncode}: {tail[:200]}")
    return parse_startup_line(line)


def parse_startup_line(line: str) -> dict[str, float]:
    total = re.search(r"\[startup\] ([0-9.]+) s", line)
    phases = dict(re.findall(r"(\w+) ([0-9.]+)", line.split(":", 1)[1]))
    return {**{k: float(v) for k, v in phases.items()}, "total": float(total.group(1))}


def bare_once(base: str) -> float:
    proc = subprocess.run([sys.executable, "-c", BARE, base], env=project_env(), capture_output=True, text=True,
                          timeout=300, check=True)  # fmt: skip
    return float(proc.stdout.strip().splitlines()[-1].split()[1])


def run() -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as d:
        config = _setup(d)
        try:
            ours = [ours_once(config, f"{d}/root{i}") for i in range(RUNS)]
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            return [error_row(ROW, str(e)[:240])]
        bare = [bare_once(f"{d}/base") for _ in range(RUNS)]
    med = statistics.median
    totals = [o["total"] for o in ours]
    noise = sum((max(s) - min(s)) / med(s) for s in (totals, bare))
    unit = f"s (ratio: ours / bare, lower is better; medians of {RUNS} fresh processes)"
    rows = [row(ROW, med(totals), med(bare), unit, better="lower", noise=noise,
                ours_runs_s=totals, bare_runs_s=bare)]  # fmt: skip
    for phase in [k for k in ours[0] if k != "total"]:
        rows.append(row(f"startup: {phase}", med(o.get(phase, 0.0) for o in ours), med(totals),
                        "s (ratio: share of our start-up; medians)", better="none"))  # fmt: skip
    return rows


if __name__ == "__main__":
    main(run)
