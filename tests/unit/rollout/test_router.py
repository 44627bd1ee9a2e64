"""Router over two real engines on loopback: load spreading, broadcast, failover and recovery, auth."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from miles_platform.rollout.engine_server import start_engine_server
from miles_platform.rollout.router import start_router


@pytest.fixture()
def fleet(tiny_hf_checkpoint):
    engines = [start_engine_server(tiny_hf_checkpoint) for _ in range(2)]
    router = start_router(
        worker_urls=[engines[0].url], health_check_interval_s=0.1, max_concurrency_per_worker=2
    )
    yield router, engines
    router.stop()
    for e in engines:
        e.stop()


def _workers(router):
    return {w["url"]: w for w in httpx.get(f"{router.url}/list_workers").json()["workers"]}


def _burst(url, n, max_new_tokens=6):
    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": max_new_tokens}}
            return await asyncio.gather(*(c.post(f"{url}/generate", json=body) for _ in range(n)))

    return asyncio.run(run())


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_router_spreads_load_broadcasts_and_survives_a_dead_engine(fleet, tiny_hf_checkpoint):
    router, (a, b) = fleet
    # add_worker by query string (sgl-router style); list_workers shows both
    assert httpx.post(f"{router.url}/add_worker", params={"url": b.url}).status_code == 200
    assert set(httpx.get(f"{router.url}/list_workers").json()["urls"]) == {a.url, b.url}

    resps = _burst(router.url, 8)
    assert all(r.status_code == 200 for r in resps)
    served = {u: w["served"] for u, w in _workers(router).items()}
    assert served[a.url] > 0 and served[b.url] > 0, served

    # broadcast: pause reaches both engines, continue releases both
    r = httpx.post(f"{router.url}/pause_generation", json={"mode": "retract"})
    assert r.status_code == 200 and len(r.json()["results"]) == 2
    assert a.core.paused and b.core.paused
    assert httpx.post(f"{router.url}/continue_generation").status_code == 200
    assert not a.core.paused and not b.core.paused

    # kill engine a: requests still succeed, a is marked unhealthy
    port = a.port
    a.stop()
    resps = _burst(router.url, 6)
    assert all(r.status_code == 200 for r in resps), [r.text for r in resps]
    _wait_for(lambda: not _workers(router)[a.url]["healthy"])
    assert _workers(router)[b.url]["healthy"]

    # restart on the same port: the health check puts it back
    a2 = start_engine_server(tiny_hf_checkpoint, port=port)
    try:
        _wait_for(lambda: _workers(router)[a.url]["healthy"])
        before = _workers(router)[a.url]["served"]
        assert all(r.status_code == 200 for r in _burst(router.url, 8))
        assert _workers(router)[a.url]["served"] > before
    finally:
        a2.stop()

    assert httpx.post(f"{router.url}/remove_worker", json={"url": a.url}).status_code == 200
    assert httpx.get(f"{router.url}/list_workers").json()["urls"] == [b.url]


def test_router_errors_auth_and_no_workers(tiny_hf_checkpoint):
    eng = start_engine_server(tiny_hf_checkpoint, api_key="engine-key")
    guarded = start_router(worker_urls=[eng.url], api_key="router-key", worker_api_key="engine-key")
    empty = start_router()
    # a router that holds the worker key but asks none of its clients would hand it to any URL
    # an anonymous /add_worker names: refused at start
    with pytest.raises(ValueError, match="needs its own --api-key"):
        start_router(worker_urls=[eng.url], worker_api_key="engine-key")
    try:
        assert httpx.get(f"{guarded.url}/list_workers").status_code == 401
        assert httpx.post(f"{guarded.url}/add_worker", json={"url": "http://127.0.0.1:9"}).status_code == 401
        auth = {"Authorization": "Bearer router-key"}
        r = httpx.post(f"{guarded.url}/generate", json={"input_ids": [1, 2]}, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        # engine errors pass through unchanged
        r = httpx.post(
            f"{guarded.url}/generate", json={"input_ids": [1, 2], "min_weight_version": 5}, headers=auth
        )
        assert r.status_code == 409 and r.json()["error"]["retryable"]
        r = httpx.post(f"{empty.url}/generate", json={"input_ids": [1, 2]})
        assert r.status_code == 503 and r.json()["error"]["retryable"]
        assert httpx.post(f"{empty.url}/add_worker", params={"url": "nonsense"}).status_code == 400
    finally:
        for s in (guarded, empty, eng):
            s.stop()


def test_a_worker_that_takes_a_request_and_hangs_gets_504_and_leaves_rotation():
    import socket
    import threading

    # a "worker" that accepts connections and never answers
    hung = socket.create_server(("127.0.0.1", 0))
    conns = []
    stop = threading.Event()

    def accept():
        hung.settimeout(0.1)
        while not stop.is_set():
            try:
                conns.append(hung.accept()[0])
            except TimeoutError:
                continue

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    router = start_router(worker_urls=[url], health_check_interval_s=60, request_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        r = httpx.post(f"{router.url}/generate", json={"input_ids": [1, 2]}, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["retryable"], r.text
        assert url in r.json()["error"]["message"] and time.monotonic() - t0 < 5
        w = _workers(router)[url]
        assert not w["healthy"] and w["inflight"] == 0, w
        # out of rotation: the next request is refused at once, not after another timeout
        r = httpx.post(f"{router.url}/generate", json={"input_ids": [1, 2]}, timeout=30)
        assert r.status_code == 503 and "no healthy worker" in r.text
    finally:
        router.stop()
        stop.set()
        acceptor.join()
        for c in conns:
            c.close()
        hung.close()


def test_pooled_connections_expire_before_the_servers_keep_alive():
    """A pooled connection reused just as uvicorn (5 s keep-alive) closes it failed the request, and
    the router took its only worker out of rotation (503 "no healthy worker" until the next probe)."""
    import uvicorn

    from miles_platform.rollout.client import KEEPALIVE_S, EngineClient
    from miles_platform.rollout.router import Router

    server_keep_alive = uvicorn.Config(app=None).timeout_keep_alive
    assert KEEPALIVE_S < server_keep_alive

    async def router_pool():
        r = Router()
        await r.start()
        try:
            return r._client._transport._pool._keepalive_expiry
        finally:
            await r.close()

    assert asyncio.run(router_pool()) == KEEPALIVE_S
    c = EngineClient("http://127.0.0.1:9")
    try:
        assert c._client._transport._pool._keepalive_expiry == KEEPALIVE_S
    finally:
        c.close()
