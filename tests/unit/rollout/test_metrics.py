"""GET /metrics on a real engine and router over loopback: Prometheus text whose counters move by what
was sent, the router's own families and its worker's relayed, the run's key required (not on /health)."""

from __future__ import annotations

import re

import httpx
import pytest

from miles_platform.rollout.engine_server import start_engine_server
from miles_platform.rollout.http_common import generate_key
from miles_platform.rollout.metrics import TokenRate
from miles_platform.rollout.router import start_router

KEY = "metrics-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")


def scrape(url: str, headers: dict = AUTH) -> dict[tuple[str, frozenset], float]:
    """(name, labels) -> value; every line a valid sample or a HELP / TYPE of the next family."""
    r = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out, typed = {}, set()
    for line in r.text.splitlines():
        if line.startswith("# TYPE "):
            name = line.split()[2]
            assert name not in typed, f"second TYPE line for {name}: its samples are not together"
            typed.add(name)
            continue
        if line.startswith("#"):
            continue
        m = LINE.match(line)
        assert m, f"not a Prometheus sample: {line!r}"
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def value(samples: dict, name: str, **labels) -> float:
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(hits) == 1, (name, labels, [k for k in samples if k[0] == name])
    return hits[0]


@pytest.fixture(scope="module")
def served(tiny_hf_checkpoint):
    engine = start_engine_server(tiny_hf_checkpoint, api_key=KEY)
    router = start_router(
        worker_urls=[engine.url], api_key=KEY, worker_api_key=KEY, health_check_interval_s=0.2
    )
    yield engine, router
    router.stop()
    engine.stop()


def test_engine_and_router_metrics_count_what_was_sent(served):
    engine, router = served
    before, rbefore = scrape(engine.url), scrape(router.url)
    prompt, new = [5, 6, 7, 8, 9, 10, 11], 4  # a request of 7 prompt tokens that generates 4
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": new, "ignore_eos": True, "temperature": 0},
    }
    r = httpx.post(f"{router.url}/generate", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.post(f"{engine.url}/generate", json={"text": 3}, headers=AUTH).status_code == 400
    assert (
        httpx.post(f"{engine.url}/pause_generation", json={"mode": "abort"}, headers=AUTH).status_code == 200
    )
    after = scrape(engine.url)

    for name, moved in (
        ("sglang:prompt_tokens_total", len(prompt)),
        ("sglang:generation_tokens_total", new),
        ("sglang:num_requests_total", 1),
        ("miles:http_errors_total", 1),  # the malformed request: kind bad_request
    ):
        labels = {"kind": "bad_request"} if "errors" in name else {}
        assert value(after, name, **labels) - before.get((name, frozenset(labels.items())), 0) == moved, name
    assert value(after, "sglang:prompt_tokens_total", model_name=engine.core.model_path) >= len(prompt)
    assert value(after, "sglang:gen_throughput") >= new / 10  # tokens of the last 10 s / 10 s
    assert value(after, "miles:http_requests_total", route="/generate") >= 2
    assert value(after, "miles:paused") == 1 and value(after, "miles:weight_version") == 0
    assert value(after, "sglang:num_running_reqs") == value(after, "sglang:num_queue_reqs") == 0
    assert value(after, "sglang:num_used_tokens") == 0
    httpx.post(f"{engine.url}/continue_generation", headers=AUTH)
    assert value(scrape(engine.url), "miles:paused") == 0

    # the router: its own counters, and the engine's relayed with a worker label
    rafter = scrape(router.url)
    assert (
        value(rafter, "miles:router_proxied_requests_total")
        - rbefore[("miles:router_proxied_requests_total", frozenset())]
        == 1
    )
    assert value(rafter, "miles:router_worker_healthy", worker=engine.url) == 1
    assert value(rafter, "miles:router_worker_scrape_ok", worker=engine.url) == 1
    assert value(rafter, "miles:router_queue_depth") == value(rafter, "miles:router_running_requests") == 0
    relayed = value(rafter, "sglang:generation_tokens_total", worker=engine.url)
    assert relayed == value(after, "sglang:generation_tokens_total")


def test_metrics_need_the_run_key_but_health_does_not(served):
    engine, router = served
    for url in (engine.url, router.url):
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200
        # a Prometheus scraper holds the generate-only key, not the admin key
        scraper = {"Authorization": f"Bearer {generate_key(KEY)}"}
        assert (
            value(
                scrape(url, scraper),
                "miles:" + ("router_" if url == router.url else "") + "http_errors_total",
                kind="unauthorized",
            )
            >= 2
        )


def test_token_rate_is_the_last_window():
    rate = TokenRate(window_s=10.0)
    rate.add(30, now=100.0)
    rate.add(20, now=105.0)
    assert rate.rate(now=106.0) == 5.0  # 50 tokens in the last 10 s
    assert rate.rate(now=112.0) == 2.0  # the first step left the window
    assert rate.rate(now=200.0) == 0.0


def test_token_perf_is_miles_throughput_over_the_rollouts_wall_time():
    from miles_platform.data.sample import Sample
    from miles_platform.rollout.manager import token_perf

    samples = [Sample(response_tokens=[1] * 6, loss_mask=[1, 1, 0, 0, 1, 1]), Sample(response_tokens=[1] * 2)]
    assert token_perf(samples, 2.0, devices=2) == {
        "perf/tokens_per_gpu_per_sec": 2.0,  # 8 tokens / 2 s / 2 devices
        "perf/longest_sample_tokens_per_sec": 3.0,
        "perf/effective_tokens_per_gpu_per_sec": 1.5,  # the tool-result tokens (mask 0) do not count
        "perf/longest_effective_sample_tokens_per_sec": 2.0,
    }
    assert "perf/tokens_per_gpu_per_sec" not in token_perf(
        samples, 2.0, devices=0
    )  # external engines, as Miles
