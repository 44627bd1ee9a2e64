"""One TLS context per process for the platform's HTTP clients (a leaf: imports httpx only).

`httpx.Client()` / `AsyncClient()` / `httpx.get(...)` with the default `verify=True` build a new
`ssl.SSLContext` each time and load certifi's CA bundle into it: ~40 ms of CPU on a quiet 2-core
machine, ~100 ms on a loaded one (2026-12-06), even for a plain `http://127.0.0.1` URL that never
uses it. Clients that are made per call (a remote reward per sample, an agentic session per sample,
each engine health probe) paid it every time. `verify=client_tls()` is the same verification
(httpx's own default: certifi, or `SSL_CERT_FILE` / `SSL_CERT_DIR` as read at the first call),
built once; an `SSLContext` may be shared by clients and threads."""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def client_tls() -> ssl.SSLContext:
    """httpx's default client context (`verify=True`), made once per process."""
    return httpx.create_ssl_context()
