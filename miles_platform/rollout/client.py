"""HTTP client helpers for engines and the router (SGLang API).

`generate` retries the retryable answers (409 weight-version conflict, 503 unavailable, connection
errors) a bounded number of times with exponential backoff; anything else raises `EngineHTTPError`.
"""

from __future__ import annotations

import asyncio

import httpx

RETRYABLE_STATUS = (409, 503)


class EngineHTTPError(Exception):
    """A non-2xx answer: `.status` and `.body` (parsed JSON when possible)."""

    def __init__(self, url: str, status: int, body):
        self.status, self.body = status, body
        super().__init__(f"{url}: HTTP {status}: {body}")


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _parse(resp: httpx.Response):
    try:
        return resp.json()
    except ValueError:
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
) -> dict | list[dict]:
    """POST {url}/generate; returns SGLang's response (a list for a batch of prompts)."""
    body = {
        "input_ids": input_ids,
        "sampling_params": sampling_params or {},
        "return_logprob": return_logprob,
    }
    if min_weight_version is not None:
        body["min_weight_version"] = min_weight_version
    if exact_weight_version is not None:
        body["exact_weight_version"] = exact_weight_version
    own = client is None
    client = client or httpx.AsyncClient(timeout=timeout)
    try:
        delay = backoff_s
        for attempt in range(max_retries + 1):
            last_try = attempt == max_retries
            try:
                resp = await client.post(f"{url.rstrip('/')}/generate", json=body, headers=_headers(api_key))
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                if last_try:
                    raise
            else:
                if resp.status_code < 300:
                    return resp.json()
                if resp.status_code not in RETRYABLE_STATUS or last_try:
                    raise EngineHTTPError(url, resp.status_code, _parse(resp))
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_backoff_s)
        raise AssertionError("unreachable")
    finally:
        if own:
            await client.aclose()


def post(url: str, path: str, json: dict | None = None, api_key: str | None = None, timeout: float = 60.0):
    """Synchronous POST returning parsed JSON (or text); raises EngineHTTPError on non-2xx."""
    resp = httpx.post(f"{url.rstrip('/')}{path}", json=json or {}, headers=_headers(api_key), timeout=timeout)
    if resp.status_code >= 300:
        raise EngineHTTPError(url + path, resp.status_code, _parse(resp))
    return _parse(resp)


def get(url: str, path: str, api_key: str | None = None, timeout: float = 60.0):
    """Synchronous GET returning parsed JSON (or text); raises EngineHTTPError on non-2xx."""
    resp = httpx.get(f"{url.rstrip('/')}{path}", headers=_headers(api_key), timeout=timeout)
    if resp.status_code >= 300:
        raise EngineHTTPError(url + path, resp.status_code, _parse(resp))
    return _parse(resp)
