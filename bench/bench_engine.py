"""Embedded engine throughput vs a naive loop of one `model.generate` per sample.

Same model (a small random Qwen3), same prompts, same number of new tokens (EOS ignored), same run.
Ours: all samples submitted at once to EngineCore (continuous batching + KV cache).
Baseline: `model.generate(do_sample=True)` one sample at a time (KV cache too, batch 1).

    python -m bench.bench_engine [--json]
"""

from __future__ import annotations

import tempfile
import time

import torch

from bench.common import best_of, main, row

NEW_TOKENS = 32
BATCHES = (1, 8, 32)


def _checkpoint(root: str) -> str:
    from miles_platform.models.checkpoint import save_hf_checkpoint
    from miles_platform.models.qwen3 import build_model, tiny_qwen3_config
    from miles_platform.models.tokenizer import train_tokenizer

    corpus = [f"What is {a}+{b}? {a + b}" for a in range(0, 100, 3) for b in range(0, 100, 7)]
    tok = train_tokenizer(corpus, vocab_size=512)
    cfg = tiny_qwen3_config(
        len(tok), hidden_size=256, intermediate_size=768, num_hidden_layers=4, max_position_embeddings=512
    )
    path = f"{root}/bench-model"
    save_hf_checkpoint(build_model(cfg, seed=0), tok, path)
    return path


def run() -> list[dict]:
    from miles_platform.rollout.engine_core import EngineCore

    torch.set_num_threads(1)  # a shared 2-core box: OpenMP teams stall when other jobs hold the cores
    rows = []
    with tempfile.TemporaryDirectory() as root:
        core = EngineCore(_checkpoint(root), max_batch_size=max(BATCHES))
        try:
            model, tok = core.model, core.tokenizer
            prompts = [tok(f"What is {i * 3}+{i * 7 % 100}?")["input_ids"] for i in range(max(BATCHES))]
            sp = {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}
            core.generate(input_ids=prompts[:2], sampling_params=sp)  # warm-up

            def ours(n):
                futures = [core.submit(p, {**sp, "sampling_seed": i}) for i, p in enumerate(prompts[:n])]
                for f in futures:
                    assert f.result()["meta_info"]["completion_tokens"] == NEW_TOKENS

            def naive(n):
                for p in prompts[:n]:
                    ids = torch.tensor([p])
                    with torch.no_grad():
                        out = model.generate(
                            ids,
                            max_new_tokens=NEW_TOKENS,
                            min_new_tokens=NEW_TOKENS,
                            do_sample=True,
                            temperature=1.0,
                            top_k=0,
                            pad_token_id=0,
                        )
                    assert out.shape[1] == len(p) + NEW_TOKENS

            for n in BATCHES:
                repeats = 3 if n < 32 else 2
                t_ours = best_of(lambda n=n: ours(n), repeats)
                t_base = best_of(lambda n=n: naive(n), repeats)
                tokens = n * NEW_TOKENS
                rows.append(
                    row(
                        f"engine generate batch={n}",
                        tokens / t_ours,
                        tokens / t_base,
                        "tok/s (ratio: x faster than one model.generate per sample)",
                        forward_calls=core.stats["num_forward_calls"],
                    )
                )
        finally:
            core.stop()
    return rows


if __name__ == "__main__":
    t0 = time.perf_counter()
    main(run)
    print(f"(bench_engine: {time.perf_counter() - t0:.1f}s)")
