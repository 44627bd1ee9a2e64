"""HTTP client helpers for engines and the router (SGLang API).

`generate` retries the retryable answers (409 weight-version conflict, 503 unavailable, the
router's 502/504 for a worker that failed or hung mid-request, connection errors) a bounded number of times with exponential backoff; anything else raises `EngineHTTPError`.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
import urllib.parse
import urllib.request
import weakref

import httpx
import orjson

from miles_platform.tls import client_tls

RETRYABLE_STATUS = (409, 502, 503, 504)
# how long a pooled connection is kept idle: below uvicorn's 5 s keep-alive (our engine and router
# servers, SGLang's), so a connection is never reused just as the server closes it (httpx's default
# is also 5 s: the request then fails with a read / protocol error, and the router took its only
# worker out of rotation for a health-probe period: 503 "no healthy worker")
KEEPALIVE_S = 2.0


class EngineHTTPError(Exception):
    """A non-2xx answer: `.status` and `.body` (parsed JSON when possible)."""

    def __init__(self, url: str, status: int, body):
        self.status, self.body = status, body
        super().__init__(f"{url}: HTTP {status}: {body}")


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _parse(resp: httpx.Response):
    try:
        return orjson.loads(resp.content)  # ~10x the stdlib on big bodies (weight checks)
    except orjson.JSONDecodeError:
        return resp.text


async def generate(
    url: str,
    input_ids: list[int] | list[list[int]],
    sampling_params: dict | list[dict] | None = None,
    return_logprob: bool = True,
    api_key: str | None = None,
    min_weight_version: int | None = None,
    exact_weight_version: int | None = None,
    timeout: float = 600.0,
    max_retries: int = 8,
    backoff_s: float = 0.05,
    max_backoff_s: float = 2.0,
    client: httpx.AsyncClient | None = None,
    return_sampling_mask: bool = False,
    lora_path: str | None = None,
    top_logprobs_num: int = 0,
    return_routed_experts: bool = False,
    sampling_logprobs_mode: str | None = None,
    image_data: list | None = None,
) -> dict | list[dict]:
    """POST {url}/generate; returns SGLang's response (a list for a batch of prompts).
    `return_sampling_mask` asks for each token's sampling support (sampling-support replay);
    `lora_path` names the LoRA adapter that serves every prompt (SGLang's field);
    `top_logprobs_num` for the k most likely tokens at each generated position (top-k OPD, score
    centering); `sampling_logprobs_mode` "support" for each support id's log-prob (score centering);
    `image_data` SGLang's images (a batch: one list or None per prompt; rollout/engine_vlm.py)."""
    body = generate_body(
        input_ids, sampling_params, return_logprob, min_weight_version, exact_weight_version,
        return_sampling_mask, lora_path, top_logprobs_num, return_routed_experts, sampling_logprobs_mode,
        image_data,
    )  # fmt: skip
    return await post_generate(url, body, api_key, timeout, max_retries, backoff_s, max_backoff_s, client)


def generate_body(
    input_ids, sampling_params=None, return_logprob=True, min_weight_version=None, exact_weight_version=None,
    return_sampling_mask=False, lora_path=None, top_logprobs_num=0, return_routed_experts=False,
    sampling_logprobs_mode=None, image_data=None,
) -> dict:  # fmt: skip
    """SGLang's /generate body of `generate`'s arguments."""
    body = {
        "input_ids": input_ids,
        "sampling_params": sampling_params or {},
        "return_logprob": return_logprob,
    }
    if return_sampling_mask:
        body["return_sampling_mask"] = True
    if lora_path is not None:
        body["lora_path"] = lora_path
    if top_logprobs_num:
        body["top_logprobs_num"] = top_logprobs_num
    if sampling_logprobs_mode:
        body["sampling_logprobs_mode"] = sampling_logprobs_mode
    if return_routed_experts:  # MoE, R3: meta_info.routed_experts (SGLang's)
        body["return_routed_experts"] = True
    if image_data is not None:
        body["image_data"] = image_data
    if min_weight_version is not None:
        body["min_weight_version"] = min_weight_version
    if exact_weight_version is not None:
        body["exact_weight_version"] = exact_weight_version
    return body


async def stream_generate(
    url: str,
    input_ids: list[list[int]],
    sampling_params: list[dict],
    on_result,
    api_key: str | None = None,
    timeout: float = 600.0,
    max_retries: int = 8,
    backoff_s: float = 0.05,
    max_backoff_s: float = 2.0,
    client: httpx.AsyncClient | None = None,
    image_data: list | None = None,
    **opts,
) -> None:
    """A batch as one `stream: true` POST {url}/generate: `on_result(i, result)` for prompt i as it
    finishes (the embedded engine sends each prompt's whole result once: http_common.
    streamed_results). Retries, with `generate`'s backoff, only the prompts without a result: all of
    them on a retryable status or a connection lost mid-stream, one on its retryable error chunk;
    anything else raises `EngineHTTPError`. `opts`: `generate`'s other body fields, for every prompt."""
    url = url.rstrip("/").removesuffix("/generate")
    client = client or _LOOP_CLIENTS.get(asyncio.get_running_loop())
    if client is None:
        async with httpx.AsyncClient(timeout=timeout, verify=client_tls()) as own:
            return await stream_generate(url, input_ids, sampling_params, on_result, api_key, timeout,
                                         max_retries, backoff_s, max_backoff_s, own, image_data, **opts)  # fmt: skip
    left, delay = list(range(len(input_ids))), backoff_s
    for attempt in range(max_retries + 1):
        last_try = attempt == max_retries
        body = generate_body(
            [input_ids[i] for i in left], [sampling_params[i] for i in left],
            image_data=None if image_data is None else [image_data[i] for i in left], **opts,
        )  # fmt: skip
        body["stream"] = True
        try:
            left = await _stream_once(url, body, left, on_result, api_key, client, last_try)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
            if last_try:
                raise
        if not left:
            return
        if last_try:
            raise EngineHTTPError(url, 503, f"{len(left)} prompts unanswered after {max_retries} retries")
        _RETRIES[client] = _RETRIES.get(client, 0) + 1
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_backoff_s)


