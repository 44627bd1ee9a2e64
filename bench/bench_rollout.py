"""Rollout and eval at the quickstart's shape: our engine path vs one batched `model.generate`.

Model: the quickstart's tiny Qwen3 after a short SFT on the arithmetic task (so responses end with
EOS as in the demo); prompts: 16 training prompts x 8 samples, temperature 1, <= 8 new tokens, EOS
stops. Everything runs in this one process, one torch thread, back to back:

- generation rows: `RolloutManager.generate_groups` -> (router) -> embedded engine over loopback
  HTTP, one batched `/generate` (SGLang's list form) per rollout, Samples back, vs one batched HF
  `model.generate(do_sample=True)` of the same 128 sequences (what a TRL-style trainer does).
- "incl. rewards" rows: the full `manager.generate` (rewards, filters, metrics) vs the same
  `generate` + the same reward scoring. Reward time moves with how many sampled answers are
  not plain numbers (math_verify parses those, ms each), so these rows are medians of 9.
- the per-sample path (before batching): one `/generate` per sample through the router, each
  rollout with a new `httpx.AsyncClient`.
- eval: greedy pass@1 of 512 held-out prompts through the engine (in-loop eval) vs a batched
  HF `generate` of all 512 (+ the same scoring).

Ratios are "x faster" (baseline seconds / ours). peak_rss_mb is this process's peak so far.
"""

from __future__ import annotations

import asyncio
import os
import resource
import tempfile
import time

import torch

from bench.common import main, median_of, row

PROMPTS, GROUP, NEW_TOKENS, EVAL_PROMPTS = 16, 8, 8, 512
# Tolerance (bench/baseline.py: `make bench` flags a ratio that moved the wrong way by more):
# through the router 0.81 vs 1.07 x faster, per-sample 70 vs 76, in two quiet runs on 2026-12-05
NOISE = 0.35

SFT_ITERS = 300


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def sft_base(root: str) -> tuple[str, dict[str, str]]:
    """A short SFT of the quickstart's model on the task (it answers and stops with EOS)."""
    from miles_platform.data.tasks import write_task_datasets
    from miles_platform.training.sft import default_sft_recipe, run_sft

    data = write_task_datasets(os.path.join(root, "task"), seed=0)
    recipe = default_sft_recipe()
    recipe.train_iters = SFT_ITERS
    path = os.path.join(root, "base")
    run_sft(data["sft"], save=path, recipe=recipe, progress=False)
    return path, data


