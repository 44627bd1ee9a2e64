"""Train/rollout alignment of the diffusion dtype contract: step-0 ratio per precision pairing.

The probe Miles documents (`--diffusion-debug-mode --debug-skip-optimizer-step`): the engine records
a rollout (its log-probs and noise_pred), the trainer re-scores every transition with frozen weights,
so any gap is forward-path difference. Pairings: the contract at fp32, bf16 and fp16 (engine and
trainer at one precision, one `dit_forward`), and the pairing the config refuses (engine bf16,
trainer fp32) as the reference for what a broken contract costs.

    PYTHONPATH=. python -m bench.bench_diffusion_precision --hf-checkpoint .miles/models/diffusion_base
"""

from __future__ import annotations

import argparse
import json

PAIRS = (("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp32"))
KEYS = ("train/ratio_abs_minus_1", "train/log_prob_mean_abs_diff", "train/model_output_mean_abs_diff",
        "train/model_output_max_abs_diff", "train/model_output_rel_max")  # fmt: skip


def probe(
    base: str, engine_dtype: str, trainer_dtype: str, sde: str, prompts: int, n: int
) -> dict[str, float]:
    from miles_platform.data.dataset import PromptRecord
    from miles_platform.diffusion import task
    from miles_platform.diffusion.config import parse_diffusion_config
    from miles_platform.diffusion.engine import start_diffusion_engine
    from miles_platform.diffusion.rollout import DiffusionRollout
    from miles_platform.diffusion.trainer import DiffusionTrainer

    cfg = parse_diffusion_config([
        "--hf-checkpoint", base, "--diffusion-task", "t2i", "--prompt-data", "unused", "--rollout-batch-size",
        str(prompts), "--n-samples-per-prompt", str(n), "--num-rollout", "1", "--rollout-microgroup-size", str(n),
        "--diffusion-debug-mode", "--debug-skip-optimizer-step", "--diffusion-sde-type", sde,
        "--diffusion-step-strategy-path", "sde_window", "--diffusion-num-sde-steps", "9",
        "--diffusion-forward-dtype", trainer_dtype, "--sglang-dit-precision", trainer_dtype,
        "--micro-batch-size", "64",
    ])  # fmt: skip
    srv = start_diffusion_engine(base, api_key="bench", dit_precision=engine_dtype)
    try:
        ro = DiffusionRollout(cfg, srv.url, "bench")
        recs = [PromptRecord(str(i), p, None, {}) for i, p in enumerate((task.train_prompts() * 8)[:prompts])]
        _, traj, _ = ro.generate(0, recs, "bench")
        ro.close()
    finally:
        srv.stop()
    m = DiffusionTrainer(cfg).train(0, traj.to_dict())
    return {k: m[k] for k in KEYS}


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--hf-checkpoint", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    args = ap.parse_args()
    rows = []
    for sde in ("sde", "cps"):
        for eng, trn in PAIRS:
            r = probe(args.hf_checkpoint, eng, trn, sde, args.prompts, args.n)
            rows.append({"sde": sde, "engine": eng, "trainer": trn, **r})
            print(json.dumps(rows[-1]), flush=True)
    print(
        "\n| sde | engine | trainer | ratio_abs_minus_1 | log_prob_mean_abs_diff | model_output_mean_abs_diff |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['sde']} | {r['engine']} | {r['trainer']} | {r[KEYS[0]]:.2e} | {r[KEYS[1]]:.2e} | {r[KEYS[2]]:.2e} |"
        )


if __name__ == "__main__":
    main()
