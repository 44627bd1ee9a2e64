"""Embedded engine throughput vs HF `generate`, per device.

Same model (a small random Qwen3), same prompts, same number of new tokens (EOS ignored), same run.
Ours: all samples submitted at once to EngineCore (continuous batching + KV cache).
Baselines: `model.generate(do_sample=True)` one sample at a time (KV cache too, batch 1), and one
batched left-padded `generate` of all the prompts (the fastest plain HF call), on the same device.
Rows per device: the CPU always, CUDA when there is one (tag " [cuda]"). One more row per device: image
requests of the tiny Qwen3-VL (rollout/engine_vlm.py) through the KV cache (one prefill with the
pixels) vs a full forward of the prefix per token (`image_kv_cache = False`), same engine, same seeds.
And one: MLA decode steps of a small random DeepSeek-V3 in the absorbed form (models/mla_cache.py, as
the engine runs them) vs HF's decompressing layer, on the same compressed cache, same logits. And the
engine HTTP guard's cost on a streamed answer (`http_guard_row`).

    python -m bench.bench_engine [--json]
"""

from __future__ import annotations

import tempfile
import time

import torch

from bench.common import best_of, main, row

# Tolerance (bench/baseline.py: `make bench` flags a ratio that moved the wrong way by more):
# batch=8 4.13 vs 4.52, batch=32 11.5 vs 10.3, vs HF 0.84 vs 0.90 in two quiet runs on 2026-12-05
NOISE = 0.2

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


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate_tokens_per_s(ckpt: str, prompts: list[list[int]], new_tokens: int, device, dtype) -> float:
    """Tokens/s of one batched, left-padded HF `generate` (sampling, EOS ignored) on `device`:
    the best of 2 after a warm-up."""
    from miles_platform.models.checkpoint import load_hf_model

    model = load_hf_model(ckpt).to(device=device, dtype=dtype).eval()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], att[i, width - len(p) :] = torch.tensor(p), 1
    ids, att = ids.to(device), att.to(device)

    def gen(n):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=att, max_new_tokens=n, min_new_tokens=n, do_sample=True,
                                 temperature=1.0, top_k=0, pad_token_id=0)  # fmt: skip
        _sync(device)
        assert out.shape[1] == width + n

    gen(2)
    return len(prompts) * new_tokens / best_of(lambda: gen(new_tokens), 2)


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def run() -> list[dict]:
    torch.set_num_threads(1)  # a shared 2-core box: OpenMP teams stall when other jobs hold the cores
    rows = []
    with tempfile.TemporaryDirectory() as root:
        ckpt = _checkpoint(root)
        for device in devices():
            rows += _device_rows(ckpt, device)
            rows.append(image_kv_cache_row(root, device))
            rows.append(mla_decode_row(device))
    rows.append(http_guard_row())
    return rows


def http_guard_row(chunks: int = 128, requests: int = 200) -> dict:
    """The engine's HTTP guard (rollout/http_common.py add_guards: auth, size limit, counts) on a
    streamed answer of `chunks` lines, what a batched /generate sends (one per finished sample), vs
    the same app without it; CPU of this process (server thread + client) per request."""
    import asyncio

    import httpx
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from miles_platform.rollout.engine_server import serve_in_thread
    from miles_platform.rollout.http_common import add_guards

    line = b'{"text": "123", "meta_info": {"output_token_logprobs": [[-0.1, 5, null]]}}\n'

    def app(guarded: bool) -> FastAPI:
        a = FastAPI()
        if guarded:
            add_guards(a, "key", 1 << 20)

        @a.post("/generate")
        async def generate():
            async def lines():
                for _ in range(chunks):
                    yield line
                    await asyncio.sleep(0)

            return StreamingResponse(lines())

        return a

    cpu = {}
    for guarded in (True, False):
        server = serve_in_thread(app(guarded), "127.0.0.1", 0, "bench-http")
        try:
            with httpx.Client(headers={"Authorization": "Bearer key"}) as c:

                def answer(url=f"{server.url}/generate"):
                    r = c.post(url)
                    assert r.status_code == 200 and len(r.content) == chunks * len(line)

                for _ in range(20):
                    answer()
                t = time.process_time()
                for _ in range(requests):
                    answer()
                cpu[guarded] = (time.process_time() - t) / requests
        finally:
            server.stop()
    return row(f"engine HTTP: a {chunks}-line streamed answer, guarded vs bare app", cpu[True] * 1e3,
               cpu[False] * 1e3, "ms CPU / request (ratio: guarded / bare; lower = a cheaper guard; "
               "server thread + client, one process)")  # fmt: skip