def hf_generate(model, tok, prompts: list[list[int]], temperature: float, seed: int) -> list[str]:
    """The baseline sampler: one left-padded batched `generate` (KV cache, EOS ends a row)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], att[i, width - len(p) :] = torch.tensor(p), 1
    torch.manual_seed(seed)
    kw = dict(temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else {}
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=att, max_new_tokens=NEW_TOKENS, pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id, do_sample=temperature > 0, **kw,
        )  # fmt: skip
    return tok.batch_decode(out[:, width:], skip_special_tokens=True)


def _score(cfg, records, texts) -> float:
    from miles_platform.data.sample import Sample
    from miles_platform.rollout import rm_hub

    samples = [
        Sample(index=i, group_index=i // GROUP, prompt=r.prompt, response=t, label=r.label)
        for i, (r, t) in enumerate(zip(records, texts, strict=True))
    ]
    rm_hub.compute_rewards(cfg, samples)
    return sum(s.raw_reward for s in samples) / len(samples)


def _per_sample_rollout(cfg, manager, url: str, prompts, seeds) -> list[dict]:
    """The path before batching: one request per sample, a new client per rollout."""
    import httpx

    from miles_platform.rollout import client as engine_client

    async def go():
        sem = asyncio.Semaphore(cfg.rollout_max_concurrency)
        async with httpx.AsyncClient(timeout=600) as c:

            async def one(p, s):
                async with sem:
                    sp = {**manager.sampling_params(), "sampling_seed": s}
                    return await engine_client.generate(url, p, sp, client=c)

            return await asyncio.gather(*(one(p, s) for p, s in zip(prompts, seeds, strict=True)))

    return asyncio.run(go())


def run() -> list[dict]:
    from miles_platform.config import RunConfig
    from miles_platform.data.dataset import load_prompt_dataset
    from miles_platform.data.source import RolloutDataSource
    from miles_platform.models.checkpoint import load_hf_checkpoint
    from miles_platform.recipes import DEMO_RL
    from miles_platform.rollout.engine_server import start_engine_server
    from miles_platform.rollout.evaluate import evaluate
    from miles_platform.rollout.manager import RolloutManager, router_generate_fn
    from miles_platform.rollout.router import start_router

    torch.set_num_threads(1)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as root:
        base, data = sft_base(root)
        cfg = RunConfig(
            **dict(DEMO_RL, run_name="bench"), hf_checkpoint=base, prompt_data=data["train"],
            storage_root=os.path.join(root, "store"),
        ).validate()  # fmt: skip
        model, tok = load_hf_checkpoint(base)
        model.eval()
        engine = start_engine_server(base, num_threads=1)
        router = start_router(worker_urls=[engine.url])
        src = RolloutDataSource.from_config(cfg, tokenizer=tok)
        direct = RolloutManager(cfg, tok, src, engine.url)
        routed = RolloutManager(cfg, tok, src, router.url)
        try:
            records = load_prompt_dataset(data["train"], input_key="prompt", label_key="label")[:PROMPTS]
            flat = [r for r in records for _ in range(GROUP)]
            prompts = [tok.encode(r.prompt, add_special_tokens=False) for r in flat]
            seeds = list(range(len(flat)))
            rid = iter(range(10**6))

            recs = [r for r in records]
            group_seeds = [[next(rid) for _ in range(GROUP)] for _ in recs]
            uniq = [tok.encode(r.prompt, add_special_tokens=False) for r in recs]

            def gen_ours(m):  # the manager's generation: tokens in, Samples out, one batched request
                groups = m.generate_groups(recs, uniq, [[s + next(rid) for s in g] for g in group_seeds])
                assert sum(map(len, groups)) == PROMPTS * GROUP

            def gen_base():
                out = hf_generate(model, tok, prompts, 1.0, next(rid))
                assert len(out) == PROMPTS * GROUP

            def ours(m):  # the full rollout: + rewards, filters, metrics
                samples, _ = m.generate(next(rid))
                assert len(samples) == PROMPTS * GROUP

            def baseline():
                _score(cfg, flat, hf_generate(model, tok, prompts, 1.0, next(rid)))

            def per_sample():
                outs = _per_sample_rollout(cfg, direct, router.url, prompts, seeds)
                _score(cfg, flat, [o["text"] for o in outs])

            for f in (lambda: gen_ours(direct), gen_base, lambda: ours(direct), lambda: ours(routed), baseline,
                      per_sample):  # fmt: skip
                for _ in range(3):
                    f()  # warm-up (first calls allocate and fill caches)
            unit = f"s/rollout ({PROMPTS}x{GROUP}, T=1, <={NEW_TOKENS} tok; ratio: x faster"
            t_gen, t_gen_base = median_of(lambda: gen_ours(direct), 9), median_of(gen_base, 9)
            t_gen_routed = median_of(lambda: gen_ours(routed), 9)
            # with rewards the time moves with how many answers need math_verify: medians of 9
            t_direct, t_routed = median_of(lambda: ours(direct), 9), median_of(lambda: ours(routed), 9)
            t_base, t_per = median_of(baseline, 9), median_of(per_sample, 3)
            rss = _peak_rss_mb()
            rows += [
                row("rollout generation: manager -> engine vs batched model.generate", t_gen, t_gen_base,
                    unit + ")", peak_rss_mb=rss),
                row("rollout generation: manager -> router -> engine vs batched model.generate", t_gen_routed,
                    t_gen_base, unit + ")", peak_rss_mb=rss),
                row("rollout incl. rewards: manager.generate vs model.generate + rm_hub", t_direct, t_base,
                    unit + "; medians of 9)", peak_rss_mb=rss),
                row("rollout incl. rewards: manager -> router -> engine vs model.generate + rm_hub", t_routed,
                    t_base, unit + "; medians of 9)", peak_rss_mb=rss),
                row("rollout incl. rewards: batched vs per-sample requests through the router (before)",
                    t_direct, t_per, unit + "; medians)", peak_rss_mb=rss),
            ]  # fmt: skip
            for r in rows:  # ratio = x faster: baseline seconds / ours
                r["ratio"] = r["baseline"] / r["ours"]

            # eval: greedy pass@1 of 512 held-out prompts
            ev = [("eval", data["eval"])]
            kw = dict(n_samples_per_eval_prompt=1, max_new_tokens=NEW_TOKENS, temperature=0.0, rewards=cfg.reward_settings(),
                      input_key="prompt", label_key="label", max_prompts=EVAL_PROMPTS)  # fmt: skip

            def eval_ours():
                return evaluate(None, ev, generate_fn=router_generate_fn(direct), **kw)["eval"]["pass@1"]

            def eval_base():
                def gen(ps, max_new_tokens, temperature, top_p, top_k, n, seed):
                    enc = [tok.encode(p, add_special_tokens=False) for p in ps]
                    return [[t] for t in hf_generate(model, tok, enc, 0.0, seed)]

                return evaluate(None, ev, generate_fn=gen, **kw)["eval"]["pass@1"]

            acc_ours, acc_base = eval_ours(), eval_base()
            t_eval, t_eval_base = median_of(eval_ours, 5), median_of(eval_base, 5)
            r = row(f"eval: greedy pass@1 of {EVAL_PROMPTS} prompts, engine vs batched model.generate",
                    t_eval, t_eval_base, f"s (ratio: x faster; pass@1 {acc_ours:.3f} vs {acc_base:.3f})",
                    peak_rss_mb=_peak_rss_mb())  # fmt: skip
            r["ratio"] = t_eval_base / t_eval
            rows.append(r)
        finally:
            direct.close()
            routed.close()
            router.stop()
            engine.stop()
    return rows


if __name__ == "__main__":
    t0 = time.perf_counter()
    main(run)
    print(f"(bench_rollout: {time.perf_counter() - t0:.1f}s)")
