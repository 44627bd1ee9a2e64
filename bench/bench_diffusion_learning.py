"""Diffusion RL learning curves: Flow-GRPO and DiffusionNFT on the tiny DiT, several seeds.

Per seed: the task data and a flow-matching SFT base (seed = the seed), then two runs of the
quickstart recipe (`DEMO_DIFFUSION`, 20 rollouts of 16 prompts x 8 samples) through the platform's
loop on Ray: Flow-GRPO (`--loss-type policy_loss`) and NFT (`--loss-type nft --use-ema
--rollout-weights ema`). The baseline is the base itself (v0, evaluated by the same loop). The
metric: mean reward on the held-out colour x quadrant combinations, deterministic (ODE) sampling,
fixed seeds, 8 samples per eval prompt. Wall time counts SFT and RL.

    PYTHONPATH=. python -m bench.bench_diffusion_learning --seeds 3
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def _run(root: str, data: dict, base: str, seed: int, loss: str, rollouts: int) -> dict:
    from miles_platform.diffusion.config import DiffusionRunConfig
    from miles_platform.diffusion.loop import train_diffusion
    from miles_platform.recipes import DEMO_DIFFUSION

    kw = dict(DEMO_DIFFUSION, run_name=f"{loss}-{seed}", num_rollout=rollouts, seed=seed, rollout_seed=seed,
              hf_checkpoint=base, prompt_data=data["train"], eval_prompt_data=["heldout", data["eval"]],
              storage_root=root, save_interval=None, loss_type=loss)  # fmt: skip
    if loss == "nft":
        kw.update(
            use_ema=True, rollout_weights="ema", diffusion_step_strategy_path=None, diffusion_num_sde_steps=0
        )
    cfg = DiffusionRunConfig.from_dict(kw).validate()
    t0 = time.time()
    res = train_diffusion(cfg)
    curve = [[0, res.eval_before_train["eval/heldout/mean_reward"]]]
    curve += [
        [i + 1, m["eval/heldout/mean_reward"]]
        for i, m in enumerate(res.metrics)
        if "eval/heldout/mean_reward" in m
    ]
    return {"wall_s": time.time() - t0, "curve": curve, "gain": curve[-1][1] - curve[0][1],
            "ci_checks": res.ci_checks}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rollouts", type=int, default=20)
    ap.add_argument("--out", default="bench_diffusion_learning.json")
    args = ap.parse_args()
    from miles_platform.diffusion.model import train_sft_base
    from miles_platform.diffusion.task import write_diffusion_data

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(1, args.seeds + 1):
            t0 = time.time()
            data = write_diffusion_data(os.path.join(tmp, f"data{seed}"), seed=seed)
            base = os.path.join(tmp, f"base{seed}")
            sft = train_sft_base(
                base, seed=seed, sft_data=data["sft"], eval_data=data["eval"], log=lambda m: None
            )
            row = {"seed": seed, "sft_s": sft["seconds"], "base_eval_reward_sft": sft["base_eval_reward"]}
            for loss in ("policy_loss", "nft"):
                row[loss] = _run(os.path.join(tmp, "root"), data, base, seed, loss, args.rollouts)
            row["total_s"] = time.time() - t0
            results.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print("\n| seed | base | Flow-GRPO final | gain | NFT final | gain | SFT s | GRPO s | NFT s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        g, n = r["policy_loss"], r["nft"]
        print(f"| {r['seed']} | {g['curve'][0][1]:.3f} | {g['curve'][-1][1]:.3f} | {g['gain']:+.3f} | "
              f"{n['curve'][-1][1]:.3f} | {n['gain']:+.3f} | {r['sft_s']:.0f} | {g['wall_s']:.0f} | {n['wall_s']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
