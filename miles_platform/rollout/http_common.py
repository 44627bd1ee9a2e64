"""What every HTTP server of the platform shares (engine, router, session server, diffusion engine,
the OpenAI routes): SGLang's error shape, Bearer auth and the size limit, the JSON-object body, the
answer to an engine's request errors, and where weights may be loaded from. A leaf: it imports no
server module."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import posixpath
import re
import threading

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from miles_platform.rollout import chat
from miles_platform.rollout.engine_requests import EnginePaused, EngineStopped, RequestError, VersionConflict
from miles_platform.rollout.metrics import HttpCounts

DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024


def error(status: int, message: str, **extra) -> JSONResponse:
    """SGLang's error shape: {"error": {"message": ...}}."""
    return JSONResponse({"error": {"message": message, **extra}}, status_code=status)


# What the run's generate-only key may call (issue #49, item 3): generation, the OpenAI routes, the
# session server's sessions, and read-only info (`/metrics`: a Prometheus scraper needs no more than
# this key). Weight updates, pause / continue, LoRA loading,
# worker management and every other control route need the run's own (admin) key.
GENERATE_ONLY_PATHS = frozenset({"/generate", "/health", "/health_generate", "/get_model_info",
                                 "/get_server_info", "/metrics", "/v1/models", "/v1/chat/completions",
                                 "/v1/completions"})  # fmt: skip
GENERATE_ONLY_PREFIXES = ("/sessions",)


def generate_key(api_key: str) -> str:
    """The run's generate-only key, derived from its admin key: every server of the run accepts it
    for GENERATE_ONLY_PATHS without another secret to hand around, and holding it reveals nothing
    of the admin key (HMAC-SHA256). Agents and other untrusted callers get this one."""
    return hmac.new(api_key.encode(), b"miles-platform generate-only key v1", hashlib.sha256).hexdigest()


# What a tenant key may call on an engine that several runs share (issue #49, item 12): what the
# generate-only key may, reading the base weights back (--ci-test's checks), plus loading, unloading
# and checking the LoRA adapters it owns. Every
# adapter is owned by the key that loaded it: a tenant can never unload, replace or reload another
# tenant's adapter, nor one the admin key loaded (403 naming the adapter); the admin key can do all.
TENANT_PATHS = GENERATE_ONLY_PATHS | {"/get_weights_by_name", "/weights_checksum", "/load_lora_adapter",
                                      "/unload_lora_adapter", "/get_lora_adapter_checksums"}  # fmt: skip
TENANT_PREFIX = "miles-tenant."
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def tenant_key(api_key: str, tenant: str) -> str:
    """The key of `tenant` (a run sharing the engine; letters, digits, `.`, `_`, `-`) on an engine
    whose admin key is `api_key`: `miles-tenant.<tenant>.<HMAC>`. The engine checks it without a
    list of keys; holding it reveals nothing of the admin key nor of other tenants' keys
    (`miles-platform engine-key --tenant NAME` prints it)."""
    if not isinstance(tenant, str) or not _TENANT_NAME.fullmatch(tenant):
        raise ValueError(
            f"tenant {tenant!r}: letters, digits, '.', '_', '-', starting with a letter or digit, at most 128"
        )
    mac = hmac.new(api_key.encode(), b"miles-platform tenant key v1:" + tenant.encode(), hashlib.sha256)
    return f"{TENANT_PREFIX}{tenant}.{mac.hexdigest()}"


def key_tenant(api_key: str, token: str) -> str | None:
    """The tenant whose key `token` is (constant-time check), or None."""
    if not token.startswith(TENANT_PREFIX):
        return None
    tenant = token[len(TENANT_PREFIX) :].rpartition(".")[0]
    try:
        want = tenant_key(api_key, tenant)
    except ValueError:
        return None
    return tenant if hmac.compare_digest(token.encode(), want.encode()) else None


