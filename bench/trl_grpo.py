"""TRL's `GRPOTrainer` on the e2e bench's base and prompts: seconds per GRPO step, as JSON.

Run under the TRL venv (`make bench-trl-env`, pins in requirements-trl.txt), never the project's:
it imports nothing from miles_platform. bench_e2e starts it in a subprocess; alone:

    .venv-trl/bin/python bench/trl_grpo.py --base DIR --prompts train.jsonl --steps 6

The recipe is the quickstart's `DEMO_RL` as TRL spells it: 16 prompts x 8 completions per optimizer
step (per_device_train_batch_size counts completions: 128; one generation batch per step), T=1,
top_k 0 / top_p 1, <= 8 new tokens, lr 1e-4 constant, AdamW betas (0.9, 0.98), weight decay 0,
grad-norm clip 1.0, clip eps 0.2, beta 0 (no KL, no reference model), one iteration per
generation (old log-probs = the training forward's, as ours), group-std-scaled advantages, and
loss_type "dapo": the sum of token losses / the active tokens of the whole generation batch; with
one process and one micro-batch of all 128 completions that is our `--calculate-per-token-loss`
token mean ("bnpo" divides by the local micro-batch's tokens, equal here too, but not once the
batch is split). Set for speed on CPU as a user would: fp32 (no bf16 autocast, the
GRPOConfig default), no gradient checkpointing (on by default in GRPOConfig), no vLLM, no
logging, saving or eval, the default fused AdamW, torch's default threads (one per core: what a
user gets; `--threads N` pins them).

The reward is ours (`--rm-type math`'s fast path): plain-number answers compared with the label as
decimals; anything else scores 0. Prints one JSON line: per-step seconds (the
first is warm-up), their mean after warm-up, each step's mean reward, peak RSS, versions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import tempfile
import time
from decimal import Decimal

_PLAIN = re.compile(r"-?(\d+)(?:\.(\d{1,6}))?")


def _plain(answer: str) -> Decimal | None:
    """miles_platform.rollout.rm_hub.math_rm.plain_number (copied: this venv has no miles_platform)."""
    m = _PLAIN.fullmatch(answer.strip())
    if m is None or len(m.group(1)) + len(m.group(2) or "") > 15:
        return None
    return Decimal(m.group(0))


def math_reward(completion: str, label: str) -> float:
    """Ours for plain numbers (math_verify's verdict on them); an answer that is not a plain number
    scores 0 here where ours asks math_verify (this venv has none): on this task such answers are
    all but never right ("12." would be), so both sides see the same rewards."""
    p, g = _plain(completion), _plain(str(label))
    return float(p is not None and g is not None and p == g)


def peak_rss_mb() -> float:
    """This process's own peak RSS (VmHWM). Not ru_maxrss: Linux carries that across fork + exec, so a
    subprocess of a bigger driver would report the driver's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(
    base: str, prompts: str, steps: int, seed: int, out_dir: str, save: str | None = None,
    threads: int | None = None,
) -> dict:  # fmt: skip
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if threads:
        torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with open(prompts) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    data = Dataset.from_list([{"prompt": r["prompt"], "label": str(r["label"])} for r in rows])
    rewards: list[float] = []

    def reward_fn(completions, label, **_):
        out = [math_reward(c, y) for c, y in zip(completions, label, strict=True)]
        rewards.append(sum(out) / len(out))
        return out

    stamps: list[float] = []

    class StepTimes(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    cfg = GRPOConfig(
        output_dir=out_dir,  # required by TrainingArguments; nothing is saved there
        max_steps=steps,
        num_generations=8,
        per_device_train_batch_size=128,  # completions: 16 prompts x 8
        gradient_accumulation_steps=1,
        max_completion_length=8,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        scale_rewards="group",
        loss_type="dapo",
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,  # GRPOConfig turns it on by default (gradient_checkpointing=True)
        logging_strategy="no",
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=seed,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward_fn, args=cfg, train_dataset=data, processing_class=tok,
        callbacks=[StepTimes()],
    )  # fmt: skip
    trainer.train()
    if save:  # the final policy, for a held-out eval outside this process (bench_e2e's whole-run rows)
        trainer.save_model(save)
        tok.save_pretrained(save)
    times = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    measured = times[1:] or times
    return {
        "step_seconds": times,
        "mean_step_seconds": sum(measured) / len(measured),
        "measured_steps": len(measured),
        "step_mean_reward": rewards,
        "final_mean_reward": rewards[-1] if rewards else None,
        "peak_rss_mb": peak_rss_mb(),
        "torch_threads": torch.get_num_threads(),
        "activation_checkpointing": bool(getattr(trainer.model, "is_activation_checkpointing", False)),
        "loss_type": cfg.loss_type,
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="HF checkpoint dir (Qwen3ForCausalLM + tokenizer)")
    p.add_argument("--prompts", required=True, help="JSONL with prompt/label keys")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (the first is warm-up)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--save", default=None, help="save the final model + tokenizer (HF dir) here")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    a = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="trl_grpo_") as out_dir:
        result = run(a.base, a.prompts, a.steps, a.seed, out_dir, a.save, a.threads)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
