"""Batched `/generate` end to end: the rollout manager sends SGLang's list form (checked by a
stand-in SGLang server that accepts only SGLang's fields), the router splits a batch over engines
and joins the results in prompt order (a streamed group goes whole to one engine), and a seeded batch
gives the same tokens however it is routed or streamed."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from miles_platform.config import RunConfig
from miles_platform.data.dataset import PromptRecord
from miles_platform.models.checkpoint import load_tokenizer
from miles_platform.rollout.engine_server import serve_in_thread, start_engine_server
from miles_platform.rollout.evaluate import engine_generate_fn
from miles_platform.rollout.manager import RolloutManager, router_generate_fn
from miles_platform.rollout.router import start_router

# SGLang's GenerateReqInput / SamplingParams field names (the subset a batch may carry)
# (+ return_sampling_mask: sglang-miles, SGLang PR #40932, for sampling-support replay)
SGLANG_BODY = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "stream",
               "return_sampling_mask"}  # fmt: skip
SGLANG_SAMPLING = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
                   "ignore_eos", "skip_special_tokens", "sampling_seed", "n"}  # fmt: skip


def stand_in_sglang(requests: list[dict]):
    """Answers like SGLang (a list for a batch; `output_token_logprobs` as [logprob, id, None];
    no `output_ids`) and refuses any body a real server would not take."""
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        requests.append(body)
        if set(body) - SGLANG_BODY:
            return JSONResponse({"error": f"unknown fields {set(body) - SGLANG_BODY}"}, status_code=400)
        ids, sps = body["input_ids"], body["sampling_params"]
        if not (isinstance(ids, list) and all(isinstance(x, list) for x in ids)):
            return JSONResponse({"error": "want a batch"}, status_code=400)
        if not isinstance(sps, list) or len(sps) != len(ids) or any(set(p) - SGLANG_SAMPLING for p in sps):
            return JSONResponse({"error": "sampling_params must be a list of SGLang params"}, status_code=400)
        out = []
        for prompt, sp in zip(ids, sps, strict=True):
            toks = [(prompt[-1] + sp["sampling_seed"] + k) % 7 + 3 for k in range(2)]
            meta = {"finish_reason": {"type": "length", "length": 2}, "prompt_tokens": len(prompt),
                    "completion_tokens": 2, "weight_version": "3"}  # fmt: skip
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [[-0.5, t, None] for t in toks]
            if body.get("return_sampling_mask"):
                meta["output_token_sampling_mask"] = [sorted({t, 3, 4}) for t in toks]
                meta["output_token_sampling_logprobs"] = [-0.25 for _ in toks]
            out.append({"text": "x" * len(toks), "meta_info": meta})
        return out

    return serve_in_thread(app, "127.0.0.1", 0, "stand-in-sglang")


def _cfg(ckpt, tmp_path, **kw) -> RunConfig:
    return RunConfig(
        hf_checkpoint=ckpt, prompt_data=str(tmp_path / "p.jsonl"), rm_type="math", rollout_batch_size=3,
        n_samples_per_prompt=4, rollout_max_response_len=4, storage_root=str(tmp_path / "root"), **kw,
    ).validate()  # fmt: skip


RECORDS = [PromptRecord(id=f"p{i}", prompt=f"{i}+{i}=", label=str(2 * i), metadata={}) for i in range(3)]


def test_manager_sends_one_sglang_batch_per_round(tiny_hf_checkpoint, tmp_path):
    seen: list[dict] = []
    server = stand_in_sglang(seen)
    tok = load_tokenizer(tiny_hf_checkpoint)
    m = RolloutManager(_cfg(tiny_hf_checkpoint, tmp_path), tok, None, server.url)
    try:
        prompts = [tok.encode(r.prompt, add_special_tokens=False) for r in RECORDS]
        seeds = [[10 * g + k for k in range(4)] for g in range(3)]
        groups = m.generate_groups(RECORDS, prompts, seeds)
    finally:
        m.close()
        server.stop()
    assert len(seen) == 1 and len(seen[0]["input_ids"]) == 12  # one request, every sample
    assert seen[0]["input_ids"][:4] == [prompts[0]] * 4 and seen[0]["return_logprob"] is True
    assert [p["sampling_seed"] for p in seen[0]["sampling_params"]] == [s for g in seeds for s in g]
    assert [len(g) for g in groups] == [4, 4, 4]
    s = groups[1][2]  # group 1, sample 2: token ids recovered from output_token_logprobs
    assert s.prompt == "1+1=" and s.response_tokens == [(prompts[1][-1] + 12 + k) % 7 + 3 for k in range(2)]
    assert s.rollout_log_probs == [-0.5, -0.5] and s.weight_version_start == s.weight_version_end == 3
    assert "return_sampling_mask" not in seen[0] and s.rollout_sampling_support is None


def test_top_k_rollouts_ask_sglang_for_the_sampling_support(tiny_hf_checkpoint, tmp_path):
    seen: list[dict] = []
    server = stand_in_sglang(seen)
    tok = load_tokenizer(tiny_hf_checkpoint)
    m = RolloutManager(
        _cfg(tiny_hf_checkpoint, tmp_path, rollout_top_k=8, rollout_top_p=0.9), tok, None, server.url
    )
    try:
        prompts = [tok.encode(r.prompt, add_special_tokens=False) for r in RECORDS]
        groups = m.generate_groups(RECORDS, prompts, [[1, 2, 3, 4]] * 3)
    finally:
        m.close()
        server.stop()
    assert seen[0]["return_sampling_mask"] is True
    assert all(p["top_k"] == 8 and p["top_p"] == 0.9 for p in seen[0]["sampling_params"])
    s = groups[0][0]  # the support-normalized log-prob is the rollout log-prob (Miles)
    assert s.rollout_log_probs == [-0.25, -0.25]
    assert s.rollout_sampling_support == [sorted({t, 3, 4}) for t in s.response_tokens]


def test_router_splits_a_batch_over_engines_in_prompt_order(tiny_hf_checkpoint, tmp_path):
    engines = [start_engine_server(tiny_hf_checkpoint, num_threads=1) for _ in range(2)]
    router = start_router(worker_urls=[e.url for e in engines], health_check_interval_s=0.2)
    tok = load_tokenizer(tiny_hf_checkpoint)
    cfg = _cfg(tiny_hf_checkpoint, tmp_path)
    direct, routed = (RolloutManager(cfg, tok, None, u) for u in (engines[0].url, router.url))
    try:
        prompts = [tok.encode(r.prompt, add_special_tokens=False) for r in RECORDS]
        seeds = [[100 + 10 * g + k for k in range(4)] for g in range(3)]
        before = [e.core.stats["num_finished_requests"] for e in engines]
        via_router = routed.generate_groups(RECORDS, prompts, seeds)
        served = [e.core.stats["num_finished_requests"] - b for e, b in zip(engines, before, strict=True)]
        assert served == [6, 6]  # one contiguous half each
        via_one = direct.generate_groups(RECORDS, prompts, seeds)
        flat = lambda gs: [(s.prompt, s.response_tokens, s.rollout_log_probs) for g in gs for s in g]  # noqa: E731
        assert [x[:2] for x in flat(via_router)] == [x[:2] for x in flat(via_one)]
        for (_, _, a), (_, _, b) in zip(flat(via_router), flat(via_one), strict=True):
            assert a == pytest.approx(b, abs=1e-5)
        # --fully-async's `sample` granularity: the groups that can go out as one streamed request
        # through the router, whole to one engine, each sample handed over as it finishes; the same
        # tokens (per-sample seeds), each group's 4 samples prefilled once (counted)
        shared = [e.core.stats["num_shared_prefill_rows"] for e in engines]
        before = [e.core.stats["num_finished_requests"] for e in engines]
        got: dict[tuple[int, int], object] = {}

        async def streamed():
            await routed.agenerate_groups_streamed(
                RECORDS, prompts, seeds, lambda g, k, s: got.setdefault((g, k), s)
            )

        asyncio.run(streamed())
        assert sorted(got) == [(g, k) for g in range(3) for k in range(4)]
        via_stream = [[got[g, k] for k in range(4)] for g in range(3)]
        assert [x[:2] for x in flat(via_stream)] == [x[:2] for x in flat(via_one)]
        for (_, _, a), (_, _, b) in zip(flat(via_stream), flat(via_one), strict=True):
            assert a == pytest.approx(b, abs=1e-5)
        served = sorted(
            e.core.stats["num_finished_requests"] - b for e, b in zip(engines, before, strict=True)
        )
        assert served == [0, 12]  # not split: one engine streams the batch
        assert sum(e.core.stats["num_shared_prefill_rows"] for e in engines) - sum(shared) == 3 * 3
        # the in-loop eval path: one batch, n per prompt, texts back in prompt order
        texts = router_generate_fn(routed)(["1+1=", "2+2=", "3+3="], 3, 0.0, 1.0, -1, 2, 0)
        assert len(texts) == 3 and all(len(t) == 2 and t[0] == t[1] for t in texts)  # greedy twice
        # ... and its samples are those of `evaluate`'s in-process engine (one sampler, one seeding)
        sampled = ["1+1=", "2+2=", "3+3="], 4, 0.9, 0.8, 12, 3, 5
        assert router_generate_fn(routed)(*sampled) == engine_generate_fn(engines[1].core)(*sampled)
        # an error in one chunk is the answer (not a partial list)
        bad = {"input_ids": [[1, 2], [10**6]], "sampling_params": [{}, {}]}
        r = httpx.post(f"{router.url}/generate", json=bad, timeout=30)
        assert r.status_code == 400 and "out of vocabulary" in r.text
    finally:
        direct.close()
        routed.close()
        router.stop()
        for e in engines:
            e.stop()
