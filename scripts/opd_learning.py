"""Pure on-policy distillation from a much better policy into the demo's SFT base (issue #21, docs/opd.md).

    python scripts/opd_learning.py --root /tmp/opd-bench --seeds 1 2 3
    python scripts/opd_learning.py --base DIR --teacher DIR --prompt-data P --eval-data E --seeds 1

Without --base/--teacher it first runs the demo (`miles-platform quickstart`: SFT base, then GRPO)
under --root and takes its base checkpoint and final policy as student and teacher. Then, per seed,
one `train` run with the demo's recipe, no task reward (`--rm-type` unset: reward 0) and
`--use-opd --opd-type sglang --opd-teacher-hf-checkpoint <teacher>` (the run starts the teacher
engine itself). Wall time counts from the call to `train` (Ray start, engines, teacher included).
Held-out greedy pass@1 (the demo's eval set) of the base, the teacher, and every --eval-every-th
version; the reported OPD result is the last version made within --budget-s. One JSON line per
seed and a summary line at the end.
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
from miles_platform.rollout.evaluate import greedy_pass_at_1  # noqa: E402
from miles_platform.run_types import Reporter  # noqa: E402


class Clock(Reporter):
    """Seconds since the run started at which each policy version was recorded."""

    def __init__(self):
        self.t0, self.times = time.time(), {}

    def on_policy_version(self, pv):
        self.times[pv.version] = (time.time() - self.t0, pv.hf_path)


def greedy(hf_dir: str, eval_data: str, prompts: int | None) -> float:
    return greedy_pass_at_1(hf_dir, eval_data, prompts)


def demo_artifacts(root: str) -> dict[str, str]:
    """Base, teacher and data of a quickstart run under `root` (run it when absent)."""
    summary = Path(root, "quickstart_summary.json")
    if not summary.exists():
        from ops.quickstart import run_quickstart

        run_quickstart(root, num_rollout=100, seed=1234, eval_every=10, sft_iters=None)
    s = json.loads(summary.read_text())
    return {"base": s["base_checkpoint"], "teacher": s["final_checkpoint"], "eval_data": s["eval_dataset"],
            "prompt_data": os.path.join(root, "datasets", "prompt_dataset", "data.parquet")}  # fmt: skip


MODES = ("pure", "grounded", "rl")  # OPD without task reward, OPD + the math reward, GRPO alone


def opd_run(a, seed: int, work: str, mode: str = "pure") -> dict:
    kw = {**DEMO_RL, "ci_test": False, "save_interval": None, "eval_interval": None}
    kw.update(run_name=f"{mode}-s{seed}", seed=seed, rollout_seed=seed, num_rollout=a.num_rollout,
              hf_checkpoint=a.base, prompt_data=a.prompt_data, storage_root=os.path.join(work, f"{mode}-s{seed}"))  # fmt: skip
    if mode != "rl":
        kw.update(
            use_opd=True, opd_type="sglang", opd_kl_coef=a.opd_kl_coef, opd_teacher_hf_checkpoint=a.teacher
        )
    if mode == "pure":
        kw["rm_type"] = None
    cfg = RunConfig(**kw).validate()
    clock = Clock()
    res = train(cfg, clock)
    wall = time.time() - clock.t0
    inside = [v for v, (t, _) in clock.times.items() if t <= a.budget_s]
    curve = {}
    for v in sorted(clock.times):
        if v % a.eval_every == 0 or v == max(inside, default=None) or v == max(clock.times):
            t, path = clock.times[v]
            curve[v] = {"seconds": round(t, 1), "pass@1": greedy(path, a.eval_data, a.eval_prompts)}
    at_budget = curve[max(inside)]["pass@1"] if inside else None
    kls = [m.get("opd/reverse_kl") for m in res.metrics]
    return {"mode": mode, "seed": seed, "wall_s": round(wall, 1), "versions": len(clock.times),
            "versions_within_budget": len(inside), "pass@1_at_budget": at_budget, "curve": curve,
            "opd/reverse_kl_first_last": [kls[0], kls[-1]]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/opd-bench", help="quickstart root (made when --base is unset)")
    ap.add_argument("--base", help="student: the SFT base HF dir")
    ap.add_argument("--teacher", help="teacher: a much better policy's HF dir (the demo's final policy)")
    ap.add_argument("--prompt-data", help="training prompts (the demo's prompt_dataset Parquet)")
    ap.add_argument("--eval-data", help="held-out eval set (the demo's eval_dataset Parquet)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--num-rollout", type=int, default=120)
    ap.add_argument("--budget-s", type=float, default=300.0, help="wall-clock budget of one OPD run")
    ap.add_argument("--opd-kl-coef", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=20, help="evaluate every N-th version")
    ap.add_argument("--eval-prompts", type=int, default=500)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=["pure"],
                    help="pure OPD (the issue's measurement); grounded OPD and GRPO alone for the comparison")  # fmt: skip
    a = ap.parse_args(argv)
    if not a.base:
        for k, v in demo_artifacts(a.root).items():
            setattr(a, k, getattr(a, k) or v)
    work = os.path.join(a.root, f"opd-runs-{int(time.time())}")
    base, teacher = (
        greedy(a.base, a.eval_data, a.eval_prompts),
        greedy(a.teacher, a.eval_data, a.eval_prompts),
    )
    print(json.dumps({"base_pass@1": base, "teacher_pass@1": teacher, "base": a.base, "teacher": a.teacher}),
          flush=True)  # fmt: skip
    results = []
    for mode in a.modes:
        for seed in a.seeds:
            r = opd_run(a, seed, work, mode)
            at = r["pass@1_at_budget"]
            r["lift_points"] = None if at is None else round(100 * (at - base), 1)
            results.append(r)
            print(json.dumps(r), flush=True)
    lifts = {m: [r["lift_points"] for r in results if r["mode"] == m] for m in a.modes}
    print(json.dumps({"summary": {"seeds": a.seeds, "base_pass@1": base, "teacher_pass@1": teacher,
                                  "lift_points": lifts, "budget_s": a.budget_s}}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
