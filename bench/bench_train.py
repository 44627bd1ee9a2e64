"""Train path: tokens/s of one GRPO optimizer step vs a plain HF forward+backward of the same tokens.

One rollout of the quickstart's shape (16 prompts x 8 samples, 6-token prompts, up to 8-token
responses) goes through TrainerActor.train in-process (no Ray) for --train-backend fsdp
(torch-native) and megatron. That call is the whole GRPO step: old log-prob recompute, advantages,
loss, backward, grad clip, AdamW (old log-probs come from the training forward itself: one step
per rollout; a prompt's samples share its forward, training/shared_prefix.py, and a row compares
that with the same step on padded rows). The baseline is the bare HF model on the same padded
tokens: forward, next-token cross-entropy, backward, AdamW step. The ratio is the share of the bare
fwd+bwd speed a full step keeps (lower = more overhead around the math).
Per device: the CPU always; with CUDA the same rows tagged " [cuda]", where both sides run the
device's default forward (bf16 autocast over fp32 weights for fsdp, the baseline too).
"""

from __future__ import annotations

import os
import random
import tempfile

import torch

from bench.common import best_of, error_row, main, row

PROMPTS, GROUP, PROMPT_LEN, MAX_RESP = 16, 8, 6, 8


# Tolerance (bench/baseline.py: `make bench` flags a ratio that moved the wrong way by more): share
# of plain HF 0.74-0.87 (fsdp) over the 2026-12-04/05 runs
NOISE = 0.2


def make_checkpoint(path: str) -> str:
    """The quickstart's model shape (random weights) with the platform's task tokenizer."""
    from miles_platform.models.checkpoint import save_hf_checkpoint
    from miles_platform.models.qwen3 import build_model, tiny_qwen3_config
    from miles_platform.models.tokenizer import build_task_tokenizer

    tok = build_task_tokenizer()
    model = build_model(
        tiny_qwen3_config(len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=2)
    )
    save_hf_checkpoint(model, tok, path)
    return path


def make_batch(vocab: int, seed: int = 0):
    from miles_platform.training.actor import TrainBatch

    rng = random.Random(seed)
    tokens, resp_lens, masks, rewards, lps = [], [], [], [], []
    for _ in range(PROMPTS):
        prompt = [rng.randrange(vocab) for _ in range(PROMPT_LEN)]
        for _ in range(GROUP):
            n = rng.randint(2, MAX_RESP)
            tokens.append(prompt + [rng.randrange(vocab) for _ in range(n)])
            resp_lens.append(n)
            masks.append([1] * n)
            rewards.append(float(rng.random() < 0.5))
            lps.append([-3.0] * n)
    return TrainBatch(tokens, resp_lens, masks, rewards, lps)


def run_config(ckpt: str, backend: str):
    from miles_platform.config import RunConfig
    from miles_platform.recipes import DEMO_RL

    keys = (
        "lr",
        "eps_clip",
        "weight_decay",
        "calculate_per_token_loss",
        "micro_batch_size",
        "advantage_estimator",
    )
    recipe = {k: DEMO_RL[k] for k in keys}
    return RunConfig(
        hf_checkpoint=ckpt,
        train_backend=backend,
        rollout_batch_size=PROMPTS,
        n_samples_per_prompt=GROUP,
        num_steps_per_rollout=1,
        **recipe,
    ).validate()


def grpo_step_seconds(
    ckpt: str, backend: str, batch, repeats: int, device: str = "cpu", share_prefixes: bool = True
) -> float:
    from miles_platform.training.actor import TrainerActor

    actor = TrainerActor(run_config(ckpt, backend), device=device)
    actor.share_prefixes = share_prefixes  # False: every sample its own padded row
    actor.train(0, batch)  # warm-up: first-call allocations, optimizer state
    rid = iter(range(1, 100))
    return best_of(lambda: actor.train(next(rid), batch), repeats)  # train() ends in host reads: synced


def plain_fwd_bwd_seconds(
    ckpt: str, batch, repeats: int, device: str = "cpu", forward: str = "fp32"
) -> float:
    """The bare HF model on the same right-padded tokens: forward, CE loss, backward, AdamW step
    (under bf16 autocast when `forward` is bf16, as the trainer's CUDA default)."""
    from miles_platform.models.checkpoint import load_hf_model

    model = load_hf_model(ckpt).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    width = max(len(t) for t in batch.tokens)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    for r, t in enumerate(batch.tokens):
        ids[r, : len(t)] = torch.tensor(t)
    ids = ids.to(device)
    pos = torch.arange(width, device=device).expand(len(batch), -1)
    kind = torch.device(device).type
    bf16 = forward == "bf16"

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast(kind, dtype=torch.bfloat16, enabled=bf16):
            logits = model(
                input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=False
            ).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
        )
        loss.backward()
        opt.step()
        float(loss)  # the host waits for the device, as the trainer's metrics do

    step()
    return best_of(step, repeats)


def run(repeats: int = 7) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_train_") as d:
        ckpt = make_checkpoint(os.path.join(d, "hf"))
        from miles_platform.models.checkpoint import validate_hf_dir

        batch = make_batch(int(validate_hf_dir(ckpt)["vocab_size"]))
        for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
            rows += _device_rows(ckpt, batch, repeats, device)
    return rows


def _device_rows(ckpt: str, batch, repeats: int, device: str) -> list[dict]:
    from miles_platform.cluster.devices import default_dtype

    rows, tag = [], "" if device == "cpu" else f" [{device}]"
    n_tok = sum(len(t) for t in batch.tokens)
    # TrainerActor pins torch threads (MILES_TRAIN_THREADS, default 1): the baseline runs after
    # the first actor is built, so both see the same thread count.
    fsdp_s = grpo_step_seconds(ckpt, "fsdp", batch, repeats, device)
    base = {
        dt: plain_fwd_bwd_seconds(ckpt, batch, repeats, device, dt) for dt in {"fp32", default_dtype(device)}
    }
    unit = (f"tok/s (ratio: share of plain HF fwd+bwd+AdamW speed, goal >= 0.8; {len(batch)} samples, {n_tok} tok, "
            f"threads={torch.get_num_threads()}, forward {{}})")  # fmt: skip
    fwd = default_dtype(device)
    rows.append(row(f"train: GRPO step, fsdp (torch-native){tag}", n_tok / fsdp_s, n_tok / base[fwd],
                    unit.format(fwd), ours_s=fsdp_s, baseline_s=base[fwd]))  # fmt: skip
    padded_s = grpo_step_seconds(ckpt, "fsdp", batch, repeats, device, share_prefixes=False)
    rows.append(row(f"train: GRPO step, fsdp, shared-prefix packing vs padded rows{tag}", n_tok / fsdp_s,
                    n_tok / padded_s, f"tok/s (ratio: packed / padded; {GROUP} samples a {PROMPT_LEN}-token "
                    "prompt, training/shared_prefix.py)", ours_s=fsdp_s, baseline_s=padded_s))  # fmt: skip
    try:
        mega_s = grpo_step_seconds(ckpt, "megatron", batch, repeats, device)
    except Exception as e:  # the backend is optional: report why, never a number
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
        rows.append(error_row(f"train: GRPO step, megatron{tag}", f"unavailable: {reason}"))
    else:  # megatron trains in fp32 on every device
        rows.append(row(f"train: GRPO step, megatron{tag}", n_tok / mega_s, n_tok / base["fp32"],
                        unit.format("fp32"), ours_s=mega_s, baseline_s=base["fp32"]))  # fmt: skip
    return rows


if __name__ == "__main__":
    main(run)