async def _stream_once(url, body, left, on_result, api_key, client, last_try) -> list[int]:
    """One streamed request for the prompts `left` (their indices in the caller's batch); returns
    those still without a result (retryable failures, or a stream that ended early)."""
    headers = {"Content-Type": "application/json", **_headers(api_key)}
    async with client.stream("POST", f"{url}/generate", content=orjson.dumps(body), headers=headers) as resp:
        if resp.status_code >= 300:
            content = await resp.aread()
            if resp.status_code not in RETRYABLE_STATUS or last_try:
                raise EngineHTTPError(url, resp.status_code, _parse_bytes(content))
            return left
        pending, retry = set(left), []
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            out = orjson.loads(line[6:])
            i = left[out.pop("index", 0)]
            pending.discard(i)
            err = out.get("error")
            if err is None:
                on_result(i, out)
            elif (err.get("retryable") or err.get("status") in RETRYABLE_STATUS) and not last_try:
                retry.append(i)
            else:
                raise EngineHTTPError(url, err.get("status", 500), {"error": err})
        return sorted(retry + list(pending))


# the pooled client of each EngineClient's event loop: `post_generate` called from code running
# there (custom generate functions) shares the run's keep-alive connections
_LOOP_CLIENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# retried /generate attempts per pooled client (EngineClient.retries)
_RETRIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def post_generate(
    url: str,
    payload: dict,
    api_key: str | None = None,
    timeout: float = 600.0,
    max_retries: int = 8,
    backoff_s: float = 0.05,
    max_backoff_s: float = 2.0,
    client: httpx.AsyncClient | None = None,
) -> dict | list[dict]:
    """POST `payload` (SGLang's /generate body, as built by the caller) to {url}/generate, with
    the retries of `generate`. `url` may end in /generate already (Miles' generate functions
    post to `http://host:port/generate`)."""
    url = url.rstrip("/").removesuffix("/generate")
    client = client or _LOOP_CLIENTS.get(asyncio.get_running_loop())
    own = client is None
    client = client or httpx.AsyncClient(timeout=timeout, verify=client_tls())
    try:
        delay = backoff_s
        for attempt in range(max_retries + 1):
            last_try = attempt == max_retries
            try:
                resp = await client.post(
                    f"{url}/generate",
                    content=orjson.dumps(payload),
                    headers={"Content-Type": "application/json", **_headers(api_key)},
                )
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                if last_try:
                    raise
            else:
                if resp.status_code < 300:
                    return orjson.loads(resp.content)
                if resp.status_code not in RETRYABLE_STATUS or last_try:
                    raise EngineHTTPError(url, resp.status_code, _parse(resp))
            if not own:
                _RETRIES[client] = _RETRIES.get(client, 0) + 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_backoff_s)
        raise AssertionError("unreachable")
    finally:
        if own:
            await client.aclose()