def image_kv_cache_row(root: str, device: str, n: int = 8, new_tokens: int = NEW_TOKENS) -> dict:
    """Tokens/s of `n` image requests (64-pixel images: 4 image tokens each) with the KV cache vs a
    full forward per token, on one engine; the two paths must draw the same tokens."""
    import os

    from miles_platform.models.vlm import IMAGE_PAD, VISION_END, VISION_START, save_tiny_vlm_checkpoint
    from miles_platform.rollout.engine_core import EngineCore

    path = os.path.join(root, "bench-vl")
    if not os.path.isdir(path):
        save_tiny_vlm_checkpoint(path, image_size=64)
    core = EngineCore(path, device=device)
    try:
        prompt = core.tokenizer(f"{VISION_START}{IMAGE_PAD}{VISION_END}How many shapes?")["input_ids"]
        uris = [_square_uri(i) for i in range(n)]
        body = {"input_ids": [prompt] * n, "image_data": [[u] for u in uris], "return_logprob": False,
                "sampling_params": [{"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True,
                                     "sampling_seed": i} for i in range(n)]}  # fmt: skip
        outs = {}

        def gen(cached: bool):
            core.image_kv_cache = cached
            futures, _ = core.submit_json(body)
            outs[cached] = [f.result()["output_ids"] for f in futures]

        gen(True)  # warm-up
        t_cached, t_full = best_of(lambda: gen(True), 2), best_of(lambda: gen(False), 2)
        assert outs[True] == outs[False], "the KV-cache path drew other tokens than the full forwards"
    finally:
        core.stop()
    tag = "" if device == "cpu" else f" [{device}]"
    tokens = n * new_tokens
    return row(f"engine image requests batch={n}, KV cache{tag}", tokens / t_cached, tokens / t_full,
               "tok/s (ratio: x faster than a full forward of the prefix per token)")  # fmt: skip


def mla_decode_row(device: str, rows: int = 8, context: int = 256, steps: int = 16) -> dict:
    """Tokens/s of `steps` greedy decode steps of `rows` rows after a `context`-token prefill, on a
    random DeepSeek-V3 (8 heads, rank 64): absorbed vs HF's decompression of the context per step."""
    import copy

    from miles_platform.models.families import build_model, tiny_config
    from miles_platform.models.mla_cache import absorb_mla_decode, cache_values_per_token
    from miles_platform.rollout.engine_batch import new_cache

    cfg = tiny_config("deepseek_v3", 512, hidden_size=256, num_attention_heads=8, kv_lora_rank=64,
                      qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=96,
                      max_position_embeddings=context + steps + 8)  # fmt: skip
    hf = build_model(cfg).to(device)
    ours = copy.deepcopy(hf)
    absorb_mla_decode(ours)
    ids = torch.randint(0, 512, (rows, context), generator=torch.Generator().manual_seed(0)).to(device)
    logits = {}

    def decode(model):
        cache = new_cache(model.config)
        with torch.no_grad():
            out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                out = model(input_ids=out.argmax(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1]
            _sync(device)
        logits[model is ours] = out
        return time.perf_counter() - t0

    decode(ours)  # warm-up
    t_ours, t_hf = min(decode(ours) for _ in range(2)), min(decode(hf) for _ in range(2))
    assert torch.allclose(logits[True], logits[False], atol=1e-4), "absorbed MLA decode drew other logits"
    per = cache_values_per_token(cfg)
    tag = "" if device == "cpu" else f" [{device}]"
    return row(f"engine MLA decode batch={rows} context={context}, absorbed{tag}", rows * steps / t_ours,
               rows * steps / t_hf, "tok/s (ratio: x faster than HF decompressing the cached context per step)",
               cache_values_per_token=per["compressed"], decompressed_values_per_token=per["decompressed"])  # fmt: skip


def _square_uri(i: int) -> str:
    import io

    from PIL import Image

    from miles_platform.data.images import to_data_uri

    img = Image.new("RGB", (32, 32), (0, 0, 0))
    img.paste((40 * i % 256, 255, 80), (4 * (i % 4), 4, 4 * (i % 4) + 12, 16))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return to_data_uri(buf.getvalue())


def _device_rows(ckpt: str, device: str) -> list[dict]:
    from miles_platform.rollout.engine_core import EngineCore

    rows, tag = [], "" if device == "cpu" else f" [{device}]"
    core = EngineCore(ckpt, max_batch_size=max(BATCHES), device=device)
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
                ids = torch.tensor([p], device=core.device)
                with torch.no_grad():
                    out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                         do_sample=True, temperature=1.0, top_k=0, pad_token_id=0)  # fmt: skip
                assert out.shape[1] == len(p) + NEW_TOKENS
            _sync(core.device)

        for n in BATCHES:
            repeats = 3 if n < 32 else 2
            t_ours = best_of(lambda n=n: ours(n), repeats)
            t_base = best_of(lambda n=n: naive(n), repeats)
            tokens = n * NEW_TOKENS
            rows.append(
                row(
                    f"engine generate batch={n}{tag}",
                    tokens / t_ours,
                    tokens / t_base,
                    "tok/s (ratio: x faster than one model.generate per sample)",
                    forward_calls=core.stats["num_forward_calls"],
                )
            )
        n, dtype = max(BATCHES), core.dtype
        t_ours = best_of(lambda: ours(n), 2)
    finally:
        core.stop()
    batched = hf_generate_tokens_per_s(ckpt, prompts[:n], NEW_TOKENS, device, dtype)
    rows.append(
        row(
            f"engine generate batch={n} vs batched HF generate{tag}",
            n * NEW_TOKENS / t_ours,
            batched,
            f"tok/s (ratio: x faster than one batched, left-padded model.generate; {str(dtype)[6:]})",
        )
    )
    return rows


if __name__ == "__main__":
    t0 = time.perf_counter()
    main(run)
    print(f"(bench_engine: {time.perf_counter() - t0:.1f}s)")
