"""Embedded engine over real HTTP on loopback: SGLang response shapes, log-probs vs a teacher-forced
forward, batching, sampling controls, bad input, auth, size limits."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from loop_helpers import warm_python

from miles_platform.models.checkpoint import load_hf_checkpoint
from miles_platform.rollout.engine_server import start_engine_server


@pytest.fixture(scope="module")
def engine(tiny_hf_checkpoint):
    torch.set_num_threads(1)
    srv = start_engine_server(tiny_hf_checkpoint)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(tiny_hf_checkpoint):
    return load_hf_checkpoint(tiny_hf_checkpoint)


def _gen(url, **body):
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _teacher_forced_logprobs(model, prompt, output):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits.float()
    lp = torch.log_softmax(logits[0, len(prompt) - 1 : -1], dim=-1)
    return lp.gather(1, torch.tensor(output)[:, None])[:, 0]


def test_generate_batch_logprobs_match_teacher_forced_forward(engine, reference):
    model, tok = reference
    prompts = [tok("What is 7+11?")["input_ids"], tok("What is 14+")["input_ids"], [5, 6, 7]]
    out = _gen(
        engine.url,
        input_ids=prompts,
        sampling_params={"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 3},
        return_logprob=True,
    )
    assert isinstance(out, list) and len(out) == 3
    for prompt, res in zip(prompts, out):
        meta = res["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 12}
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 12
        assert meta["weight_version"] == meta["weight_version_start"] == meta["weight_version_end"] == 0
        lps = meta["output_token_logprobs"]
        assert [t for _, t, _ in lps] == res["output_ids"] and all(x is None for _, _, x in lps)
        ref = _teacher_forced_logprobs(model, prompt, res["output_ids"])
        assert torch.allclose(torch.tensor([lp for lp, _, _ in lps]), ref, atol=1e-4)
        assert res["text"] == tok.decode(res["output_ids"], skip_special_tokens=True)


def test_identical_prompts_share_one_prefill_and_sample_independently(engine, reference):
    model, tok = reference
    a, b = tok("What is 7+11?")["input_ids"], [5, 6, 7]
    sp = {"max_new_tokens": 6, "temperature": 1.0}
    seeds = [11, 12, 13, 14]
    before = engine.core.stats["num_shared_prefill_rows"]
    out = _gen(engine.url, input_ids=[a, a, b, a], sampling_params=[{**sp, "sampling_seed": s} for s in seeds],
               return_logprob=True)  # fmt: skip
    assert engine.core.stats["num_shared_prefill_rows"] - before == 2  # a's 2nd and 3rd copy
    assert [r["meta_info"]["cached_tokens"] for r in out] == [0, len(a), 0, len(a)]
    for prompt, seed, res in zip([a, a, b, a], seeds, out, strict=True):
        alone = _gen(engine.url, input_ids=prompt, sampling_params={**sp, "sampling_seed": seed})
        assert alone["output_ids"] == res["output_ids"]  # same seed, same tokens, batch or not
        ref = _teacher_forced_logprobs(model, prompt, res["output_ids"])
        got = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, ref, atol=1e-4)
    assert len({tuple(r["output_ids"]) for r in out}) > 1  # different seeds, different draws


def test_greedy_matches_hf_generate_and_text_input_works(engine, reference):
    model, tok = reference
    prompt = "What is 21+33?"
    res = _gen(engine.url, text=prompt, sampling_params={"max_new_tokens": 10, "temperature": 0})
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hf = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert res["output_ids"] == hf[0, ids.shape[1] :].tolist()
    assert "output_token_logprobs" not in res["meta_info"]  # return_logprob defaults to false, as in SGLang


def test_sampling_seed_reproducible_and_distinct(engine):
    sp = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.95, "top_k": 50}
    a = _gen(engine.url, input_ids=[3, 4, 5], sampling_params={**sp, "sampling_seed": 7})
    b = _gen(engine.url, input_ids=[3, 4, 5], sampling_params={**sp, "sampling_seed": 7})
    c = _gen(engine.url, input_ids=[3, 4, 5], sampling_params={**sp, "sampling_seed": 8})
    assert a["output_ids"] == b["output_ids"] != c["output_ids"]


def test_top_k_one_is_greedy(engine):
    greedy = _gen(engine.url, input_ids=[9, 8, 7], sampling_params={"max_new_tokens": 8, "temperature": 0})
    k1 = _gen(engine.url, input_ids=[9, 8, 7], sampling_params={"max_new_tokens": 8, "top_k": 1})
    assert greedy["output_ids"] == k1["output_ids"]


def test_concurrent_requests_are_batched(engine):
    before = httpx.get(f"{engine.url}/get_server_info").json()["internal_states"][0]

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            reqs = [
                c.post(
                    f"{engine.url}/generate",
                    json={
                        "input_ids": [i + 1, 2, 3],
                        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
                    },
                )
                for i in range(8)
            ]
            return await asyncio.gather(*reqs)

    resps = asyncio.run(run())
    assert all(r.status_code == 200 for r in resps)
    after = httpx.get(f"{engine.url}/get_server_info").json()["internal_states"][0]
    forwards = after["num_forward_calls"] - before["num_forward_calls"]
    assert after["num_batched_forward_calls"] > before["num_batched_forward_calls"]
    assert forwards < 8 * 8 / 2, f"{forwards} forward calls for 64 tokens: requests were not batched"
    assert after["max_batch_size_seen"] >= 4


def test_stop_strings_and_stop_token_ids(engine, reference):
    _, tok = reference
    base = _gen(engine.url, input_ids=[11, 12, 13], sampling_params={"max_new_tokens": 12, "temperature": 0})
    ids = base["output_ids"]
    # stop token: generation ends at (and includes) the first occurrence, as in SGLang
    stop_tok = ids[4]
    res = _gen(
        engine.url,
        input_ids=[11, 12, 13],
        sampling_params={"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop_tok]},
    )
    assert res["output_ids"] == ids[: ids.index(stop_tok) + 1]
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    # stop string: text is cut before the match, output_ids keep the tokens that produced it
    text = base["text"]
    stop = tok.decode(ids[5:7])
    assert stop and stop in text
    res = _gen(
        engine.url,
        input_ids=[11, 12, 13],
        sampling_params={"max_new_tokens": 12, "temperature": 0, "stop": stop},
    )
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert res["text"] == text[: text.find(stop)]
    assert len(res["output_ids"]) <= 7


@pytest.mark.parametrize(
    "body, needle",
    [
        (b"{not json", "malformed JSON"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "temprature": 1}}, "temprature"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1] * 300}, "context length"),
        ({"input_ids": [1, 99999]}, "out of vocabulary"),
        ({"input_ids": [1, 2], "bogus": 1}, "bogus"),
        ({"sampling_params": {}}, "text"),
    ],
)
def test_bad_input_is_400_and_engine_keeps_serving(engine, body, needle):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{engine.url}/generate", timeout=30, **kw)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert (
        _gen(engine.url, input_ids=[1, 2], sampling_params={"max_new_tokens": 2, "ignore_eos": True})[
            "meta_info"
        ]["completion_tokens"]
        == 2
    )


@pytest.mark.filterwarnings("ignore:Duplicate Operation ID")  # FastAPI's ids of a GET+POST route
def test_every_route_but_health_needs_the_run_key(engine):
    """Each router of the app (generate, OpenAI, health/info, weights, LoRA, control) sits behind the
    guard: without the key, or with a wrong one, every route and method answers 401 before it acts."""
    from fastapi.testclient import TestClient

    from miles_platform.rollout.engine_server import create_app

    app = create_app(engine.core, api_key="s3cret", weight_roots=["/nowhere"])
    routes = [(p, m) for p, ops in app.openapi()["paths"].items() for m in ops]
    assert {"/generate", "/v1/chat/completions", "/update_weights_from_disk", "/load_lora_adapter",
            "/pause_generation", "/get_server_info"} <= {p for p, _ in routes}  # fmt: skip
    with TestClient(app) as client:
        for path, method in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = client.request(method, path, json={"mode": "abort"}, headers=headers)
                want = 200 if (path, method) == ("/health", "get") else 401
                assert r.status_code == want, (method, path, r.status_code)
    assert not engine.core.paused and engine.core.is_alive()  # the refused /pause_generation did nothing


def test_api_key_and_request_size_limit(engine):
    guarded = start_engine_server(core=engine.core, api_key="s3cret", max_request_bytes=2000)
    try:
        assert httpx.get(f"{guarded.url}/health").status_code == 200  # liveness probes stay open
        for path in ("/get_model_info", "/get_server_info", "/health_generate"):
            assert httpx.get(f"{guarded.url}{path}").status_code == 401, path
        hijack = {"model_path": "/tmp", "weight_version": 99}  # the hijack of issue 19: refused
        assert httpx.post(f"{guarded.url}/update_weights_from_disk", json=hijack).status_code == 401
        assert httpx.post(f"{guarded.url}/health", json={}).status_code in (401, 405)
        r = httpx.post(
            f"{guarded.url}/generate", json={"input_ids": [1, 2]}, headers={"Authorization": "Bearer no"}
        )
        assert r.status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{guarded.url}/get_model_info", headers=auth).status_code == 200
        lower = {"Authorization": "bearer s3cret"}  # the scheme is case-insensitive (RFC 7235)
        assert httpx.get(f"{guarded.url}/get_model_info", headers=lower).status_code == 200
        assert (
            httpx.get(f"{guarded.url}/get_model_info", headers={"Authorization": "Basic s3cret"}).status_code
            == 401
        )
        r = httpx.post(f"{guarded.url}/generate", json={"input_ids": [1] * 1000}, headers=auth)
        assert r.status_code == 413
        ok = httpx.post(f"{guarded.url}/generate", json={"input_ids": [1, 2]}, headers=auth, timeout=30)
        assert ok.status_code == 200
    finally:
        guarded.stop()
    assert engine.core.is_alive()  # stopping a server that borrowed the core leaves the core running


def test_info_endpoints(engine, tiny_hf_checkpoint):
    assert httpx.get(f"{engine.url}/health").status_code == 200
    assert httpx.get(f"{engine.url}/health_generate").status_code == 200
    info = httpx.get(f"{engine.url}/get_model_info").json()
    assert info["model_path"] == tiny_hf_checkpoint and info["is_generation"] and info["weight_version"] == 0
    assert httpx.post(f"{engine.url}/flush_cache").status_code == 200


def test_cli_serve_engine_serves_and_stops_on_sigterm(tiny_hf_checkpoint):
    import signal
    import subprocess
    import time

    from miles_platform.rollout.engine_server import bind_socket

    with bind_socket("127.0.0.1", 0) as s:
        port = s.getsockname()[1]
    cmd = [*warm_python(), "-m", "miles_platform.cli", "serve-engine", "--hf-checkpoint", tiny_hf_checkpoint]
    proc = subprocess.Popen(cmd + ["--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        res = _gen(
            f"http://127.0.0.1:{port}",
            input_ids=[1, 2],
            sampling_params={"max_new_tokens": 3, "ignore_eos": True},
        )
        assert res["meta_info"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_engine_refuses_a_transformers_without_the_cache_argument():
    """transformers 5.17 names the KV cache `past_key_values` and silently drops `cache=`: decode
    would run without context. The engine refuses such a model at load instead."""
    from miles_platform.errors import MilesError
    from miles_platform.rollout.engine_weights import check_cache_kwarg

    class OldForward(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return None

    with pytest.raises(MilesError, match="takes no `cache` argument"):
        check_cache_kwarg(OldForward())
