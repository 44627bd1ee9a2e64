"""Learning of the demo's GRPO phase, strictly on-policy (`train`) vs Miles' one-step overlap
(`train-async`: rollout k+1 generates while rollout k trains, so it comes from v(k-1)), issue 52.

The demo's SFT base (its task data, `default_sft_recipe()`), then per seed
one run of each mode with the demo's recipe `DEMO_RL` (100 rollouts x 16 prompts x 8 samples), one
after the other (sync first). Reports held-out greedy pass@1 of the base and of each final policy
(all 500 eval prompts), the mean raw reward per 10 rollouts, the median seconds per step and the
run's wall (process-internal: `train` call to return).

    PYTHONPATH=. nice -n 5 python scripts/overlap_learning.py --seeds 3 --out /tmp/overlap.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from scripts.study import greedy, seed_run, write_out

MODES = {"sync": {}, "overlap": {"train_async": True}}


def build_base(work: str, seed: int | None, threads: int | None) -> tuple[dict, str]:
    """The demo's task data and SFT base (made once per work dir)."""
    import dataclasses

    from miles_platform.data.tasks import write_task_datasets
    from miles_platform.training.sft import default_sft_recipe, run_sft

    task = write_task_datasets(os.path.join(work, "task"), seed=0)
    base = os.path.join(work, "base")
    if not os.path.exists(os.path.join(base, "config.json")):
        recipe = dataclasses.replace(default_sft_recipe(), num_threads=threads)
        if seed is not None:
            recipe = dataclasses.replace(recipe, seed=seed)
        run_sft(task["sft"], base, recipe=recipe, progress=False)
    return task, base


def one_run(task: dict, base: str, root: str, seed: int, rollouts: int, mode: str) -> dict:
    from miles_platform.config import RunConfig
    from miles_platform.recipes import DEMO_RL

    cfg = RunConfig(**{**DEMO_RL, "eval_interval": None, "save_interval": None, **MODES[mode]},
                    hf_checkpoint=base, prompt_data=task["train"], num_rollout=rollouts, seed=seed,
                    rollout_seed=seed, storage_root=root).validate()  # fmt: skip
    r, res = seed_run(cfg, task["eval"], eval_prompts=None)  # the whole held-out split
    m = res.metrics
    rewards = [x["rollout/raw_reward"] for x in m]
    return {
        "mode": mode,
        **r,
        "median_step_s": round(statistics.median(x["perf/rollout_total_time"] for x in m[1:]), 4),
        "median_wait_s": round(statistics.median(x.get("perf/rollout_wait_time", 0.0) for x in m[1:]), 4),
        "reward_per_10": [
            round(sum(rewards[i : i + 10]) / len(rewards[i : i + 10]), 4) for i in range(0, len(m), 10)
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--rollouts", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--sft-seed", type=int, default=None, help="the SFT seed (default: the demo base's)")
    ap.add_argument(
        "--sft-threads",
        type=int,
        default=1,
        help="SFT torch threads (the demo: the process's, "
        "2 here; on a busy 2-core box 2 threads ran 3 s per step against 0.06 quiet)",
    )
    ap.add_argument("--work", default=None, help="work dir; its data and SFT base are reused when there")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="overlap-learning-")
    task, base = build_base(work, args.sft_seed, args.sft_threads)
    out = {"base_heldout_pass@1": greedy(base, task["eval"], None), "rollouts": args.rollouts, "runs": []}
    print(json.dumps(out), flush=True)
    for seed in range(1, args.seeds + 1):
        for mode in MODES:
            r = one_run(task, base, os.path.join(work, f"root-{mode}-{seed}"), seed, args.rollouts, mode)
            print(json.dumps(r), flush=True)
            out["runs"].append(r)
    for mode in MODES:
        runs = [r for r in out["runs"] if r["mode"] == mode]
        acc = [r["heldout_pass@1"] for r in runs]
        out[mode] = {
            "heldout_pass@1_mean": statistics.mean(acc),
            "heldout_pass@1_sd": statistics.stdev(acc) if len(acc) > 1 else 0.0,
            "median_step_s_mean": statistics.mean(r["median_step_s"] for r in runs),
            "wall_s_mean": statistics.mean(r["wall_s"] for r in runs),
            "reward_per_10_mean": [
                round(statistics.mean(v), 4) for v in zip(*(r["reward_per_10"] for r in runs))
            ],
        }
    write_out(out, args.out)


if __name__ == "__main__":
    main()
