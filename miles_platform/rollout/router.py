"""Router in front of engines (the sgl-router subset Miles uses).

`/add_worker`, `/remove_worker`, `/list_workers` manage workers; the broadcast endpoints
(`/pause_generation`, `/continue_generation`, `/flush_cache`, `/update_weights_from_disk`,
`/abort_request`) go to every worker; any other path is proxied to the least-loaded healthy worker, at most
`max_concurrency_per_worker` requests each (others wait); an event stream (the OpenAI routes'
`stream: true`) is relayed chunk by chunk as the worker writes it. A background task probes `/health` every
`health_check_interval_s`; a failing worker (or one that refuses a proxied connection) leaves the
rotation and comes back when it answers again. A request whose worker dies is retried elsewhere;
a worker's own answer (any status: a paused engine's 503 `engine_paused`, a 409) is passed through
for the client to retry, and the worker, alive, stays in rotation. `GET /metrics`: the router's
counters and every worker's metrics labelled by worker (rollout/metrics.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass

import anyio
import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from miles_platform.rollout.client import KEEPALIVE_S
from miles_platform.rollout.engine_server import (
    ServerHandle,
    ServerThread,
    serve_in_thread,
    wait_for_stop_signal,
)
from miles_platform.rollout.http_common import DEFAULT_MAX_REQUEST_BYTES, add_guards, error, json_body
from miles_platform.rollout.metrics import CONTENT_TYPE, router_exposition
from miles_platform.tls import client_tls

log = logging.getLogger(__name__)

BROADCAST = (
    "/pause_generation", "/continue_generation", "/flush_cache", "/update_weights_from_disk", "/abort_request",
)  # fmt: skip
_HOP_HEADERS = {
    "host",
    "content-length",
    "authorization",
    "connection",
    "transfer-encoding",
    "accept-encoding",
}


@dataclass
class Worker:
    url: str
    healthy: bool = True
    inflight: int = 0
    served: int = 0
    failures: int = 0

    def as_dict(self) -> dict:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "inflight": self.inflight,
            "served": self.served,
            "failures": self.failures,
        }


class Router:
    """SGLang-router-compatible front of a run's engines: forwards `/generate` (a batch split
    across workers by load), broadcasts control calls (pause / continue / weight updates) to every
    worker, `/add_worker` / `/remove_worker`; bearer token on every route but `/health`, and a
    worker key never forwarded to a worker added without the router's own key."""

    def __init__(
        self,
        worker_urls: list[str] = (),
        max_concurrency_per_worker: int = 64,
        health_check_interval_s: float = 5.0,
        health_check_timeout_s: float = 5.0,
        queue_timeout_s: float = 600.0,
        request_timeout_s: float = 3600.0,
        worker_api_key: str | None = None,
    ):
        self.workers: dict[str, Worker] = {u.rstrip("/"): Worker(u.rstrip("/")) for u in worker_urls}
        self.cap = max_concurrency_per_worker
        self.interval, self.probe_timeout = health_check_interval_s, health_check_timeout_s
        self.queue_timeout, self.request_timeout = queue_timeout_s, request_timeout_s
        self.worker_headers = {"Authorization": f"Bearer {worker_api_key}"} if worker_api_key else {}
        self._changed: asyncio.Condition | None = None
        self._client: httpx.AsyncClient | None = None
        self.waiting = 0  # requests waiting for a free worker slot (GET /metrics: queue depth)
        self.proxied = 0  # requests handed to a worker
        self.errors: Counter[str] = Counter()  # requests the router failed itself, by kind

    async def start(self) -> None:
        self._changed = asyncio.Condition()
        self._client = httpx.AsyncClient(
            timeout=self.request_timeout,
            limits=httpx.Limits(max_connections=None, keepalive_expiry=KEEPALIVE_S),
            verify=client_tls(),
        )
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        self._health_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._health_task
        await self._client.aclose()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def add(self, url: str) -> None:
        url = url.rstrip("/")
        self.workers.setdefault(url, Worker(url))
        await self._notify()

    async def remove(self, url: str) -> bool:
        found = self.workers.pop(url.rstrip("/"), None) is not None
        await self._notify()
        return found

    async def _acquire(self) -> Worker:
        """Least-loaded healthy worker with a free slot; waits while all are busy."""
        deadline = time.monotonic() + self.queue_timeout
        async with self._changed:
            while True:
                free = [w for w in self.workers.values() if w.healthy and w.inflight < self.cap]
                if free:
                    w = min(free, key=lambda w: (w.inflight, w.served))
                    w.inflight += 1
                    self.proxied += 1
                    return w
                if not any(w.healthy for w in self.workers.values()):
                    raise LookupError("no healthy worker")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("all workers busy")
                self.waiting += 1
                try:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), left)
                finally:
                    self.waiting -= 1

    async def _release(self, w: Worker, ok: bool) -> None:
        w.inflight -= 1
        w.served += int(ok)
        if not ok:
            w.healthy, w.failures = False, w.failures + 1
            log.warning("router: worker %s unreachable, taken out of rotation", w.url)
        await self._notify()

    async def proxy(self, method: str, path: str, query: str, body: bytes, headers: dict) -> Response:
        tries = max(1, len(self.workers))
        for _ in range(tries):
            try:
                w = await self._acquire()
            except LookupError as e:
                self.errors["no_healthy_worker"] += 1
                return error(503, f"router: {e}", retryable=True)
            except TimeoutError as e:
                self.errors["queue_timeout"] += 1
                return error(503, f"router: {e} for {self.queue_timeout}s", retryable=True)
            url = f"{w.url}{path}" + (f"?{query}" if query else "")
            req = self._client.build_request(
                method, url, content=body, headers={**headers, **self.worker_headers}
            )
            try:
                resp = await self._client.send(req, stream=True)
                if _is_stream(resp):  # SSE (the OpenAI routes' stream=true): relayed as it comes
                    return StreamingResponse(
                        self._relay(resp, w), status_code=resp.status_code, media_type=resp.headers["content-type"],
                        headers={"Cache-Control": "no-cache"},
                    )  # fmt: skip
                content = await resp.aread()
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectTimeout):
                self.errors["worker_unreachable"] += 1
                await self._release(w, ok=False)
                continue  # the worker died before answering: try another one
            except httpx.TimeoutException as e:
                # it took the request and hung: out of rotation until a probe answers; not retried
                # here (it may still be generating), the caller's retry policy decides
                self.errors["worker_timeout"] += 1
                await self._release(w, ok=False)
                return error(
                    504,
                    f"router: worker {w.url} did not answer within {self.request_timeout}s ({type(e).__name__})",
                    retryable=True,
                )
            except httpx.HTTPError as e:
                self.errors["worker_error"] += 1
                await self._release(w, ok=False)
                return error(502, f"router: worker {w.url}: {type(e).__name__}: {e}", retryable=True)
            await self._release(w, ok=True)
            return Response(
                content, status_code=resp.status_code, media_type=resp.headers.get("content-type")
            )
        self.errors["every_worker_failed"] += 1
        return error(503, "router: every worker failed this request", retryable=True)

    async def _relay(self, resp: httpx.Response, w: Worker):
        """A worker's event stream, chunk by chunk; its slot is held until the stream ends. A worker
        that dies mid-stream leaves the rotation (the client sees the stream end); a client that
        goes away is not the worker's fault."""
        failed = False
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            failed = True
            log.warning("router: worker %s broke off a stream: %s: %s", w.url, type(e).__name__, e)
        finally:
            with anyio.CancelScope(shield=True):  # the slot is released even when the client left
                await resp.aclose()
                await self._release(w, ok=not failed)

    async def generate(self, query: str, body: bytes, headers: dict) -> Response:
        """POST /generate. A batch (SGLang's list form) is split into one contiguous chunk per
        healthy worker, each chunk routed like any request (least loaded first), and the results
        are joined in prompt order; a single prompt, a single worker or a streamed batch (each
        prompt's result as it finishes: one worker serves it) is forwarded whole."""
        healthy = sum(w.healthy for w in self.workers.values())
        parsed = _batch_body(body) if healthy > 1 else None
        if parsed is None or parsed[0].get("stream"):
            return await self.proxy("POST", "/generate", query, body, headers)
        req, n = parsed
        bounds = [(n * i // healthy, n * (i + 1) // healthy) for i in range(min(healthy, n))]
        resps = await asyncio.gather(
            *(self.proxy("POST", "/generate", query, _slice_batch(req, a, b), headers) for a, b in bounds)
        )
        failed = [r for r in resps if r.status_code >= 300]
        if failed:
            return failed[0]
        return Response(
            orjson.dumps([x for r in resps for x in orjson.loads(r.body)]), media_type="application/json"
        )

    async def broadcast(self, path: str, body: bytes, headers: dict) -> JSONResponse:
        async def one(w: Worker):
            try:
                r = await self._client.post(
                    f"{w.url}{path}", content=body, headers={**headers, **self.worker_headers}
                )
                try:
                    payload = r.json()
                except ValueError:
                    payload = r.text
                return {"url": w.url, "status": r.status_code, "body": payload}
            except httpx.HTTPError as e:
                return {"url": w.url, "status": 503, "body": f"{type(e).__name__}: {e}"}

        results = await asyncio.gather(*(one(w) for w in list(self.workers.values())))
        failed = [r for r in results if r["status"] >= 300]
        status = 200 if not failed else max(r["status"] for r in failed)
        return JSONResponse({"success": not failed, "results": results}, status_code=status)

    async def scrape(self) -> dict[str, str | None]:
        """Each worker's `/metrics` text (None: it did not answer 200), for the router's own."""

        async def one(w: Worker) -> str | None:
            try:
                r = await self._client.get(
                    f"{w.url}/metrics", headers=self.worker_headers, timeout=self.probe_timeout
                )
            except httpx.HTTPError:
                return None
            return r.text if r.status_code == 200 else None

        workers = list(self.workers.values())
        return dict(zip([w.url for w in workers], await asyncio.gather(*map(one, workers)), strict=True))

    async def _probe(self, w: Worker) -> None:
        try:
            r = await self._client.get(
                f"{w.url}/health", headers=self.worker_headers, timeout=self.probe_timeout
            )
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok != w.healthy:
            log.warning("router: worker %s is now %s", w.url, "healthy" if ok else "unhealthy")
        w.healthy = ok
        w.failures = 0 if ok else w.failures + 1

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(w) for w in list(self.workers.values())))
            await self._notify()
            await asyncio.sleep(self.interval)