_sync_client: httpx.Client | None = None


def _sync() -> httpx.Client:
    """One keep-alive httpx client per process for the control calls a proxy must carry (the
    environment's HTTP(S)_PROXY): a new client per call costs ~40 ms (TLS context) plus a TCP connect."""
    global _sync_client
    if _sync_client is None:
        _sync_client = httpx.Client(verify=client_tls())
    return _sync_client


class _ControlPool:
    """Keep-alive stdlib connections for the control calls (pause, continue, weights, info), one
    per call in flight, reused while idle under KEEPALIVE_S: ~0.25 ms of CPU a call where httpx's
    client took ~0.7 (1.4 in a run's busy driver; three calls a weight update, 2026-12-07). Failures
    are raised as the httpx errors the callers and `_control`'s resend know (ConnectError,
    WriteError, ReadError, RemoteProtocolError, the timeouts), naming the request."""

    def __init__(self):
        self._idle: dict[tuple, list[tuple[http.client.HTTPConnection, float]]] = {}
        self._lock = threading.Lock()

    def _take(self, key: tuple, timeout: float) -> http.client.HTTPConnection:
        now = time.monotonic()
        with self._lock:
            idle = self._idle.get(key, [])
            while idle:
                conn, since = idle.pop()
                if now - since < KEEPALIVE_S:
                    conn.sock.settimeout(timeout)
                    return conn
                conn.close()
        scheme, host, port = key
        if scheme == "https":
            return http.client.HTTPSConnection(host, port, timeout=timeout, context=client_tls())
        return http.client.HTTPConnection(host, port, timeout=timeout)

    def _give_back(self, key: tuple, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._idle.setdefault(key, []).append((conn, time.monotonic()))

    def request(
        self, method: str, url: str, timeout: float, body: bytes | None, headers: dict
    ) -> tuple[int, bytes]:
        """(status, body) of one request; raises httpx's transport errors."""
        u = urllib.parse.urlsplit(url)
        key = (u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80))
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        conn, stage = self._take(key, timeout), "connect"
        try:
            if conn.sock is None:
                conn.connect()
            stage = "write"
            conn.request(method, target, body=body, headers=headers)
            stage = "read"
            resp = conn.getresponse()
            data = resp.read()
        except BaseException as e:
            conn.close()
            if not isinstance(e, OSError | http.client.HTTPException):
                raise
            raise _transport_error(e, stage, httpx.Request(method, url)) from e
        if resp.will_close:
            conn.close()
        else:
            self._give_back(key, conn)
        return resp.status, data


def _transport_error(e: BaseException, stage: str, request: httpx.Request) -> httpx.TransportError:
    """httpx's error for a stdlib failure at `stage` (connect / write / read)."""
    msg = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if isinstance(e, TimeoutError):
        kind = {"connect": httpx.ConnectTimeout, "write": httpx.WriteTimeout}.get(stage, httpx.ReadTimeout)
    elif stage == "connect":
        kind = httpx.ConnectError
    elif isinstance(e, http.client.HTTPException):  # a closed keep-alive connection, a bad status line
        kind = httpx.RemoteProtocolError
    else:
        kind = httpx.WriteError if stage == "write" else httpx.ReadError
    return kind(msg, request=request)


_pool = _ControlPool()
CONTROL_ATTEMPTS = 3  # a control call lost on the wire (a reset keep-alive connection) is sent again


def _proxied(url: str) -> bool:
    """Whether the environment sends `url` through a proxy (httpx's trust_env, which the stdlib
    connections do not read): those calls keep httpx's client."""
    proxies = urllib.request.getproxies()
    if not proxies:
        return False
    u = urllib.parse.urlsplit(url)
    return u.scheme in proxies and not urllib.request.proxy_bypass(u.hostname or "")


def _control(method: str, url: str, timeout: float, body: dict | None, headers: dict) -> tuple[int, bytes]:
    """One control call (pause, continue, weights, info) -> (status, body), with up to
    CONTROL_ATTEMPTS sends when the connection fails before an answer: a stalled engine's keep-alive
    connection is reset when it resumes, and the first call after it failed the run (the control
    routes are idempotent: the same version, the same pause state)."""
    data = None
    if body is not None:  # httpx's json= encoding
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        headers = {**headers, "Content-Type": "application/json"}
    proxied = _proxied(url)
    for attempt in range(CONTROL_ATTEMPTS):
        try:
            if proxied:
                resp = _sync().request(method, url, timeout=timeout, content=data, headers=headers)
                return resp.status_code, resp.content
            return _pool.request(method, url, timeout, data, headers)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
            if attempt == CONTROL_ATTEMPTS - 1:
                raise
            time.sleep(0.2 * 2**attempt)
    raise AssertionError("unreachable")


