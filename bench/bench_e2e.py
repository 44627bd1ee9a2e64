"""End to end: seconds per rollout of the quickstart's GRPO recipe, split by phase.

`miles_platform.loop.train` runs DEMO_RL (16 prompts x 8 samples, 8-token responses, one
optimizer step per rollout, --ci-test checks on) on Ray with the embedded engine, over the
arithmetic prompts and a random tiny Qwen3 of the quickstart's shape (no SFT: timing only).
Per-rollout metrics come from RunResult.metrics; the first rollout is warm-up and is dropped.
Each row is one phase: ours = its mean seconds per rollout, baseline = the mean total seconds
per rollout, ratio = the phase's share. "other" is the remainder (shard write, HF export,
weight-equality check, checkpoint save, metrics table).
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np

from bench.bench_train import make_checkpoint
from bench.common import main, row

ROLLOUTS = 4  # 1 warm-up + 3 measured
PHASES = ("perf/rollout_time", "perf/actor_train_time", "perf/update_weights_time")


def write_prompts(path: str, n: int = 512) -> str:
    from miles_platform.data.tasks import all_problems, prompt_row

    with open(path, "w") as f:
        for p in all_problems("add2")[:: max(1, 8100 // n)][:n]:
            f.write(json.dumps(prompt_row(p, "add2")) + "\n")
    return path


def run(rollouts: int = ROLLOUTS) -> list[dict]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from miles_platform.config import RunConfig
    from miles_platform.loop import train
    from miles_platform.quickstart import DEMO_RL

    with tempfile.TemporaryDirectory(prefix="bench_e2e_") as d:
        ckpt = make_checkpoint(os.path.join(d, "hf"))
        cfg = RunConfig(
            **dict(DEMO_RL, run_name="bench_e2e"),
            hf_checkpoint=ckpt,
            prompt_data=write_prompts(os.path.join(d, "prompts.jsonl")),
            num_rollout=rollouts,
            storage_root=os.path.join(d, "root"),
        ).validate()
        res = train(cfg)
    measured = res.metrics[1:] or res.metrics
    total = float(np.mean([m["perf/rollout_total_time"] for m in measured]))
    unit = f"s/rollout (ratio: share of total; mean of {len(measured)} rollouts after 1 warm-up)"
    rows, covered = [], 0.0
    for key in PHASES:
        s = float(np.mean([m.get(key, 0.0) for m in measured]))
        covered += s
        rows.append(row(f"e2e: {key}", s, total, unit))
    rows.append(row("e2e: other (shard, export, checks, save)", max(total - covered, 0.0), total, unit))
    return rows


if __name__ == "__main__":
    main(run)
