"""LoRA vs full fine-tuning on the demo task, at equal rollouts (issue 22's learning check).

One SFT base (the demo recipe), then per seed two GRPO runs of the demo recipe from it: full
fine-tuning (`DEMO_RL`, lr 1e-4) and a rank-8 LoRA (`--lora-rank 8 --lora-alpha 16`, attention +
MLP, --lora-lr, default 2e-3: adapters take a larger step size; chosen by a sweep 1e-3 / 2e-3 /
4e-3 on seed 101, not on the seeds reported). Each reports held-out greedy pass@1 gain over the
base (the LoRA policy merged on demand for the eval), wall time, trainable parameters, optimizer
state and bytes per weight update. Baseline = full fine-tuning measured in the same run.

    PYTHONPATH=. python -m bench.bench_lora_learning --rollouts 20 --seeds 3
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

EVAL_PROMPTS = 200


def _greedy(hf_dir: str, eval_path: str) -> float:
    from miles_platform.rollout.evaluate import greedy_pass_at_1

    return greedy_pass_at_1(hf_dir, eval_path, EVAL_PROMPTS)


def _run(base: str, task: dict, root: str, seed: int, rollouts: int, lora: bool, lora_lr: float) -> dict:
    from miles_platform.config import RunConfig
    from miles_platform.loop import train
    from miles_platform.recipes import DEMO_RL
    from miles_platform.training.lora import export_merged_hf_dir

    extra = dict(lora_rank=8, lora_alpha=16, lr=lora_lr, check_lora_weight_equal=True) if lora else {}
    cfg = RunConfig(**{**DEMO_RL, "save_interval": None, "eval_interval": None, **extra},
                    hf_checkpoint=base, prompt_data=task["train"], num_rollout=rollouts, seed=seed,
                    rollout_seed=seed, storage_root=root, num_cpus_per_actor=0.5).validate()  # fmt: skip
    t0 = time.time()
    res = train(cfg)
    wall = time.time() - t0
    final = res.final_hf_path
    if lora:
        final = export_merged_hf_dir(base, res.versions[-1]["adapter_path"], os.path.join(root, "merged"))
    m = res.metrics
    return {
        "heldout_pass@1": _greedy(final, task["eval"]),
        "wall_s": wall,
        "train_s": sum(x.get("perf/actor_train_time", 0.0) for x in m),
        "wire_bytes_per_update": m[0].get("perf/update_weights_wire_bytes"),
        "full_bytes_per_update": m[0].get("perf/update_weights_full_bytes")
        or m[0].get("perf/update_weights_wire_bytes"),
        # memory, measured in the trainer actor: peak RSS of its process, optimizer state it holds
        "trainer_peak_rss_mb": max(x.get("perf/actor_peak_rss_mb", 0.0) for x in m),
        "optimizer_state_bytes": m[-1].get("perf/actor_optimizer_state_bytes"),
        "logprob_abs_diff_step0": res.ci_checks.get("train_rollout_logprob_abs_diff"),
        "reward_first5": sum(x["rollout/raw_reward"] for x in m[:5]) / 5,
        "reward_last5": sum(x["rollout/raw_reward"] for x in m[-5:]) / 5,
    }


def _param_counts(base: str, lora: bool) -> dict:
    from miles_platform.config import RunConfig
    from miles_platform.training.actor import TrainerActor

    kw = dict(lora_rank=8, lora_alpha=16) if lora else {}
    a = TrainerActor(RunConfig(hf_checkpoint=base, rollout_batch_size=1, **kw).validate())
    trainable = sum(p.numel() for g in a.opt.param_groups for p in g["params"])
    total = sum(p.numel() for p in a.backend.parameters())
    # AdamW keeps exp_avg + exp_avg_sq (fp32) per trainable parameter
    return {"trainable_params": trainable, "total_params": total, "adam_state_bytes": 2 * 4 * trainable}


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--rollouts", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=1, help="seeds 1..N (with --first-seed: first..first+N-1)")
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--only", choices=["full", "lora"], default=None, help="one kind (an lr sweep)")
    ap.add_argument("--lora-lr", type=float, default=2e-3, help="the adapter's learning rate")
    ap.add_argument("--work", default=None, help="work dir; its task data and SFT base are reused when there")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args()
    from miles_platform.data.tasks import write_task_datasets
    from miles_platform.training.sft import default_sft_recipe, run_sft

    d = args.work or tempfile.mkdtemp(prefix="bench-lora-")
    task = write_task_datasets(os.path.join(d, "task"), seed=0)  # deterministic: the same files again
    base = os.path.join(d, "base")
    if not os.path.exists(os.path.join(base, "config.json")):
        run_sft(task["sft"], base, recipe=default_sft_recipe(), progress=False)
    base_acc = _greedy(base, task["eval"])
    out = {"base_heldout_pass@1": base_acc, "rollouts": args.rollouts, "lora_lr": args.lora_lr, "runs": []}
    out["params"] = {"full": _param_counts(base, False), "lora": _param_counts(base, True)}
    kinds = {"full": (False,), "lora": (True,), None: (False, True)}[args.only]
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for lora in kinds:
            root = os.path.join(d, f"root-{seed}-{'lora-' + str(args.lora_lr) if lora else 'full'}")
            if os.path.exists(root):
                import shutil

                shutil.rmtree(root)
            r = _run(base, task, root, seed, args.rollouts, lora, args.lora_lr)
            r.update(seed=seed, kind="lora-r8" if lora else "full", gain=r["heldout_pass@1"] - base_acc)
            print(json.dumps(r), flush=True)
            out["runs"].append(r)
    for kind in ("full", "lora-r8"):
        gains = [r["gain"] for r in out["runs"] if r["kind"] == kind]
        if not gains:
            continue
        out[f"mean_gain_{kind}"] = sum(gains) / len(gains)
        for k in ("wall_s", "trainer_peak_rss_mb"):
            out[f"mean_{k}_{kind}"] = sum(r[k] for r in out["runs"] if r["kind"] == kind) / len(gains)
    if args.only is None:
        out["lora_minus_full_gain_points"] = 100 * (out["mean_gain_lora-r8"] - out["mean_gain_full"])
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