def _parse_bytes(content: bytes):
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return content.decode("utf-8", errors="replace")


def post(url: str, path: str, json: dict | None = None, api_key: str | None = None, timeout: float = 60.0):
    """Synchronous POST returning parsed JSON (or text); raises EngineHTTPError on non-2xx."""
    status, content = _control("POST", f"{url.rstrip('/')}{path}", timeout, json or {}, _headers(api_key))
    if status >= 300:
        raise EngineHTTPError(url + path, status, _parse_bytes(content))
    return _parse_bytes(content)


def get(url: str, path: str, api_key: str | None = None, timeout: float = 60.0):
    """Synchronous GET returning parsed JSON (or text); raises EngineHTTPError on non-2xx."""
    status, content = _control("GET", f"{url.rstrip('/')}{path}", timeout, None, _headers(api_key))
    if status >= 300:
        raise EngineHTTPError(url + path, status, _parse_bytes(content))
    return _parse_bytes(content)


class EngineClient:
    """One connection pool for a run: an `httpx.AsyncClient` on its own event-loop thread.

    Synchronous callers use `generate(...)` (blocks); async code on another loop awaits
    `agenerate(...)`. Both reuse the same keep-alive connections, so a rollout does not pay for
    a new client (and its TLS context) or new TCP connections.
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        max_connections: int = 64,
        timeout: float = 600.0,
        lora_path: str | None = None,
        max_retries: int = 8,
    ):
        """`lora_path`: a LoRA run's adapter name (or its AdapterName, read at each request), sent
        with every generate of this client;
        `max_retries` of a retryable answer (--use-fault-tolerance: long enough to outlast an
        engine's replacement)."""
        import threading

        self.url, self.api_key, self._lora = url.rstrip("/"), api_key, lora_path
        self.max_retries = max_retries
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-client", daemon=True)
        self._thread.start()
        limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=KEEPALIVE_S,
        )

        async def make():
            return httpx.AsyncClient(timeout=timeout, limits=limits, verify=client_tls())

        self._client = self.submit(make()).result()
        _LOOP_CLIENTS[self._loop] = self._client

    @property
    def retries(self) -> int:
        """/generate attempts retried so far (a retryable answer or a lost connection), user
        generate functions' calls on this client's loop included."""
        return _RETRIES.get(self._client, 0)

    @property
    def lora_path(self) -> str | None:
        from miles_platform.rollout.base_types import resolve_lora

        return resolve_lora(self._lora)

    def submit(self, coro):
        """Schedule a coroutine on the client's loop; returns a concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _generate(self, input_ids, sampling_params, **kw):
        kw.setdefault("lora_path", self.lora_path)
        kw.setdefault("max_retries", self.max_retries)
        return generate(self.url, input_ids, sampling_params, api_key=self.api_key, client=self._client, **kw)

    def generate(self, input_ids, sampling_params=None, **kw):
        """Blocking POST /generate (a list of prompts -> a list of results)."""
        return self.submit(self._generate(input_ids, sampling_params, **kw)).result()

    async def agenerate(self, input_ids, sampling_params=None, **kw):
        """Awaitable from any other event loop."""
        return await asyncio.wrap_future(self.submit(self._generate(input_ids, sampling_params, **kw)))

    async def astream(self, input_ids, sampling_params, on_result, **kw) -> None:
        """`stream_generate` on this client's pool, awaitable from any other event loop:
        `on_result(i, result)` runs on the caller's loop, each before this returns."""
        caller = asyncio.get_running_loop()
        kw.setdefault("lora_path", self.lora_path)
        kw.setdefault("max_retries", self.max_retries)

        def relay(i, out):  # FIFO on the caller's loop: every result precedes the return
            caller.call_soon_threadsafe(on_result, i, out)

        coro = stream_generate(
            self.url, input_ids, sampling_params, relay, api_key=self.api_key, client=self._client, **kw
        )
        await asyncio.wrap_future(self.submit(coro))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        _LOOP_CLIENTS.pop(self._loop, None)
        self.submit(self._client.aclose()).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