def _is_stream(resp: httpx.Response) -> bool:
    return resp.headers.get("content-type", "").startswith("text/event-stream")


# SGLang fields that are one value per prompt when given as a list (token_ids_logprob: a list of
# lists; a flat list of ids is one value for every prompt)
_PER_PROMPT = (
    "input_ids",
    "text",
    "sampling_params",
    "rid",
    "logprob_start_len",
    "top_logprobs_num",
    "image_data",
)


def _per_prompt(key: str, value) -> bool:
    if key == "token_ids_logprob":
        return (
            isinstance(value, list) and bool(value) and all(x is None or isinstance(x, list) for x in value)
        )
    return key in _PER_PROMPT and isinstance(value, list)


def _batch_body(body: bytes) -> tuple[dict, int] | None:
    """(parsed body, number of prompts) for a well-formed batch of >= 2 prompts, else None (the
    engine answers anything else itself, errors included)."""
    try:
        req = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(req, dict):
        return None
    ids, text = req.get("input_ids"), req.get("text")
    if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        n = len(ids)
    elif isinstance(text, list) and text:
        n = len(text)
    else:
        return None
    for k, v in req.items():
        if k not in ("input_ids", "text") and _per_prompt(k, v) and len(v) != n:
            return None
    return (req, n) if n > 1 else None


