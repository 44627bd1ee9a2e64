"""Engine control plane over HTTP: weight updates (disk and in-process), policy-version constraints
(409), pause_generation abort / retract / in_place."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch
from engine_hooks import HoldScheduler, every_request_has_tokens, until

from miles_platform.errors import CheckpointError
from miles_platform.models.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from miles_platform.models.qwen3 import build_model
from miles_platform.rollout import client
from miles_platform.rollout.engine_server import start_engine_server

GREEDY = {"max_new_tokens": 8, "temperature": 0}


@pytest.fixture()
def engine(tiny_hf_checkpoint):
    srv = start_engine_server(tiny_hf_checkpoint)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def other_checkpoint(tiny_hf_checkpoint, tmp_path_factory):
    """Same architecture and tokenizer, different weights (seed 1)."""
    model, tok = load_hf_checkpoint(tiny_hf_checkpoint)
    path = tmp_path_factory.mktemp("ckpt") / "other"
    save_hf_checkpoint(build_model(model.config, seed=1), tok, path)
    return str(path)


def _gen(url, **body):
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_update_weights_from_disk_bumps_version_and_changes_outputs(engine, other_checkpoint, tmp_path):
    before = _gen(engine.url, input_ids=[1, 2, 3], sampling_params=GREEDY)
    r = httpx.post(
        f"{engine.url}/update_weights_from_disk", json={"model_path": other_checkpoint}, timeout=60
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    after = _gen(engine.url, input_ids=[1, 2, 3], sampling_params=GREEDY, return_logprob=True)
    assert after["meta_info"]["weight_version"] == 1
    assert after["output_ids"] != before["output_ids"]
    # the served log-probs are the new model's
    new_model, _ = load_hf_checkpoint(other_checkpoint)
    with torch.no_grad():
        logits = new_model(torch.tensor([[1, 2, 3] + after["output_ids"]])).logits.float()
    ref = torch.log_softmax(logits[0, 2:-1], -1).gather(1, torch.tensor(after["output_ids"])[:, None])[:, 0]
    got = torch.tensor([lp for lp, _, _ in after["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, ref, atol=1e-4)

    # failed updates keep the old weights and version: a missing dir, then mismatched shapes
    small = build_model(
        new_model.config.__class__(**{**new_model.config.to_dict(), "hidden_size": 48}), seed=2
    )
    save_hf_checkpoint(small, None, tmp_path / "mismatch")
    for bad in (str(tmp_path / "missing"), str(tmp_path / "mismatch")):
        r = httpx.post(
            f"{engine.url}/update_weights_from_disk", json={"model_path": bad, "weight_version": 9}
        )
        assert r.status_code == 400 and not r.json()["success"], r.text
        assert bad in r.json()["message"]
        again = _gen(engine.url, input_ids=[1, 2, 3], sampling_params=GREEDY)
        assert again["output_ids"] == after["output_ids"] and again["meta_info"]["weight_version"] == 1

    r = httpx.post(
        f"{engine.url}/update_weights_from_disk", json={"model_path": other_checkpoint, "weight_version": 7}
    )
    assert r.status_code == 200 and httpx.get(f"{engine.url}/get_model_info").json()["weight_version"] == 7


def test_update_weights_from_tensors_roundtrip_and_validation(engine, other_checkpoint):
    core = engine.core
    new_model, _ = load_hf_checkpoint(other_checkpoint)
    named = {n: p.detach().clone() for n, p in new_model.named_parameters()}
    old = core.get_weights()
    with pytest.raises(CheckpointError, match="nope"):
        core.update_weights_from_tensors({"nope": torch.zeros(1)}, weight_version=3)
    first = next(iter(named))
    with pytest.raises(CheckpointError, match="shape"):
        core.update_weights_from_tensors({first: torch.zeros(1, 2)}, weight_version=3)
    assert core.weight_version == 0
    assert all(torch.equal(old[n], t) for n, t in core.get_weights().items())
    core.update_weights_from_tensors(named, weight_version=3)
    assert core.weight_version == 3
    assert all(torch.equal(named[n], t) for n, t in core.get_weights().items())


def test_weight_version_constraints_409_and_client_retry(engine, other_checkpoint):
    url = engine.url
    for field in ("min_weight_version", "exact_weight_version"):
        r = httpx.post(f"{url}/generate", json={"input_ids": [1, 2], field: 1})
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["retryable"] and err["weight_version"] == 0 and err[field] == 1
    ok = _gen(url, input_ids=[1, 2], exact_weight_version=0, sampling_params={"max_new_tokens": 2})
    assert ok["meta_info"]["weight_version_start"] == ok["meta_info"]["weight_version_end"] == 0

    async def wait_for_v1():
        statuses: list[int] = []
        refused = asyncio.Event()  # set on the client's second 409: it got one and came back

        async def count_409(resp):
            statuses.append(resp.status_code)
            if statuses.count(409) >= 2:
                refused.set()

        async with httpx.AsyncClient(timeout=60, event_hooks={"response": [count_409]}) as ac:
            task = asyncio.create_task(
                client.generate(url, [1, 2], {"max_new_tokens": 2}, min_weight_version=1, client=ac)
            )
            await asyncio.wait_for(refused.wait(), 30)
            assert not task.done()  # retrying on 409
            r = await asyncio.to_thread(
                httpx.post,
                f"{url}/update_weights_from_disk",
                json={"model_path": other_checkpoint},
                timeout=60,
            )
            assert r.status_code == 200
            return await task

    res = asyncio.run(wait_for_v1())
    assert res["meta_info"]["weight_version"] == res["meta_info"]["weight_version_start"] == 1


def _start_long_requests(url, held: HoldScheduler, n=3, max_new_tokens=150):
    """Fire n long greedy requests; return (loop, tasks) once `held` holds the scheduler (with
    `every_request_has_tokens(n)`: each request mid-generation)."""
    loop = asyncio.new_event_loop()
    ac = httpx.AsyncClient(timeout=60)
    tasks = [
        loop.create_task(
            ac.post(
                f"{url}/generate",
                json={
                    "input_ids": [i + 3, 4, 5],
                    "return_logprob": True,
                    "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
                },
            )
        )
        for i in range(n)
    ]
    loop.run_until_complete(asyncio.to_thread(held.wait))  # the loop sends the requests meanwhile
    return loop, tasks


def _stats(url):
    return httpx.get(f"{url}/get_server_info").json()["internal_states"][0]


def _finish(loop, tasks):
    resps = loop.run_until_complete(asyncio.gather(*tasks))
    loop.close()
    assert all(r.status_code == 200 for r in resps)
    return [r.json() for r in resps]


def test_pause_abort_returns_partial_output(engine):
    url = engine.url
    with HoldScheduler(engine.core, every_request_has_tokens(3)) as held:
        loop, tasks = _start_long_requests(url, held)
        assert httpx.post(f"{url}/pause_generation", json={"mode": "abort"}).status_code == 200
    for res in _finish(loop, tasks):
        assert res["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < res["meta_info"]["completion_tokens"] < 150
        assert len(res["meta_info"]["output_token_logprobs"]) == len(res["output_ids"])
    httpx.post(f"{url}/continue_generation")
    assert (
        _gen(url, input_ids=[1, 2], sampling_params={"max_new_tokens": 2, "ignore_eos": True})["meta_info"][
            "completion_tokens"
        ]
        == 2
    )


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_retract_and_in_place_resume_to_the_same_result(engine, mode):
    url = engine.url
    reference = [
        _gen(
            url,
            input_ids=[i + 3, 4, 5],
            sampling_params={"max_new_tokens": 150, "temperature": 0},
            return_logprob=True,
        )
        for i in range(3)
    ]
    with HoldScheduler(engine.core, every_request_has_tokens(3)) as held:
        loop, tasks = _start_long_requests(url, held)
        assert httpx.post(f"{url}/pause_generation", json={"mode": mode}).status_code == 200
        stats = _stats(url)
    # released: a paused scheduler must now make no progress (an absence, so it takes a wait)
    loop.run_until_complete(asyncio.sleep(0.1))
    frozen = _stats(url)
    assert frozen["num_generated_tokens"] == stats["num_generated_tokens"]  # paused means no progress
    assert not any(t.done() for t in tasks), [t.result().text[:300] for t in tasks if t.done()]
    assert httpx.post(f"{url}/continue_generation").status_code == 200
    results = _finish(loop, tasks)
    after = _stats(url)
    for res, ref in zip(results, reference):
        assert res["meta_info"]["finish_reason"] == {"type": "length", "length": 150}
        assert res["output_ids"] == ref["output_ids"]
        got = torch.tensor([x[0] for x in res["meta_info"]["output_token_logprobs"]])
        want = torch.tensor([x[0] for x in ref["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, want, atol=1e-4)
    prefills = after["num_prefill_calls"] - stats["num_prefill_calls"]
    # retract recomputes the dropped KV (a new prefill); in_place resumes on the existing cache
    assert prefills >= 1 if mode == "retract" else prefills == 0


def test_bad_pause_mode_is_400(engine):
    r = httpx.post(f"{engine.url}/pause_generation", json={"mode": "sleep"})
    assert r.status_code == 400 and "in_place" in r.json()["error"]["message"]


def test_engine_actor_body_serves_http_and_takes_tensor_updates(tiny_hf_checkpoint, other_checkpoint):
    from miles_platform.rollout.engine_server import EngineActor

    actor = EngineActor(tiny_hf_checkpoint)  # what ray.remote(EngineActor) runs inside the actor
    try:
        url = actor.url()
        before = _gen(url, input_ids=[1, 2, 3], sampling_params=GREEDY)
        new_model, _ = load_hf_checkpoint(other_checkpoint)
        named = {n: p.detach().clone() for n, p in new_model.named_parameters()}
        assert actor.update_weights_from_tensors(named, weight_version=4) == 4 == actor.get_weight_version()
        after = _gen(url, input_ids=[1, 2, 3], sampling_params=GREEDY)
        assert after["meta_info"]["weight_version"] == 4 and after["output_ids"] != before["output_ids"]
    finally:
        actor.shutdown()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantized_checkpoint_is_served_dequantized(engine, tiny_hf_checkpoint, tmp_path, fmt):
    quantize = pytest.importorskip("miles_platform.weights.quantize")
    qdir = str(tmp_path / fmt)
    quantize.quantize_checkpoint(tiny_hf_checkpoint, qdir, fmt=fmt, group_size=16)
    assert httpx.get(f"{engine.url}/get_server_info").json()["quantization"] is None
    r = httpx.post(f"{engine.url}/update_weights_from_disk", json={"model_path": qdir}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{engine.url}/get_server_info").json()["quantization"] == fmt  # SGLang's field
    res = _gen(engine.url, input_ids=[1, 2, 3], sampling_params=GREEDY, return_logprob=True)
    ref, _ = load_hf_checkpoint(tiny_hf_checkpoint)
    ref.load_state_dict(quantize.load_dequantized_state_dict(qdir, torch.float32), strict=False)
    with torch.no_grad():
        logits = ref(torch.tensor([[1, 2, 3] + res["output_ids"]])).logits.float()
    want = torch.log_softmax(logits[0, 2:-1], -1).gather(1, torch.tensor(res["output_ids"])[:, None])[:, 0]
    got = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, want, atol=1e-4)
    # an engine can also start from the quantized dir
    srv = start_engine_server(qdir)
    try:
        again = _gen(srv.url, input_ids=[1, 2, 3], sampling_params=GREEDY)
        assert again["output_ids"] == res["output_ids"]
    finally:
        srv.stop()


def test_running_exact_version_request_fails_409_when_weights_change(engine, other_checkpoint):
    url = engine.url
    # ignore_eos: the request must still be running when the update lands (a random model may stop early)
    body = {
        "input_ids": [1, 2, 3],
        "exact_weight_version": 0,
        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
    }
    new_model, _ = load_hf_checkpoint(other_checkpoint)
    named = {n: p.detach().clone() for n, p in new_model.named_parameters()}

    def update_mid_generation(core):  # on the scheduler thread, between two decode steps
        if core.weight_version == 0 and any(r.output_tokens >= 3 for r in core.running()):
            core.update_weights_from_tensors(named, 1)

    engine.core.step_hook = update_mid_generation
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    engine.core.step_hook = None
    assert r.status_code == 409, r.text
    assert r.json()["error"]["exact_weight_version"] == 0 and r.json()["error"]["weight_version"] == 1


def test_disk_updates_only_from_allowed_roots_and_only_forward(tiny_hf_checkpoint, other_checkpoint):
    import os

    srv = start_engine_server(tiny_hf_checkpoint, weight_roots=[os.path.dirname(other_checkpoint)])
    try:
        url = f"{srv.url}/update_weights_from_disk"
        for outside in ("/etc", "/tmp", os.path.join(os.path.dirname(other_checkpoint), "..")):
            r = httpx.post(url, json={"model_path": outside, "weight_version": 5}, timeout=30)
            assert r.status_code == 403 and "outside the directories" in r.text, (outside, r.text)
        ok = httpx.post(url, json={"model_path": other_checkpoint, "weight_version": 5}, timeout=60)
        assert ok.status_code == 200, ok.text
        r = httpx.post(url, json={"model_path": other_checkpoint, "weight_version": 4}, timeout=60)
        assert r.status_code == 400 and "only move forward" in r.text
        # numbers no version can be: refused before anything loads (2^70 and 1e308 were accepted, and
        # every /generate after them answered 500)
        for bad in (-1, 2**70, 1e308, 7.5, "NaN", "1e3", True, [6], {"v": 6}):
            r = httpx.post(url, json={"model_path": other_checkpoint, "weight_version": bad}, timeout=60)
            assert r.status_code == 400 and "must be a whole number in [0, 2^53 - 1]" in r.text, (bad, r.text)
        assert httpx.get(f"{srv.url}/get_model_info").json()["weight_version"] == 5
        g = httpx.post(
            f"{srv.url}/generate", json={"text": "1+1=", "sampling_params": {"max_new_tokens": 2}}, timeout=60
        )
        assert g.status_code == 200 and g.json()["meta_info"]["weight_version"] == 5
        ok = httpx.post(url, json={"model_path": other_checkpoint, "weight_version": "6"}, timeout=60)
        assert ok.status_code == 200 and ok.json()["weight_version"] == 6  # SGLang sends a string
    finally:
        srv.stop()


def test_a_huge_prompt_is_refused_before_tokenizing(engine):
    r = httpx.post(f"{engine.url}/generate", json={"text": "1+1=" * 2_000_000}, timeout=30)
    assert r.status_code == 400 and "cannot fit the context length" in r.text
    assert httpx.get(f"{engine.url}/health", timeout=5).status_code == 200


def test_weight_group_joins_to_a_dead_port_are_bounded_and_do_not_pile_up(engine, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from miles_platform.cluster.ports import free_port
    from miles_platform.rollout import engine_weights

    monkeypatch.setattr(engine_weights, "GROUP_JOIN_TIMEOUT_S", 1.0)
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "group_name": "g", "backend": "gloo"}  # fmt: skip
    with ThreadPoolExecutor(4) as pool:
        t0 = time.monotonic()
        rs = list(pool.map(lambda _: httpx.post(f"{engine.url}/init_weights_update_group", json=body, timeout=60),
                           range(4)))  # fmt: skip
        took = time.monotonic() - t0
    msgs = [r.json()["message"] for r in rs]
    assert all(r.status_code == 400 for r in rs), msgs
    assert sum("another join is in progress" in m for m in msgs) >= 1, msgs
    assert took < 30, took  # bounded by the join timeout, not 4 x 120 s


@pytest.fixture()
def impatient_engine(tiny_hf_checkpoint):
    """An engine that holds a request on a pause for 0.5 s at most."""
    srv = start_engine_server(tiny_hf_checkpoint, pause_wait_timeout_s=0.5)
    yield srv
    srv.stop()


def _paused_503(resp, limit_s: float) -> dict:
    assert resp.status_code == 503, resp.text
    err = resp.json()["error"]
    assert err["type"] == "engine_paused" and err["retryable"], err
    assert err["paused_for_s"] >= limit_s and "has been paused for" in err["message"], err
    return err


def test_a_request_waiting_on_a_paused_engine_gets_503_after_the_limit(impatient_engine):
    url = impatient_engine.url
    body = {"input_ids": [1, 2, 3], "sampling_params": GREEDY}
    # frozen in place mid-generation: held since the pause
    with HoldScheduler(impatient_engine.core, every_request_has_tokens(3)) as held:
        loop, tasks = _start_long_requests(url, held)
        t0 = time.monotonic()
        assert httpx.post(f"{url}/pause_generation", json={"mode": "in_place"}).status_code == 200
    resps = loop.run_until_complete(asyncio.gather(*tasks))
    took = time.monotonic() - t0
    loop.close()
    for r in resps:
        assert "--pause-wait-timeout-s 0.5" in _paused_503(r, 0.5)["message"]
    assert 0.5 <= took < 5, took
    # a new request on the still-paused engine: held since it arrived
    t0 = time.monotonic()
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    took = time.monotonic() - t0
    _paused_503(r, 0.5)
    assert 0.5 <= took < 5, took
    assert _stats(url)["num_pause_timeouts"] == 4
    # the engine still serves once continued (nothing was left in its batch or queue)
    assert httpx.post(f"{url}/continue_generation").status_code == 200
    assert _gen(url, **body)["meta_info"]["completion_tokens"] > 0
    assert httpx.get(f"{url}/get_server_info").json()["num_inflight"] == 0


def test_waiters_beyond_the_bound_get_503_at_once_and_continue_releases_the_rest(tiny_hf_checkpoint):
    srv = start_engine_server(tiny_hf_checkpoint, pause_wait_timeout_s=60, pause_max_queued_requests=2)
    url, core = srv.url, srv.core
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    loop = asyncio.new_event_loop()
    try:
        assert httpx.post(f"{url}/pause_generation", json={"mode": "abort"}).status_code == 200
        ac = httpx.AsyncClient(timeout=60)
        waiters = [loop.create_task(ac.post(f"{url}/generate", json=body)) for _ in range(2)]
        loop.run_until_complete(asyncio.to_thread(until, lambda: core.num_inflight() == 2))
        t0 = time.monotonic()
        over = [httpx.post(f"{url}/generate", json=body, timeout=60),  # a third prompt
                httpx.post(f"{url}/generate", json={**body, "input_ids": [[1, 2], [3, 4]]}, timeout=60)]  # fmt: skip
        took = time.monotonic() - t0
        for r in over:
            err = _paused_503(r, 0.0)
            assert (
                "2 requests already wait" in err["message"]
                and "--pause-max-queued-requests 2" in err["message"]
            )
        assert took < 5, took  # at once, not after the 60 s wait
        assert not any(t.done() for t in waiters)
        assert httpx.post(f"{url}/continue_generation").status_code == 200
        done = loop.run_until_complete(asyncio.gather(*waiters))
        assert [r.status_code for r in done] == [200, 200], [r.text for r in done]
        assert all(r.json()["meta_info"]["completion_tokens"] == 4 for r in done)
        loop.run_until_complete(ac.aclose())
        assert _stats(url)["num_pause_queue_full"] == 3 and _stats(url)["num_pause_timeouts"] == 0
    finally:
        loop.close()
        srv.stop()


def test_the_router_passes_a_paused_engines_503_through_and_keeps_the_worker(impatient_engine):
    from miles_platform.rollout.router import start_router

    rt = start_router(worker_urls=[impatient_engine.url])
    try:
        assert httpx.post(f"{rt.url}/pause_generation", json={"mode": "abort"}).status_code == 200
        r = httpx.post(
            f"{rt.url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": GREEDY}, timeout=60
        )
        _paused_503(r, 0.5)  # the engine's answer, for the client to retry (client.RETRYABLE_STATUS)
        (worker,) = httpx.get(f"{rt.url}/list_workers").json()["workers"]
        assert worker["healthy"] and worker["failures"] == 0, worker  # alive: not taken out of rotation
        assert httpx.post(f"{rt.url}/continue_generation").status_code == 200
        ok = httpx.post(
            f"{rt.url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": GREEDY}, timeout=60
        )
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] > 0
    finally:
        rt.stop()


@pytest.mark.parametrize(
    "flag,value", [("--pause-wait-timeout-s", "0"), ("--pause-wait-timeout-s", "nan"),
                   ("--pause-wait-timeout-s", "-1"), ("--pause-max-queued-requests", "0")],
)  # fmt: skip
def test_pause_limits_are_validated_before_the_engine_loads(flag, value, capsys, tmp_path):
    from miles_platform.errors import ConfigError
    from miles_platform.rollout.engine_core import EngineCore
    from miles_platform.rollout.engine_server import cli_main

    with pytest.raises(SystemExit) as exit_:  # argparse's usage error, before the checkpoint is read
        cli_main(["--hf-checkpoint", str(tmp_path / "never-read"), flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and flag in err and "must be" in err, err
    number = float(value) if "timeout" in flag else int(value)
    with pytest.raises(ConfigError, match=flag):  # the Python API too, before it loads anything
        EngineCore(str(tmp_path / "never-read"), **{flag.removeprefix("--").replace("-", "_"): number})
