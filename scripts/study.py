"""What the learning studies (scripts/*_learning.py) share: a fresh GRPO run per seed from a base
with its held-out greedy pass@1 and reward summary, and writing the results (the studies run from
the repository root as `PYTHONPATH=. python scripts/<study>.py`)."""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

EVAL_PROMPTS = 200


def greedy(hf_dir: str, eval_path: str, prompts: int | None = EVAL_PROMPTS) -> float:
    """Held-out greedy pass@1 of an HF dir (the number every study reports; prompts None: all)."""
    from miles_platform.rollout.evaluate import greedy_pass_at_1

    return greedy_pass_at_1(hf_dir, eval_path, prompts)


def seed_run(cfg, eval_path: str, eval_prompts: int | None = EVAL_PROMPTS) -> tuple[dict[str, Any], Any]:
    """`train(cfg)` in a fresh storage root (never a resume of an earlier invocation): (summary, the
    RunResult). The summary: seed, wall, held-out pass@1, mean reward of the first and last 5 rollouts."""
    from miles_platform.loop import train

    shutil.rmtree(cfg.storage_root, ignore_errors=True)
    t0 = time.time()
    res = train(cfg)
    m = res.metrics
    return {
        "seed": cfg.seed,
        "wall_s": round(time.time() - t0, 1),
        "heldout_pass@1": greedy(res.final_hf_path, eval_path, eval_prompts),
        "reward_first5": sum(x["rollout/raw_reward"] for x in m[:5]) / len(m[:5]),
        "reward_last5": sum(x["rollout/raw_reward"] for x in m[-5:]) / len(m[-5:]),
    }, res


def write_out(out: dict, path: str | None) -> None:
    """Print the study's results and write them to `path` (--out) when given."""
    print(json.dumps(out, indent=1))
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
