"""`GET /metrics` of the engine and the router: Prometheus text format (version 0.0.4).

The embedded engine uses SGLang's names (`sglang:prompt_tokens_total`, `sglang:num_running_reqs`,
`sglang:gen_throughput`, `sglang:token_usage`, ... with a `model_name` label, as SGLang's
`--enable-metrics` exposes them), so a dashboard built for SGLang reads it; what SGLang has no name
for is `miles:` (weight version, pause state, HTTP errors by kind, the pause and KV counters). The
router adds its own `miles:router_*` families (requests, queue depth, running, errors by kind,
worker health) and relays each worker's families with a `worker` label: one scrape target per run.

Every server counts its HTTP traffic in `HttpCounts` (http_common.add_guards' middleware): requests
by route template (bounded: the router's catch-all is one route) and error answers by kind.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter, deque

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# HTTP status -> the `kind` label of miles:http_errors_total
ERROR_KINDS = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "version_conflict",  # the engine does not serve the asked policy version
    413: "too_large",
    422: "unprocessable",
    500: "internal",
    502: "bad_gateway",
    503: "unavailable",  # paused past its limits, stopped, memory released, no healthy worker
    504: "timeout",
}


def error_kind(status: int) -> str:
    return ERROR_KINDS.get(status, f"http_{status}")


class HttpCounts:
    """Requests by route template and error answers (status >= 400) by kind; thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()

    def observe(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[route] += 1
            if status >= 400:
                self.errors[error_kind(status)] += 1

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.requests), dict(self.errors)


class TokenRate:
    """Tokens per second over the last `window_s` seconds (SGLang's gen_throughput): the scheduler
    adds each step's tokens, a scrape reads the rate."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._lock = threading.Lock()
        self._steps: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, n: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._steps.append((now, n))
            self._total += n
            self._prune(now)

    def _prune(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.window_s:
            self._total -= self._steps.popleft()[1]

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._prune(now)
            return self._total / self.window_s


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


class Exposition:
    """Families of samples, rendered in Prometheus text: one HELP / TYPE per family, its samples
    together (the format requires it), families in the order first added."""

    def __init__(self, **common_labels):
        self.common = common_labels
        self._families: dict[str, tuple[str, str, list[str]]] = {}

    def add(self, name: str, mtype: str, help_text: str, value: float, **labels) -> None:
        fam = self._families.setdefault(name, (mtype, help_text, []))
        fam[2].append(f"{name}{_labels({**self.common, **labels})} {_number(value)}")

    def add_raw(self, name: str, header: list[str], sample: str) -> None:
        """A sample line relayed from another exposition, under `header` (its HELP / TYPE lines)."""
        fam = self._families.setdefault(name, ("", "", header))
        fam[2].append(sample)

    def render(self) -> str:
        out = []
        for name, (mtype, help_text, lines) in self._families.items():
            if mtype:
                out += [f"# HELP {name} {help_text}", f"# TYPE {name} {mtype}"]
            out += lines
        return "\n".join(out) + "\n"


def add_http_counts(exp: Exposition, http: HttpCounts, prefix: str = "miles:") -> None:
    requests, errors = http.snapshot()
    for route, n in sorted(requests.items()):
        exp.add(f"{prefix}http_requests_total", "counter", "HTTP requests answered, by route", n, route=route)
    for kind, n in sorted(errors.items()):
        exp.add(
            f"{prefix}http_errors_total",
            "counter",
            "HTTP error answers (status >= 400), by kind",
            n,
            kind=kind,
        )


def engine_exposition(core, http: HttpCounts) -> str:
    """The embedded engine's metrics (`core`: an EngineCore)."""
    s = core.stats
    exp = Exposition(model_name=core.model_path)
    exp.add("sglang:num_requests_total", "counter", "Requests finished", s["num_finished_requests"])
    exp.add(
        "sglang:prompt_tokens_total", "counter", "Prompt tokens of finished requests", s["num_prompt_tokens"]
    )
    exp.add("sglang:generation_tokens_total", "counter", "Tokens generated", s["num_generated_tokens"])
    exp.add("sglang:num_running_reqs", "gauge", "Requests in the running batch", len(core.running()))
    exp.add("sglang:num_queue_reqs", "gauge", "Requests waiting to join the batch", core.num_queued())
    exp.add("sglang:gen_throughput", "gauge", "Generated tokens per second (last 10 s)", core.gen_rate.rate())
    used = core.kv_tokens_used()
    exp.add("sglang:num_used_tokens", "gauge", "KV cache slots in use (rows x columns)", used)
    if core.kv_budget:
        exp.add(
            "sglang:token_usage", "gauge", "Fraction of the KV cache budget in use", used / core.kv_budget
        )
        exp.add(
            "miles:kv_budget_tokens",
            "gauge",
            "KV cache budget in tokens (--mem-fraction-static)",
            core.kv_budget,
        )
    exp.add("miles:weight_version", "gauge", "Policy version of the served base weights", core.weight_version)
    exp.add("miles:paused", "gauge", "1 while generation is paused (/pause_generation)", core.paused)
    exp.add(
        "miles:memory_released",
        "gauge",
        "1 while weights or KV cache are released",
        bool(core.memory_released),
    )
    for key, help_text in (
        ("num_weight_updates", "Weight updates applied"),
        ("num_pauses", "/pause_generation calls"),
        ("num_pause_timeouts", "Requests failed after waiting --pause-wait-timeout-s"),
        ("num_pause_queue_full", "Requests refused: --pause-max-queued-requests were waiting"),
        ("num_kv_retractions", "Rows sent back to the queue to keep the KV cache in its budget"),
    ):
        exp.add(f"miles:{key.removeprefix('num_')}_total", "counter", help_text, s[key])
    add_http_counts(exp, http)
    return exp.render()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+.*)$")


