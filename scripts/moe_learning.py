"""Learning on the tiny Qwen3-MoE with Rollout Routing Replay (issue 23's MoE learning check).

The demo task and recipe, on an MoE model instead of the dense tiny Qwen3: a random tiny
`Qwen3MoeForCausalLM` (4 experts, top-2, every layer sparse; the demo's tokenizer and dims) is
SFT'd with the demo recipe on the same data (where 65% of carry cases drop the carry), then GRPO
with `--use-rollout-routing-replay` (`DEMO_RL`). Reports held-out greedy pass@1 of the base and of
the final policy per seed, the route flips and expert load balance the trainer saw.

    PYTHONPATH=. python scripts/moe_learning.py --seeds 1 --rollouts 40 --out /tmp/moe.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from scripts.study import greedy, seed_run, write_out


def build_base(work: str) -> tuple[dict, str, dict]:
    """Task data, and the SFT'd tiny MoE (made once per work dir)."""
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
        tok = TASK_TOKENIZERS["arithmetic"]()
        init = os.path.join(work, "init")
        cfg = tiny_config(
            "qwen3_moe", len(tok), **{k: v for k, v in recipe.model.items() if k != "intermediate_size"}
        )
        save_hf_checkpoint(build_model(cfg, seed=recipe.seed), tok, init)
        t0 = time.time()
        sft = run_sft(task["sft"], base, hf_checkpoint=init, recipe=recipe, progress=False)
        info = {
            "sft_s": time.time() - t0,
            "sft_final_loss": sft["final_loss"],
            "params": sft["num_parameters"],
        }
    return task, base, info


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--rollouts", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--work", default=None, help="work dir; its data and SFT base are reused when there")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from miles_platform.config import RunConfig
    from miles_platform.recipes import DEMO_RL

    work = args.work or tempfile.mkdtemp(prefix="moe-learning-")
    task, base, info = build_base(work)
    out = {"base_heldout_pass@1": greedy(base, task["eval"]), "rollouts": args.rollouts, **info, "runs": []}
    print(json.dumps(out), flush=True)
    for seed in range(1, args.seeds + 1):
        cfg = RunConfig(**{**DEMO_RL, "save_interval": None, "eval_interval": None, "lr": args.lr},
                        hf_checkpoint=base, prompt_data=task["train"], num_rollout=args.rollouts, seed=seed,
                        rollout_seed=seed, storage_root=os.path.join(work, f"root-{seed}"),
                        use_rollout_routing_replay=True, num_cpus_per_actor=0.5).validate()  # fmt: skip
        r, res = seed_run(cfg, task["eval"])
        m = res.metrics
        r.update(
            route_flips_total=sum(x.get("train/moe_route_flips", 0.0) for x in m),
            load_balance_first=m[0].get("train/moe_load_balance"),
            load_balance_last=m[-1].get("train/moe_load_balance"),
            logprob_abs_diff_step0=res.ci_checks.get("train_rollout_logprob_abs_diff"),
        )
        r["gain"] = r["heldout_pass@1"] - out["base_heldout_pass@1"]
        print(json.dumps(r), flush=True)
        out["runs"].append(r)
    out["mean_gain"] = sum(r["gain"] for r in out["runs"]) / len(out["runs"])
    write_out(out, args.out)


if __name__ == "__main__":
    main()
