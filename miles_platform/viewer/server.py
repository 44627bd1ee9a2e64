"""`miles-platform viewer`: a read-only web page over a storage root's catalog, on 127.0.0.1 only.

    GET /          the runs
    GET /samples   one run's samples: version or rollout range, filters, sort, pages
    GET /sample    one sample: prompt, response tokens shaded, turns, its group side by side
    GET /image     a diffusion sample's PNG
    GET /prompt_image   an image a vision-language sample saw, by content hash (prompt_images.py)
    GET /api/samples, /api/sample   the same as JSON
    GET /health    liveness (the only route without the token)

Like Jupyter, it prints its URL with a token at start (`?token=...`; $MILES_VIEWER_TOKEN sets it,
else a random one): the first visit with it sets an HttpOnly cookie for this port, so later links
(the Dagster UI's `viewer` metadata) need no token, and another local user cannot read the samples.
Every request without the token or the cookie gets 401. `$MILES_VIEWER_URL` set where Dagster runs
makes each `rollout_shards` / `policy_versions` partition link here (ops/version_events.py).
"""

from __future__ import annotations

import argparse
import hmac
import os
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from miles_platform.errors import MilesError
from miles_platform.viewer import DEFAULT_PORT, VIEWER_URL_ENV, pages
from miles_platform.viewer.prompt_images import PromptImages
from miles_platform.viewer.queries import SampleQuery, ViewerError, ViewerStore
from miles_platform.viewer.tokens import SHADES, token_texts, token_values

HOST = "127.0.0.1"
TOKEN_ENV = "MILES_VIEWER_TOKEN"


def create_app(root: str, token: str, cookie: str = "miles_viewer") -> FastAPI:
    """The viewer's app over the storage root `root`; every route but /health needs `token` (as
    `?token=`, which sets the cookie `cookie`, or the cookie, or `Authorization: Bearer`)."""
    store = ViewerStore(root)
    prompt_images = PromptImages(store.paths, store.catalog.remote)
    app = FastAPI(title="miles-platform viewer", docs_url=None, redoc_url=None, openapi_url=None)
    want = token.encode()

    def valid(given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), want)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if request.url.path == "/health":
            return await call_next(request)
        given = request.query_params.get("token")
        if given is not None:  # the printed URL: remember it in a cookie, drop it from the address bar
            if not valid(given):
                return _unauthorized("wrong token")
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            target = request.url.path + ("?" + urlencode(rest) if rest else "")
            response = RedirectResponse(target, status_code=303)
            response.set_cookie(cookie, token, httponly=True, samesite="lax", path="/")
            return response
        scheme, _, bearer = (request.headers.get("authorization") or "").partition(" ")
        if valid(request.cookies.get(cookie)) or (scheme.lower() == "bearer" and valid(bearer.strip())):
            return await call_next(request)
        return _unauthorized("this viewer needs its token")

    @app.exception_handler(ViewerError)
    async def refused(request: Request, exc: ViewerError):
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": {"message": str(exc)}}, status_code=exc.status)
        return HTMLResponse(pages.layout("error", pages.error_box(str(exc)), root), status_code=exc.status)

    @app.exception_handler(MilesError)
    async def unavailable(request: Request, exc: MilesError):  # the catalog is locked or unreadable
        return JSONResponse({"error": {"message": str(exc)}}, status_code=503)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/", response_class=HTMLResponse)
    def runs() -> str:
        with store.connection() as con:
            return pages.runs_page(store.runs(con), root)

    @app.get("/samples", response_class=HTMLResponse)
    def samples(request: Request) -> HTMLResponse:
        params = dict(request.query_params)
        with store.connection() as con:
            run_rows = store.runs(con)
            if not params.get("run"):
                return HTMLResponse(pages.runs_page(run_rows, root))
            runs = [r["run"] for r in run_rows]
            total, rows, error, status, q = 0, [], None, 200, None
            try:  # a refused value: the form stays as sent, with the message above the list
                q = SampleQuery.from_params(params)
                total, rows = store.samples(con, q)
            except ViewerError as exc:
                q = q or SampleQuery.lenient(params)
                error, status = str(exc), exc.status
            versions, images = store.versions(con, q.run), store.has_images(con, q.run)
            return HTMLResponse(
                pages.samples_page(q, runs, versions, total, rows, root, images, error), status
            )

    @app.get("/api/samples")
    def api_samples(request: Request) -> dict[str, Any]:
        q = SampleQuery.from_params(dict(request.query_params))
        with store.connection() as con:
            total, rows = store.samples(con, q)
        return {"total": total, "page": q.page, "page_size": q.page_size, "rows": pages.json_safe(rows)}

    def one(run: str, rollout_id: int, index: int) -> dict[str, Any]:
        with store.connection() as con:
            sample = store.sample(con, run, rollout_id, index)
            train, n_train = store.train_sample(con, run, rollout_id, index)
            group = store.group(con, run, rollout_id, sample["group_index"])
            neighbours = store.neighbours(con, run, rollout_id, index)
            hf = store.hf_checkpoint(con, run)
        return dict(sample=sample, train=train, n_train=n_train, group=group, neighbours=neighbours, hf=hf)

    @app.get("/sample", response_class=HTMLResponse)
    def sample(run: str, rollout_id: int, index: int, shade: str = "") -> str:
        got = one(run, rollout_id, index)
        tv = token_values(got["sample"], got["train"])
        if shade and shade not in SHADES:
            raise ViewerError(f"shade={shade!r}: one of {', '.join(SHADES)}")
        shade = shade if shade in tv.available() else tv.default_shade()
        texts = token_texts(got["hf"], list(got["sample"].get("response_tokens") or []))
        return pages.sample_page(
            got["sample"],
            got["train"],
            got["n_train"],
            tv,
            shade,
            texts,
            got["group"],
            got["neighbours"],
            root,
        )

    @app.get("/api/sample")
    def api_sample(run: str, rollout_id: int, index: int) -> dict[str, Any]:
        got = one(run, rollout_id, index)
        tv = token_values(got["sample"], got["train"])
        return pages.json_safe(
            {"sample": got["sample"], "train": got["train"], "train_rows": got["n_train"], "group": got["group"],
             "shades": tv.available(), "default_shade": tv.default_shade()}
        )  # fmt: skip

    @app.get("/image")
    def image(run: str, rollout_id: int, index: int) -> Response:
        with store.connection() as con:
            png = store.image(con, run, rollout_id, index)
        return Response(png, media_type="image/png", headers={"Cache-Control": "private, max-age=3600"})

    @app.get("/prompt_image")
    def prompt_image(run: str, hash: str) -> Response:
        data, media_type = prompt_images.get(run, hash)
        return Response(data, media_type=media_type, headers={"Cache-Control": "private, max-age=3600"})

    return app


