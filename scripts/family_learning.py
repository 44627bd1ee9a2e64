"""Learning on a tiny model of one family with the demo's carry-drop recipe (issue 53's learning check).

The demo task and recipe on a random tiny model of `--family` (the demo's tokenizer and dims:
hidden 128, intermediate 384, 2 layers; `tiny_config`'s family extras, e.g. Qwen3.5's gated-DeltaNet
layer then gated full attention), SFT'd with the demo recipe on the same data (where 65% of carry
cases drop the carry), then `DEMO_RL` GRPO per seed. Reports held-out greedy pass@1 of the base and
of the final policy per seed, the gain, the mean and std over seeds.

    PYTHONPATH=. python scripts/family_learning.py --family qwen3_5 --seeds 3 --rollouts 40 --out /tmp/q35.json
    PYTHONPATH=. python scripts/family_learning.py --family qwen3 --seeds 3 --rollouts 40 --out /tmp/q3.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from scripts.study import greedy, seed_run, write_out


def build_base(
    work: str, family: str, sft_iters: int | None, sft_threads: int | None, sft_seed: int | None = None
) -> tuple[dict, str, dict]:
    """Task data, and the SFT'd tiny model of `family` (made once per work dir)."""
    from miles_platform.data.tasks import write_task_datasets
    from miles_platform.models.checkpoint import save_hf_checkpoint
    from miles_platform.models.families import build_model, tiny_config
    from miles_platform.models.tokenizer import TASK_TOKENIZERS
    from miles_platform.training.sft import default_sft_recipe, run_sft

    task = write_task_datasets(os.path.join(work, "task"), seed=0)
    base = os.path.join(work, "base")
    info: dict = {}
    if not os.path.exists(os.path.join(base, "config.json")):
        recipe = default_sft_recipe()
        if sft_iters:
            recipe.train_iters = sft_iters
        if sft_seed is not None:  # the model's init and the SFT batch order
            recipe.seed = sft_seed
        recipe.num_threads = sft_threads  # 1 on a busy box: 2 contended threads are several x slower
        tok = TASK_TOKENIZERS["arithmetic"]()
        init = os.path.join(work, "init")
        save_hf_checkpoint(
            build_model(tiny_config(family, len(tok), **recipe.model), seed=recipe.seed), tok, init
        )
        t0 = time.time()
        sft = run_sft(task["sft"], base, hf_checkpoint=init, recipe=recipe, progress=False)
        info = {
            "sft_s": time.time() - t0,
            "sft_iters": recipe.train_iters,
            "sft_seed": recipe.seed,
            "sft_s_per_step": (time.time() - t0) / recipe.train_iters,
            "sft_final_loss": sft["final_loss"],
            "params": sft["num_parameters"],
        }
    return task, base, info


def _std(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument(
        "--family", default="qwen3_5", help="a models/families.py name (dense: qwen3, qwen3_5, ...)"
    )
    ap.add_argument("--rollouts", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--sft-iters", type=int, default=None, help="default: the demo recipe's")
    ap.add_argument(
        "--sft-seed", type=int, default=None, help="the base's init and batch order (default: the recipe's)"
    )
    ap.add_argument(
        "--sft-threads", type=int, default=None, help="torch threads of the SFT (default: torch's)"
    )
    ap.add_argument(
        "--no-ci-test",
        action="store_true",
        help="DEMO_RL without --ci-test (its step-0 entropy bound fails a base left on the loss plateau)",
    )
    ap.add_argument("--work", default=None, help="work dir; its data and SFT base are reused when there")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from miles_platform.config import RunConfig
    from miles_platform.recipes import DEMO_RL

    work = args.work or tempfile.mkdtemp(prefix=f"{args.family}-learning-")
    task, base, info = build_base(work, args.family, args.sft_iters, args.sft_threads, args.sft_seed)
    out = {"family": args.family, "base_heldout_pass@1": greedy(base, task["eval"]), "rollouts": args.rollouts,
           **info, "runs": []}  # fmt: skip
    print(json.dumps(out), flush=True)
    for seed in range(1, args.seeds + 1):
        cfg = RunConfig(**{**DEMO_RL, "save_interval": None, "eval_interval": None, "ci_test": not args.no_ci_test},
                        hf_checkpoint=base, prompt_data=task["train"], num_rollout=args.rollouts, seed=seed,
                        rollout_seed=seed, storage_root=os.path.join(work, f"root-{seed}"),
                        num_cpus_per_actor=0.5).validate()  # fmt: skip
        r, res = seed_run(cfg, task["eval"])
        r["logprob_abs_diff_step0"] = res.ci_checks.get("train_rollout_logprob_abs_diff")
        r["gain"] = r["heldout_pass@1"] - out["base_heldout_pass@1"]
        print(json.dumps(r), flush=True)
        out["runs"].append(r)
    after = [r["heldout_pass@1"] for r in out["runs"]]
    gains = [r["gain"] for r in out["runs"]]
    out.update(mean_after=statistics.mean(after), std_after=_std(after),
               mean_gain=statistics.mean(gains), std_gain=_std(gains))  # fmt: skip
    write_out(out, args.out)
    print(f"\n{args.family}: {out.get('params', '?')} params, base {out['base_heldout_pass@1']:.1%}")
    print("| seed | base | after | gain | run wall |")
    for r in out["runs"]:
        print(f"| {r['seed']} | {out['base_heldout_pass@1']:.1%} | {r['heldout_pass@1']:.1%} | "
              f"{100 * r['gain']:+.1f} | {r['wall_s']:.1f} s |")  # fmt: skip
    print(f"| mean +- std | | {out['mean_after']:.1%} +- {out['std_after']:.1%} | "
          f"{100 * out['mean_gain']:+.1f} +- {100 * out['std_gain']:.1f} | |")  # fmt: skip


if __name__ == "__main__":
    main()
