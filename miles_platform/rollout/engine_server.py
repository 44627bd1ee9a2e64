"""SGLang native HTTP API over an `EngineCore`: same paths and field names, so callers cannot tell it
from a real SGLang server. Extension: `min_weight_version` / `exact_weight_version` -> HTTP 409.

`start_engine_server(...)` runs it in a background thread (tests, Ray actors); `cli_main` runs it in
the foreground (`miles-platform serve-engine`), where SIGTERM stops it cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import posixpath
import signal
import socket
import threading
import time
from dataclasses import dataclass

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from miles_platform.errors import MilesError
from miles_platform.rollout.engine_core import (
    DEFAULT_PAUSE_MAX_QUEUED_REQUESTS,
    DEFAULT_PAUSE_WAIT_TIMEOUT_S,
    EngineCore,
    check_pause_limits,
)
from miles_platform.rollout.engine_requests import EngineStopped, RequestError
from miles_platform.rollout.http_common import (  # noqa: F401 (re-exported for the other servers)
    DEFAULT_MAX_REQUEST_BYTES,
    ENGINE_ERRORS,
    add_guards,
    all_results,
    engine_error,
    error,
    json_body,
)
from miles_platform.rollout.lora_serving import read_adapter_dir
from miles_platform.rollout.openai_api import add_openai_routes

log = logging.getLogger(__name__)


def _weight_root(path: str) -> str:
    if "://" in path:
        scheme, _, rest = path.partition("://")
        return f"{scheme}://{posixpath.normpath('/' + rest).lstrip('/')}".rstrip("/")
    return os.path.realpath(path).rstrip("/")


def create_app(
    core: EngineCore,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    weight_roots: list[str] | None = None,
    served_model_name: str | None = None,
    run_name: str | None = None,
) -> FastAPI:
    """`weight_roots`: `/update_weights_from_disk` loads only directories under these (None: any;
    `train` passes the run's own dirs and --hf-checkpoint's parent, `serve-engine` the latter).
    `served_model_name` / `run_name`: the OpenAI model id (openai_api.served_model_id)."""
    app = FastAPI(title="miles-platform embedded engine")
    add_guards(app, api_key, max_request_bytes)
    add_openai_routes(app, core, max_request_bytes, served_model_name, run_name)
    roots = None if weight_roots is None else [_weight_root(r) for r in weight_roots]

    def allowed(path: str) -> bool:
        real = _weight_root(path)  # an object-store URI is compared as written, less . and ..
        return roots is None or any(real == r or real.startswith(r + "/") for r in roots)

    @app.post("/generate")
    async def generate(request: Request):
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        try:
            # parsing and tokenization off the event loop: a huge prompt cannot stall /health
            futures, is_batch = await asyncio.to_thread(core.submit_json, body)
            results = await all_results(futures)
        except ENGINE_ERRORS as e:
            return engine_error(e)
        return Response(orjson.dumps(results if is_batch else results[0]), media_type="application/json")

    @app.get("/health")
    async def health():
        return Response(status_code=200 if core.is_alive() else 503)

    @app.get("/health_generate")
    async def health_generate():
        # Readiness: the scheduler is alive. No generation, so a paused engine is still healthy.
        return Response(status_code=200 if core.is_alive() else 503)

    @app.get("/get_model_info")
    async def get_model_info():
        return {
            "model_path": core.model_path,
            "tokenizer_path": core.model_path,
            "is_generation": True,
            "weight_version": core.weight_version,
            "context_length": core.context_length,
            "vocab_size": core.vocab_size,
        }

    @app.get("/get_server_info")
    async def get_server_info():
        return {
            "model_path": core.model_path,
            "dtype": str(core.dtype).removeprefix("torch."),
            "max_running_requests": core.max_batch_size,
            "batch_wait_ms": core.batch_wait_s * 1000,
            "context_length": core.context_length,
            "weight_version": core.weight_version,
            "paused": core.paused,
            "pause_wait_timeout_s": core.pause_wait_timeout_s,
            "pause_max_queued_requests": core.pause_max_queued_requests,
            "num_inflight": core.num_inflight(),
            "internal_states": [dict(core.stats)],
            "lora_adapters": core.lora_adapters(),
            "version": "miles-platform-embedded",
        }

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        path = body.get("model_path") if isinstance(body, dict) else None
        if not path:
            return JSONResponse({"success": False, "message": "model_path is required"}, status_code=400)
        if not isinstance(path, str) or not allowed(path):
            msg = f"model_path {path!r} is outside the directories this engine loads weights from: {roots}"
            return JSONResponse({"success": False, "message": msg}, status_code=403)
        try:
            version = await asyncio.to_thread(core.update_weights_from_disk, path, body.get("weight_version"))
        except (MilesError, ValueError, OSError) as e:
            msg = f"update_weights_from_disk failed, kept weight_version {core.weight_version}: {e}"
            return JSONResponse({"success": False, "message": msg}, status_code=400)
        return {"success": True, "message": "Succeeded to update model weights.", "weight_version": version}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        keys = ("master_address", "master_port", "rank_offset", "world_size", "group_name")
        missing = [k for k in keys if not isinstance(body, dict) or k not in body]
        if missing:
            return JSONResponse({"success": False, "message": f"missing fields {missing}"}, status_code=400)
        args = [body[k] for k in keys] + [body.get("backend") or "gloo"]
        try:
            await asyncio.to_thread(core.init_weights_update_group, *args)
        except (MilesError, ValueError, RuntimeError) as e:
            msg = f"init_weights_update_group failed: {e}"
            return JSONResponse({"success": False, "message": msg}, status_code=400)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        keys = ("names", "dtypes", "shapes")
        missing = [k for k in keys if not isinstance(body, dict) or not isinstance(body.get(k), list)]
        if missing:
            return JSONResponse(
                {"success": False, "message": f"missing list fields {missing}"}, status_code=400
            )
        args = [body[k] for k in keys] + [body.get("group_name") or "weight_update_group"]
        try:
            version = await asyncio.to_thread(
                core.update_weights_from_distributed, *args, body.get("weight_version")
            )
        except (MilesError, ValueError, RuntimeError) as e:
            msg = f"update_weights_from_distributed failed, kept weight_version {core.weight_version}: {e}"
            return JSONResponse({"success": False, "message": msg}, status_code=400)
        if body.get("flush_cache", True):
            core.flush_cache()
        return {"success": True, "message": "Succeeded to update model weights.", "weight_version": version}

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request):
        """SGLang's request {"name", "truncate_size"} and answer (a bare list of values)."""
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        name = body.get("name") if isinstance(body, dict) else None
        size = body.get("truncate_size", 100) if isinstance(body, dict) else None
        if not isinstance(name, str) or not isinstance(size, int) or isinstance(size, bool) or size < 1:
            return error(400, 'get_weights_by_name takes {"name": str, "truncate_size": int >= 1}')
        try:
            values = await asyncio.to_thread(core.get_weights_by_name, name, size)
        except RequestError as e:
            return error(400, f"get_weights_by_name: {e}")
        except EngineStopped as e:
            return error(503, str(e), retryable=True)
        return Response(
            orjson.dumps(values, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json"
        )

    @app.post("/weights_checksum")
    async def weights_checksum(request: Request):
        """Our extension: {"names": [...]} (or {} for all) -> {name: {dtype, shape, xxh3_128}}."""
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        names = body.get("names") if isinstance(body, dict) else ...
        if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
            return error(400, 'weights_checksum takes {"names": [str, ...]} (or {} for every parameter)')
        try:
            return await asyncio.to_thread(core.weights_checksums, names)
        except RequestError as e:
            return error(400, f"weights_checksum: {e}")
        except EngineStopped as e:
            return error(503, str(e), retryable=True)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        """SGLang's {"lora_name", "lora_path", "pinned"}; extension: "weight_version" (the adapter's
        policy version, reported in meta_info of the requests it serves)."""
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        name, path = (
            (body.get("lora_name"), body.get("lora_path")) if isinstance(body, dict) else (None, None)
        )
        if not isinstance(name, str) or not isinstance(path, str):
            return _lora_answer(core, False, "load_lora_adapter takes {lora_name: str, lora_path: str}", 400)
        if not allowed(path):
            msg = f"lora_path {path!r} is outside the directories this engine loads weights from: {roots}"
            return _lora_answer(core, False, msg, 403)
        try:
            tensors, config = await asyncio.to_thread(read_adapter_dir, path)
            await asyncio.to_thread(
                core.load_lora_adapter, name, tensors, config, body.get("weight_version"), path
            )
        except (MilesError, ValueError, OSError, KeyError) as e:
            return _lora_answer(core, False, f"load_lora_adapter {name!r} failed: {e}", 400)
        return _lora_answer(core, True, "")

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        name = body.get("lora_name") if isinstance(body, dict) else None
        try:
            await asyncio.to_thread(core.unload_lora_adapter, name)
        except RequestError as e:
            return _lora_answer(core, False, str(e), 400)
        return _lora_answer(core, True, "")

    @app.post("/get_lora_adapter_checksums")
    async def get_lora_adapter_checksums(request: Request):
        """Extension (not SGLang's): SHA-256 per served adapter tensor, for --check-lora-weight-equal."""
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        try:
            return await asyncio.to_thread(core.get_lora_adapter_checksums, (body or {}).get("lora_name"))
        except RequestError as e:
            return error(400, str(e))

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        try:
            await asyncio.to_thread(core.pause_generation, (body or {}).get("mode", "abort"))
        except RequestError as e:
            return error(400, str(e))
        return {"status": "ok", "message": "Generation paused."}

    @app.post("/continue_generation")
    async def continue_generation():
        core.continue_generation()
        return {"status": "ok", "message": "Generation continued."}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        core.flush_cache()
        return Response("Cache flushed.", status_code=200)

    return app


def _lora_answer(core: EngineCore, success: bool, message: str, status: int = 200) -> JSONResponse:
    """SGLang's LoRA update answer: success, error_message, loaded_adapters (name -> path)."""
    loaded = {n: a["lora_path"] for n, a in core.lora_adapters().items()}
    body = {"success": success, "error_message": message, "loaded_adapters": loaded}
    return JSONResponse(body, status_code=status)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (port 0 = a free port) with SO_REUSEADDR so a restarted server can take its old port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


@dataclass
class ServerThread:
    """A uvicorn server running in a daemon thread."""

    server: uvicorn.Server
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve_in_thread(app, host: str, port: int, name: str, lifespan: str = "off") -> ServerThread:
    sock = bind_socket(host, port)
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan=lifespan, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{name} on {host}:{port} did not start")
        time.sleep(0.01)
    sock.close()  # uvicorn holds its own duplicate of the listening socket
    return ServerThread(server, thread, host, port)


class ServerHandle:
    """A server running in a background thread: `.url`, `.port`, `.stop()`."""

    def __init__(self, server: ServerThread):
        self._server = server

    @property
    def url(self) -> str:
        return self._server.url

    @property
    def port(self) -> int:
        return self._server.port

    def stop(self) -> None:
        self._server.stop()


class EngineServer(ServerHandle):
    """Handle for a background engine server: `.url`, `.port`, `.core`, `.stop()`."""

    def __init__(self, core: EngineCore, server: ServerThread, owns_core: bool):
        super().__init__(server)
        self.core, self._owns_core = core, owns_core

    def stop(self) -> None:
        super().stop()
        if self._owns_core:
            self.core.stop()


def start_engine_server(
    hf_checkpoint: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    dtype: str = "fp32",
    max_batch_size: int = 512,
    batch_wait_ms: float = 5.0,
    weight_version: int = 0,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    core: EngineCore | None = None,
    num_threads: int | None = None,
    weight_roots: list[str] | None = None,
    pause_wait_timeout_s: float = DEFAULT_PAUSE_WAIT_TIMEOUT_S,
    pause_max_queued_requests: int = DEFAULT_PAUSE_MAX_QUEUED_REQUESTS,
    served_model_name: str | None = None,
    run_name: str | None = None,
) -> EngineServer:
    """Start the HTTP engine in a background thread (port 0 = free port). Pass `core` to serve an
    existing EngineCore (it is then not stopped with the server; the pause limits are its own).
    `served_model_name` / `run_name`: the OpenAI model id (openai_api.served_model_id)."""
    owns = core is None
    if core is None:
        core = EngineCore(
            hf_checkpoint, dtype, max_batch_size, batch_wait_ms, weight_version, num_threads,
            pause_wait_timeout_s, pause_max_queued_requests,
        )  # fmt: skip
    try:
        app = create_app(core, api_key, max_request_bytes, weight_roots, served_model_name, run_name)
        thread = serve_in_thread(app, host, port, "engine-http")
    except Exception:
        if owns:
            core.stop()
        raise
    return EngineServer(core, thread, owns)


class EngineActor:
    """Ray actor body: `ray.remote(EngineActor)` (as rollout/engine_fleet.py does) turns it into an actor that
    serves HTTP for the router and takes in-process weight updates from the trainer."""

    def __init__(self, hf_checkpoint: str, **kwargs):
        kwargs.setdefault("host", "127.0.0.1")
        self._server = start_engine_server(hf_checkpoint, **kwargs)

    def url(self) -> str:
        return self._server.url

    def update_weights_from_tensors(self, named_tensors: dict, weight_version: int) -> int:
        self._server.core.update_weights_from_tensors(named_tensors, weight_version)
        return self._server.core.weight_version

    def update_weights_from_disk(self, path: str, weight_version: int | None = None) -> int:
        return self._server.core.update_weights_from_disk(path, weight_version)

    def load_lora_adapter(self, name: str, tensors: dict, config: dict, weight_version: int) -> int:
        """In-process adapter update (`--update-weight-transfer-mode tensor` with --lora-rank > 0):
        replaces the adapter of that name in one step."""
        return self._server.core.load_lora_adapter(name, tensors, config, weight_version, replace=True)

    def get_weight_version(self) -> int:
        return self._server.core.weight_version

    def get_weights(self) -> dict:
        return self._server.core.get_weights()

    def shutdown(self) -> None:
        self._server.stop()


def cli_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="miles-platform serve-engine", description=__doc__.splitlines()[0]
    )
    ap.add_argument(
        "--hf-checkpoint", required=True, help="HF checkpoint dir (config.json, safetensors, tokenizer)"
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument(
        "--api-key",
        default=os.environ.get("MILES_API_KEY"),
        help="require Authorization: Bearer <key> (default: $MILES_API_KEY)",
    )
    ap.add_argument(
        "--served-model-name",
        default=None,
        help="the model id of the OpenAI routes (/v1/models; default: the checkpoint's absolute path)",
    )
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--max-running-requests", type=int, default=512, help="max batch size")
    ap.add_argument("--batch-wait-ms", type=float, default=5.0)
    ap.add_argument("--weight-version", type=int, default=0)
    ap.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads of the engine")
    ap.add_argument(
        "--pause-wait-timeout-s",
        type=float,
        default=DEFAULT_PAUSE_WAIT_TIMEOUT_S,
        help="a request held by /pause_generation longer than this gets 503 (retryable)",
    )
    ap.add_argument(
        "--pause-max-queued-requests",
        type=int,
        default=DEFAULT_PAUSE_MAX_QUEUED_REQUESTS,
        help="while paused, requests beyond this many queued get 503 at once",
    )
    ap.add_argument(
        "--allow-weights-from",
        nargs="+",
        default=None,
        metavar="DIR",
        help="/update_weights_from_disk loads only under these dirs (default: --hf-checkpoint's parent)",
    )
    args = ap.parse_args(argv)
    try:  # before the model loads
        check_pause_limits(args.pause_wait_timeout_s, args.pause_max_queued_requests)
    except MilesError as e:
        ap.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server = start_engine_server(
        args.hf_checkpoint,
        args.host,
        args.port,
        args.api_key,
        args.dtype,
        args.max_running_requests,
        args.batch_wait_ms,
        args.weight_version,
        num_threads=args.num_threads,
        weight_roots=args.allow_weights_from or [os.path.dirname(os.path.abspath(args.hf_checkpoint))],
        pause_wait_timeout_s=args.pause_wait_timeout_s,
        pause_max_queued_requests=args.pause_max_queued_requests,
        served_model_name=args.served_model_name,
    )
    print(f"serve-engine: {args.hf_checkpoint} on {server.url}", flush=True)
    wait_for_stop_signal()
    server.stop()
    return 0


def wait_for_stop_signal() -> None:
    """Block the main thread until SIGINT or SIGTERM (the servers run in daemon threads)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
