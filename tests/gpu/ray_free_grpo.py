"""The demo's GRPO run on one device without Ray: the GPU check machine has no Ray (its cp312 wheel
alone is 79 MB of the 64 MiB a device call carries), FastAPI, uvicorn, DuckDB or Dagster.

The same components as `miles-platform train`, driven in one process: `TrainerActor` (the rank's
device, the backend, the loss hub, --ci-test's step-0 checkers), `EngineCore` (the embedded engine on
the same device, seeded sampling, log-probs), the rollout's `append_output` and reward hub, and with
`colocate=True` the colocation schedule of cluster/colocation.py (engine release / resume, trainer
offload / onload, weights through shared memory by /update_weights_from_tensor's code path). What it
leaves out is what needs those packages: placement groups, HTTP, the router, shards and the catalog.

    python tests/gpu/ray_free_grpo.py --out DIR [--device cuda] [--num-rollout 20] [--colocate]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from miles_platform.recipes import DEMO_RL

SFT_ITERS = 300  # bench/bench_rollout.py's short SFT: answers end with EOS, accuracy leaves RL headroom


def exact_answer_rm(args, sample) -> float:
    """Where math_verify is not installed: 1.0 when the response, stripped, is the label (the task's
    answers are integers, so this is what `--rm-type math` grades on it)."""
    return float((sample.response or "").strip() == str(sample.label).strip())


def reward_flags() -> dict:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return {"rm_type": None, "custom_rm_path": "ray_free_grpo.exact_answer_rm"}
    return {"rm_type": "math"}


def build_base(root: str, sft_iters: int = SFT_ITERS) -> tuple[str, dict]:
    """The demo's base: the task datasets and a short SFT of the tiny Qwen3 (on this process's device)."""
    from miles_platform.data.tasks import write_task_datasets
    from miles_platform.training.sft import default_sft_recipe, run_sft

    data = write_task_datasets(os.path.join(root, "task"), seed=0)
    base = os.path.join(root, "base")
    if not Path(base, "config.json").exists():
        recipe = default_sft_recipe()
        recipe.train_iters = sft_iters
        run_sft(data["sft"], save=base, recipe=recipe, progress=False)
    return base, data


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(
    base: str, prompts: str, device: str, num_rollout: int, colocate: bool, seed: int = 1, log=print
) -> dict:
    """One GRPO run; returns its per-rollout rewards, the step-0 checks, weight checks and timings."""
    from miles_platform.config import RunConfig
    from miles_platform.data.dataset import load_prompt_dataset
    from miles_platform.data.sample import Sample
    from miles_platform.rollout import rm_hub
    from miles_platform.rollout.engine_core import EngineCore
    from miles_platform.rollout.generate_hub.endpoint import append_output
    from miles_platform.training.actor import TrainBatch, TrainerActor
    from miles_platform.training.ci_checks import rollout_checks

    cfg = RunConfig(**{**DEMO_RL, **reward_flags(), "run_name": "gpu"}, hf_checkpoint=base, prompt_data=prompts,
                    num_rollout=num_rollout, seed=seed, rollout_seed=seed, colocate=colocate).validate()  # fmt: skip
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t_start = time.time()
    trainer = TrainerActor(cfg, device=dev)
    engine = EngineCore(base, dtype=trainer.cfg.rollout_dtype, device=dev, max_batch_size=512)
    records = load_prompt_dataset(prompts, input_key="prompt", label_key="label")
    rm_hub.warm_up_rewards(cfg.rm_type)
    n, b = cfg.n_samples_per_prompt, cfg.rollout_batch_size
    rng = np.random.default_rng(seed)
    tok = engine.tokenizer
    out = {"device": str(dev), "colocate": colocate, "engine_dtype": str(engine.dtype), "rollouts": [],
           "train_forward_dtype": trainer.cfg.train_forward_dtype, "reward": reward_flags()}  # fmt: skip
    if colocate:
        trainer.offload()  # Colocation.start
    version = 0
    try:
        for rollout_id in range(num_rollout):
            t0 = time.time()
            recs = [records[i] for i in rng.choice(len(records), b, replace=False)]
            ids = [tok.encode(r.prompt, add_special_tokens=False) for r in recs]
            sp = [{"max_new_tokens": cfg.rollout_max_response_len, "temperature": cfg.rollout_temperature,
                   "sampling_seed": seed * 1_000_003 + rollout_id * 10_007 + k} for k in range(b * n)]  # fmt: skip
            answers = engine.generate(
                input_ids=[p for p in ids for _ in range(n)], sampling_params=sp, timeout=600
            )
            samples = []
            for k, ans in enumerate(answers):
                r = recs[k // n]
                s = Sample(
                    index=k, group_index=k // n, prompt=r.prompt, prompt_tokens=ids[k // n], label=r.label
                )
                append_output(s, ans, replay=False)
                samples.append(s)
            rm_hub.compute_rewards(cfg, samples)
            t1 = time.time()
            if colocate:  # Colocation.after_generate
                engine.release_memory_occupation(["kv_cache", "cuda_graph", "weights"])
            m = trainer.train(rollout_id, TrainBatch.from_samples(samples))
            checks = rollout_checks(cfg, rollout_id, m, log)  # every rollout, as the loop
            t2 = time.time()
            version += 1
            if colocate:  # before_weight_update, the shared-memory hand-off, after_weight_update
                engine.resume_memory_occupation(["weights"])
                desc = trainer.stage_weights()
                engine.update_weights_from_tensor(desc, version)
                trainer.unstage_weights()
            else:
                engine.update_weights_from_tensors(trainer.get_hf_weights(), version)
            want = {k: v.to(engine.dtype) for k, v in trainer.get_hf_weights().items()}
            got = engine.get_weights()
            weights_equal = all(torch.equal(got[k], want[k]) for k in want)
            if colocate:
                trainer.offload()
                engine.resume_memory_occupation(["kv_cache"])
            row = {"rollout_id": rollout_id, "raw_reward": float(np.mean([s.raw_reward for s in samples])),
                   "loss": m["train/loss"], "grad_norm": m["train/grad_norm"],
                   "logprob_abs_diff": m.get("train/train_rollout_logprob_abs_diff"),
                   "weights_equal": weights_equal, "rollout_s": t1 - t0, "train_s": t2 - t1,
                   "update_s": time.time() - t2, "version": engine.weight_version}  # fmt: skip
            if rollout_id == 0:
                out["ci_checks"] = checks
            out["rollouts"].append(row)
            log(json.dumps(row))
            if not weights_equal:
                raise AssertionError(f"rollout {rollout_id}: the engine does not serve the trainer's weights")
    finally:
        engine.stop()
    out["seconds"] = time.time() - t_start
    out["peak_mem_mb"] = _peak_mb(dev)
    rewards = [r["raw_reward"] for r in out["rollouts"]]
    k = max(1, len(rewards) // 4)
    out["reward_first_quarter"], out["reward_last_quarter"] = (
        float(np.mean(rewards[:k])),
        float(np.mean(rewards[-k:])),
    )
    half = max(1, len(rewards) // 2)
    out["reward_first_half"], out["reward_second_half"] = (
        float(np.mean(rewards[:half])),
        float(np.mean(rewards[half:] or rewards)),
    )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-rollout", type=int, default=20)
    ap.add_argument("--colocate", action="store_true")
    a = ap.parse_args(argv)
    base, data = build_base(a.out)
    res = run(base, data["train"], a.device, a.num_rollout, a.colocate)
    Path(a.out, f"grpo_{'colocated' if a.colocate else 'separate'}.json").write_text(
        json.dumps(res, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