def caller_tenant(request: Request) -> str | None:
    """The tenant a request's key belongs to; None for the admin key (add_guards sets it)."""
    return getattr(request.state, "tenant", None)


def generate_scoped(path: str) -> bool:
    return path in GENERATE_ONLY_PATHS or any(
        path == p or path.startswith(p + "/") for p in GENERATE_ONLY_PREFIXES
    )


def add_guards(app: FastAPI, api_key: str | None, max_request_bytes: int) -> None:
    """Bearer-token auth (401 / 403) and a request size limit (413), shared by engine and router;
    every answer is counted in `app.state.http_counts` (route template, error kind) for `/metrics`.

    Every endpoint needs a key except `GET /health` (liveness probes; it reveals nothing): the
    run's admin key anywhere, its generate-only key (`generate_key`) on GENERATE_ONLY_PATHS only,
    a tenant's key (`tenant_key`; `request.state.tenant`) on TENANT_PATHS only (403 elsewhere). The scheme is case-insensitive (RFC 7235); tokens are compared in constant time."""
    want = api_key.encode() if api_key else None
    scoped = generate_key(api_key).encode() if api_key else None
    app.state.http_counts = counts = HttpCounts()  # GET /metrics reports it (rollout/metrics.py)

    def refused(request: Request) -> JSONResponse | None:
        if want and not (request.method == "GET" and request.url.path == "/health"):
            scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
            given = token.strip().encode()
            ok = scheme.lower() == "bearer" and hmac.compare_digest(given, want)
            tenant = key_tenant(api_key, token.strip()) if not ok and scheme.lower() == "bearer" else None
            if tenant is not None:
                request.state.tenant = tenant
                if request.url.path not in TENANT_PATHS:
                    return error(
                        403,
                        f"{request.url.path}: tenant {tenant!r}'s key may generate and manage its own LoRA "
                        "adapters only; control and weight routes need the engine's admin key",
                    )
            elif not ok:
                if scheme.lower() != "bearer" or not hmac.compare_digest(given, scoped):
                    return error(401, "missing or wrong bearer token (Authorization: Bearer <api-key>)")
                if not generate_scoped(request.url.path):
                    return error(
                        403,
                        f"{request.url.path}: this key may only generate (/generate, the OpenAI routes, "
                        "sessions, model info); control and weight routes need the run's admin key",
                    )
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_request_bytes:
            return error(413, f"request body of {size} bytes exceeds the limit of {max_request_bytes}")
        return None

    class Guard:
        """Plain ASGI, not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware hands every
        chunk of a streamed answer (one per finished sample of a batched /generate) through a
        memory stream, ~28 us of CPU a chunk: a 128-line answer cost 2.1x a bare app's, now 1.0x
        (bench_engine's guard row)."""

        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.inner(scope, receive, send)
            response = refused(Request(scope))  # request.state lives in the scope: routes see it
            if response is not None:
                await response(scope, receive, send)
                status = response.status_code
            else:
                status = 500  # an app that ends without answering (one that raises propagates, uncounted)

                async def observed(message):
                    nonlocal status
                    if message["type"] == "http.response.start":
                        status = message["status"]
                    await send(message)

                await self.inner(scope, receive, observed)
            route = scope.get("route")  # the template (bounded), not the path; none: never routed
            counts.observe(getattr(route, "path", "none"), status)

    app.add_middleware(Guard)