def _unauthorized(reason: str) -> HTMLResponse:
    body = (
        f"<!doctype html><title>viewer: token needed</title><h2>{reason}</h2><p>Open the URL "
        "<code>miles-platform viewer</code> printed when it started (it ends in <code>?token=...</code>); "
        "the browser keeps it in a cookie afterwards.</p>"
    )
    return HTMLResponse(body, status_code=401)


# ---------------------------------------------------------------------- serving


@dataclass
class Viewer:
    """A viewer serving in a background thread (tests, scripts): `.url` (with the token), `.stop()`."""

    server: uvicorn.Server
    thread: threading.Thread
    port: int
    token: str

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base_url}/?token={self.token}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _bind(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, port))
    return sock


def _server(root: str, sock: socket.socket, token: str) -> uvicorn.Server:
    port = sock.getsockname()[1]
    app = create_app(root, token, cookie=f"miles_viewer_{port}")  # cookies are per host, not per port
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))


def _serve_in_thread(server: uvicorn.Server, sock: socket.socket) -> threading.Thread:
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="viewer-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the viewer on {HOST}:{sock.getsockname()[1]} did not start")
        time.sleep(0.01)
    return thread


def start_viewer(root: str, port: int = 0, token: str | None = None) -> Viewer:
    """Serve the viewer of `root` on 127.0.0.1:`port` (0: a free one) in a daemon thread."""
    token = token or secrets.token_urlsafe(24)
    sock = _bind(port)
    server = _server(root, sock, token)
    return Viewer(server, _serve_in_thread(server, sock), sock.getsockname()[1], token)


def cli_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="miles-platform viewer",
        description="browse rollout samples of a storage root on 127.0.0.1 (read-only; a token in the URL)",
    )
    ap.add_argument("--storage-root", default=os.environ.get("MILES_STORAGE_ROOT", ".miles"))
    ap.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port on {HOST} (0: a free one)")
    args = ap.parse_args(argv)
    if not 0 <= args.port <= 65535:
        ap.error(f"--port {args.port}: 0 to 65535")
    store = ViewerStore(args.storage_root)
    error = store.paths.missing_root_error("miles-platform viewer")
    if error:
        print(error, file=sys.stderr)
        return 2
    try:
        sock = _bind(args.port)
    except OSError as e:
        print(
            f"miles-platform viewer: error: cannot listen on {HOST}:{args.port} ({e}); pass --port",
            file=sys.stderr,
        )
        return 2
    token = os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
    port = sock.getsockname()[1]
    server = _server(store.paths.root, sock, token)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before serving: uvicorn leaves a thread's signals alone
        signal.signal(sig, lambda *_: stop.set())
    thread = _serve_in_thread(server, sock)
    print(
        f"viewer: {store.paths.root} on http://{HOST}:{port}/?token={token}\n"
        f"  open that URL once (the browser keeps the token in a cookie); for links from the Dagster UI "
        f"start Dagster with {VIEWER_URL_ENV}=http://{HOST}:{port}",
        flush=True,
    )
    while not stop.wait(0.5) and thread.is_alive():
        pass
    server.should_exit = True
    thread.join(timeout=10)
    return 0