def _slice_batch(req: dict, a: int, b: int) -> bytes:
    return orjson.dumps({k: v[a:b] if _per_prompt(k, v) else v for k, v in req.items()})


def create_router_app(
    router: Router, api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="miles-platform router", lifespan=lifespan)
    add_guards(app, api_key, max_request_bytes)

    async def worker_url(request: Request) -> str | None:
        if "url" in request.query_params:
            return request.query_params["url"]
        body, _ = await json_body(request, max_request_bytes)
        return body.get("url") if isinstance(body, dict) else None

    @app.post("/add_worker")
    async def add_worker(request: Request):
        url = await worker_url(request)
        if not url or not url.startswith(("http://", "https://")):
            return error(400, "add_worker needs url=http://host:port (query or JSON body)")
        await router.add(url)
        return {"status": "ok", "message": f"added {url}"}

    @app.post("/remove_worker")
    async def remove_worker(request: Request):
        url = await worker_url(request)
        if not url or not await router.remove(url):
            return error(404, f"remove_worker: no worker {url!r}")
        return {"status": "ok", "message": f"removed {url}"}

    @app.get("/list_workers")
    async def list_workers():
        return {"urls": list(router.workers), "workers": [w.as_dict() for w in router.workers.values()]}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(request: Request):
        """The router's own families and each worker's, labelled worker=<url> (rollout/metrics.py)."""
        text = router_exposition(router, request.app.state.http_counts, await router.scrape())
        return Response(text, media_type=CONTENT_TYPE)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def forward(path: str, request: Request):
        body = await request.body()
        if len(body) > max_request_bytes:
            return error(413, f"request body of {len(body)} bytes exceeds the limit of {max_request_bytes}")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        if f"/{path}" in BROADCAST:
            return await router.broadcast(f"/{path}", body, headers)
        if path == "generate" and request.method == "POST":
            return await router.generate(request.url.query, body, headers)
        return await router.proxy(request.method, f"/{path}", request.url.query, body, headers)

    return app