async def json_body(request: Request, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
    """Parse a JSON object body (every route takes one, as SGLang's); returns (body, None) or (None,
    error response): 413 past the size limit, 400 for malformed JSON or a body that is not an object."""
    raw = await request.body()
    if len(raw) > max_request_bytes:
        return None, error(413, f"request body of {len(raw)} bytes exceeds the limit of {max_request_bytes}")
    if not raw:
        return {}, None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return None, error(400, f"malformed JSON body: {e}")
    if not isinstance(body, dict):
        return None, error(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body, None


async def all_results(futures: list) -> list:
    """Await concurrent futures with one wake-up of the event loop for the whole batch (not one per
    future: those wake-ups contend for the GIL with the scheduler thread). Raises the first error."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    left, lock = [len(futures)], threading.Lock()

    def one_done(_):
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    if futures:
        for f in futures:
            f.add_done_callback(one_done)
        await done
    return [f.result() for f in futures]


async def streamed_results(futures: list, is_batch: bool):
    """SSE chunks of a `/generate` with `stream: true`: each prompt's whole result once, as it
    finishes (in finishing order; a batch's chunks carry SGLang's `index`), then `[DONE]`. A prompt
    that fails sends `{"index": i, "error": {..., "status": <its HTTP status>}}` (the `retryable`
    ones: its client sends that prompt again) and the others go on. One chunk per prompt, not per
    token: a client that frees a slot per finished sample (--rollout-submission-granularity
    sample) learns of each as it finishes without one HTTP request per sample."""
    loop = asyncio.get_running_loop()
    done: asyncio.Queue = asyncio.Queue()
    for i, f in enumerate(futures):
        f.add_done_callback(lambda f, i=i: loop.call_soon_threadsafe(done.put_nowait, (i, f)))
    left = len(futures)
    while left:
        ready = [await done.get()]
        while not done.empty():  # finished in the same step: one write (a write costs more than a chunk)
            ready.append(done.get_nowait())
        left -= len(ready)
        yield b"".join(b"data: " + orjson.dumps(_chunk(i, f, is_batch)) + b"\n\n" for i, f in ready)
    yield b"data: [DONE]\n\n"


def _chunk(i: int, f, is_batch: bool) -> dict:
    """Prompt i's SSE chunk: its result, or its error with the HTTP status it would have had."""
    try:
        out = dict(f.result())
    except ENGINE_ERRORS as e:
        resp = engine_error(e)
        out = {"error": {**orjson.loads(resp.body)["error"], "status": resp.status_code}}
    except Exception as e:  # a failed step (the non-stream answer is a 500)
        out = {"error": {"message": f"{type(e).__name__}: {e}", "status": 500}}
    if is_batch:
        out["index"] = i
    return out


# what an engine call may raise for a request (HTTP 400 / 409 / 503): `engine_error` answers it
ENGINE_ERRORS = (RequestError, chat.ChatError, VersionConflict, EnginePaused, EngineStopped)


def engine_error(e: Exception) -> JSONResponse:
    """The answer to one of ENGINE_ERRORS: 400 a bad request, 409 a policy version the engine does
    not serve, 503 (retryable) paused past --pause-wait-timeout-s or stopped."""
    if isinstance(e, VersionConflict):
        return JSONResponse({"error": e.info}, status_code=409)
    if isinstance(e, EnginePaused):  # paused past --pause-wait-timeout-s, or its queue is full
        return JSONResponse({"error": e.info}, status_code=503)
    if isinstance(e, EngineStopped):
        return error(503, str(e), retryable=True)
    return error(400, str(e))


def weight_root(path: str) -> str:
    """`path` as a weights location is compared: a local dir resolved (links, . and ..), an
    object-store URI as written less . and .."""
    if "://" in path:
        scheme, _, rest = path.partition("://")
        return f"{scheme}://{posixpath.normpath('/' + rest).lstrip('/')}".rstrip("/")
    return os.path.realpath(path).rstrip("/")


class WeightRoots:
    """The directories an engine loads weights and adapters from (`--allow-weights-from`; None: any)."""

    def __init__(self, roots: list[str] | None):
        self.roots = None if roots is None else [weight_root(r) for r in roots]

    def allows(self, path: str) -> bool:
        real = weight_root(path)
        return self.roots is None or any(real == r or real.startswith(r + "/") for r in self.roots)

    def refusal(self, field: str, path) -> str:
        """The 403 message for `field` = `path`, outside the roots."""
        return f"{field} {path!r} is outside the directories this engine loads weights from: {self.roots}"
