"""RL teaches the tiny model to call a calculator (issue #20, docs/rollout.md "Worked example").

    python scripts/tool_learning.py --root /tmp/tool-bench --seeds 1 2 3
    python scripts/tool_learning.py --root /tmp/tool-bench --base DIR --seeds 1
    python scripts/tool_learning.py --root /tmp/tool-bench --seeds 1 --advantage-estimator ppo

Without --base it writes the `mul3` task under <root>/data (`miles-platform make-data --difficulty
mul3`) and SFTs the base on its transcripts (<root>/base: about 30% of the episodes call the tool and
copy its answer, the rest guess). Then, per seed, one `train` run with the multi-turn generator and
the calculator, GRPO as the demo (16 prompts x 8 samples, T=1, token-mean loss, no KL), reward
`--rm-type final_answer`, and the in-loop eval of the held-out set through the same generator
(greedy): v0 before training, then every --eval-every versions. Wall time counts from the call to
`train` (Ray, engines and the evals included). The reported result is the last eval made within
--budget-s. One JSON line per seed and a summary line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_platform.config import RunConfig  # noqa: E402
from miles_platform.loop import train  # noqa: E402
from miles_platform.recipes import DEMO_RL  # noqa: E402
from miles_platform.run_types import Reporter  # noqa: E402

TOOL_FLAGS = dict(
    custom_generate_function_path="miles_platform.rollout.generate_hub.multi_turn.generate",
    generate_tool_specs_path="miles_platform.data.tool_use.TOOL_SPECS",
    generate_tool_call_parser="qwen25",
    generate_execute_tool_function_path="miles_platform.data.tool_use.execute_tool",
    generate_max_turns=2,  # call, then answer
    rm_type="final_answer",
    rollout_max_response_len=64,  # a tool episode is 44 tokens (call 25, tool answer 13, answer 6)
    rollout_max_concurrency=256,  # episodes in flight: a whole rollout (128), the eval in two waves
)
EVAL = "tool_use"


class Clock(Reporter):
    """Seconds since the run started of each in-loop eval (rollout metrics carrying eval/...)."""

    def __init__(self):
        self.t0, self.evals = time.time(), []

    def log(self, msg: str) -> None:
        if msg.startswith("eval v"):
            print(f"  [{time.time() - self.t0:6.1f}s] {msg}", flush=True)

    def on_rollout(self, rollout_id: int, metrics: dict[str, float]) -> None:
        if f"eval/{EVAL}/pass@1" in metrics:
            self.evals.append((rollout_id + 1, time.time() - self.t0, metrics))


def task_and_base(a) -> None:
    """<root>/data and <root>/base, made when absent."""
    data = os.path.join(a.root, "data")
    if not os.path.exists(os.path.join(data, "sft.jsonl")):
        from miles_platform.data.tasks import write_tool_datasets

        write_tool_datasets(data, seed=0)
    a.prompt_data, a.eval_data = a.prompt_data or f"{data}/train.jsonl", a.eval_data or f"{data}/eval.jsonl"
    if a.base:
        return
    a.base = os.path.join(a.root, "base")
    if not os.path.exists(os.path.join(a.base, "config.json")):
        from miles_platform.training.sft import default_sft_recipe, run_sft

        recipe = default_sft_recipe()
        recipe.train_iters, recipe.lr_warmup_iters = a.sft_iters, 30
        m = run_sft(f"{data}/sft.jsonl", a.base, recipe=recipe, tokenizer="tool_use")
        print(json.dumps({"sft_seconds": round(m["sft_seconds"], 1), "final_loss": m["final_loss"],
                          "train_iters": m["train_iters"], "base": a.base}), flush=True)  # fmt: skip


def rl_run(a, seed: int, work: str) -> dict:
    kw = {**DEMO_RL, **TOOL_FLAGS, "ci_test": False, "save_interval": None, "skip_eval_before_train": False}
    kw.update(run_name=f"tool-s{seed}", seed=seed, rollout_seed=seed, num_rollout=a.num_rollout, lr=a.lr,
              hf_checkpoint=a.base, prompt_data=a.prompt_data, eval_prompt_data=[EVAL, a.eval_data],
              eval_interval=a.eval_every, eval_temperature=0.0, storage_root=os.path.join(work, f"s{seed}"),
              advantage_estimator=a.advantage_estimator, critic_lr=a.critic_lr)  # fmt: skip
    cfg = RunConfig(**kw).validate()
    clock = Clock()
    res = train(cfg, clock)
    wall = time.time() - clock.t0

    def point(version: int, t: float, m: dict) -> dict:
        return {"version": version, "seconds": round(t, 1), "success": m[f"eval/{EVAL}/pass@1"],
                "tool_call_share": m.get(f"eval/{EVAL}/tool_call_share")}  # fmt: skip

    base = point(0, 0.0, res.eval_before_train)
    curve = [point(v, t, m) for v, t, m in clock.evals]
    inside = [p for p in curve if p["seconds"] <= a.budget_s] or [base]
    at = inside[-1]
    train_share = [m.get("multi_turn/tool_calls/mean") for m in res.metrics]
    return {"seed": seed, "wall_s": round(wall, 1), "rollouts": len(res.metrics), "base": base, "at_budget": at,
            "lift_points": round(100 * (at["success"] - base["success"]), 1), "curve": curve,
            "train_tool_calls_first_last": [train_share[0], train_share[-1]]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/tool-bench", help="data, base and runs go here")
    ap.add_argument("--base", help="the SFT base HF dir (made under --root when unset)")
    ap.add_argument("--prompt-data", help="RL prompts (default <root>/data/train.jsonl)")
    ap.add_argument("--eval-data", help="held-out prompts (default <root>/data/eval.jsonl)")
    ap.add_argument("--sft-iters", type=int, default=400, help="SFT of the base (when --base is unset)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--num-rollout", type=int, default=60)
    ap.add_argument("--lr", type=float, default=DEMO_RL["lr"])
    ap.add_argument("--budget-s", type=float, default=600.0, help="wall-clock budget of one RL run")
    ap.add_argument("--eval-every", type=int, default=10, help="in-loop eval every N versions")
    ap.add_argument(
        "--advantage-estimator",
        default="grpo",
        choices=("grpo", "ppo"),
        help="ppo: GAE on a critic over the model's tokens only (tool answers are masked)",
    )
    ap.add_argument("--critic-lr", type=float, help="ppo: the critic's LR (default --lr)")
    a = ap.parse_args(argv)
    task_and_base(a)
    work = os.path.join(a.root, f"runs-{int(time.time())}")
    results = []
    for seed in a.seeds:
        r = rl_run(a, seed, work)
        results.append(r)
        print(json.dumps(r), flush=True)
    summary = {
        "seeds": a.seeds,
        "base_success": [r["base"]["success"] for r in results],
        "success_at_budget": [r["at_budget"]["success"] for r in results],
        "lift_points": [r["lift_points"] for r in results],
        "tool_call_share_base_to_budget": [
            [r["base"]["tool_call_share"], r["at_budget"]["tool_call_share"]] for r in results
        ],
        "seconds_at_budget": [r["at_budget"]["seconds"] for r in results],
        "wall_s": [r["wall_s"] for r in results],
        "budget_s": a.budget_s,
    }
    print(json.dumps({"summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