class RouterServer(ServerHandle):
    """Handle for a background router: `.url`, `.port`, `.router`, `.stop()`."""

    def __init__(self, router: Router, server: ServerThread):
        super().__init__(server)
        self.router = router


def start_router(
    host: str = "127.0.0.1",
    port: int = 0,
    worker_urls: list[str] = (),
    api_key: str | None = None,
    worker_api_key: str | None = None,
    max_concurrency_per_worker: int = 64,
    health_check_interval_s: float = 5.0,
    queue_timeout_s: float = 600.0,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    request_timeout_s: float = 3600.0,
) -> RouterServer:
    """Start the router in a background thread (port 0 = a free port)."""
    if worker_api_key and not api_key:
        raise ValueError(
            "a router holding --worker-api-key needs its own --api-key: otherwise anyone could "
            "/add_worker their own URL and receive the worker key"
        )
    router = Router(
        list(worker_urls),
        max_concurrency_per_worker,
        health_check_interval_s,
        queue_timeout_s=queue_timeout_s,
        request_timeout_s=request_timeout_s,
        worker_api_key=worker_api_key,
    )
    app = create_router_app(router, api_key, max_request_bytes)
    return RouterServer(router, serve_in_thread(app, host, port, "router-http", lifespan="on"))


def cli_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="miles-platform serve-router", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--worker-urls", nargs="*", default=[], help="engine URLs to start with")
    ap.add_argument(
        "--api-key",
        default=os.environ.get("MILES_API_KEY"),
        help="require Authorization: Bearer <key> from clients (default: $MILES_API_KEY)",
    )
    ap.add_argument("--worker-api-key", default=None, help="bearer token sent to the engines")
    ap.add_argument("--max-concurrency-per-worker", type=int, default=64)
    ap.add_argument("--health-check-interval", type=float, default=5.0, help="seconds between /health probes")
    ap.add_argument(
        "--request-timeout-secs",
        type=float,
        default=3600.0,
        help="a worker that has not answered a request by then is taken out of rotation (HTTP 504)",
    )
    args = ap.parse_args(argv)
    if args.request_timeout_secs <= 0:
        ap.error("--request-timeout-secs must be > 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server = start_router(
        args.host,
        args.port,
        args.worker_urls,
        args.api_key,
        args.worker_api_key,
        args.max_concurrency_per_worker,
        args.health_check_interval,
        request_timeout_s=args.request_timeout_secs,
    )
    print(f"serve-router: {server.url} workers={args.worker_urls}", flush=True)
    wait_for_stop_signal()
    server.stop()
    return 0