def relay_worker(exp: Exposition, text: str, worker: str) -> None:
    """Add `text` (a worker's exposition) to `exp`, each sample labelled worker=<url>. Samples of a
    histogram or summary (`_bucket`, `_sum`, `_count`) stay with the family their TYPE line names."""
    headers: dict[str, list[str]] = {}
    family = None
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            family = line.split()[2]
            headers.setdefault(family, []).append(line)
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        inner = (labels or "{}")[1:-1]
        label = f'worker="{_escape(worker)}"'
        sample = f"{name}{{{label}{',' + inner if inner else ''}}} {value}"
        owner = family if family and name.startswith(family) else name
        exp.add_raw(owner, headers.get(owner, []), sample)


def router_exposition(router, http: HttpCounts, worker_texts: dict[str, str | None]) -> str:
    """The router's own families, then each worker's relayed (`worker_texts`: url -> its /metrics
    text, None when the scrape failed)."""
    exp = Exposition()
    workers = list(router.workers.values())
    exp.add("miles:router_queue_depth", "gauge", "Requests waiting for a free worker slot", router.waiting)
    exp.add(
        "miles:router_running_requests",
        "gauge",
        "Requests in flight on workers",
        sum(w.inflight for w in workers),
    )
    exp.add("miles:router_proxied_requests_total", "counter", "Requests proxied to a worker", router.proxied)
    for kind, n in sorted(router.errors.items()):
        exp.add(
            "miles:router_errors_total", "counter", "Requests the router itself failed, by kind", n, kind=kind
        )
    for w in workers:
        labels = {"worker": w.url}
        exp.add(
            "miles:router_worker_healthy", "gauge", "1 while the worker is in rotation", w.healthy, **labels
        )
        exp.add(
            "miles:router_worker_inflight", "gauge", "Requests in flight on the worker", w.inflight, **labels
        )
        exp.add(
            "miles:router_worker_served_total", "counter", "Requests the worker answered", w.served, **labels
        )
        ok = worker_texts.get(w.url) is not None
        exp.add(
            "miles:router_worker_scrape_ok", "gauge", "1 when the worker's /metrics answered", ok, **labels
        )
    add_http_counts(exp, http, "miles:router_")
    for url, text in worker_texts.items():
        if text:
            relay_worker(exp, text, url)
    return exp.render()
