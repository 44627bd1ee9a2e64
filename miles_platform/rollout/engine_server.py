"""SGLang native HTTP API over an `EngineCore`: same paths and field names, so callers cannot tell it
from a real SGLang server. Extension: `min_weight_version` / `exact_weight_version` -> HTTP 409.

`start_engine_server(...)` runs it in a background thread (tests, Ray actors); `cli_main` runs it in
the foreground (`miles-platform serve-engine`), where SIGTERM stops it cleanly.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from miles_platform.errors import ConfigError, MilesError
from miles_platform.rollout.engine_core import (
    DEFAULT_PAUSE_MAX_QUEUED_REQUESTS,
    DEFAULT_PAUSE_WAIT_TIMEOUT_S,
    EngineCore,
    check_pause_limits,
)
from miles_platform.rollout.engine_routes import (
    control_router,
    generate_router,
    health_router,
    lora_router,
    weights_router,
)
from miles_platform.rollout.generate_hub.tool_call import TOOL_CALL_PARSERS
from miles_platform.rollout.http_common import DEFAULT_MAX_REQUEST_BYTES, WeightRoots, add_guards
from miles_platform.rollout.openai_api import openai_router
from miles_platform.rollout.reasoning import check_reasoning_parser

log = logging.getLogger(__name__)


def create_app(
    core: EngineCore,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    weight_roots: list[str] | None = None,
    served_model_name: str | None = None,
    run_name: str | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The engine's app: SGLang's routes (engine_routes.py) and the OpenAI ones (openai_api.py) behind
    one guard, the run's key (`api_key`) on every route but `GET /health`. `weight_roots`:
    `/update_weights_from_disk` and `/load_lora_adapter` load only from under these (None: any; `train`
    passes the run's own dirs and --hf-checkpoint's parent, `serve-engine` the latter).
    `served_model_name` / `run_name`: the OpenAI model id (openai_api.served_model_id);
    `tool_call_parser` / `reasoning_parser`: SGLang's, for chat answers (openai_api.openai_router)."""
    app = FastAPI(title="miles-platform embedded engine")
    add_guards(app, api_key, max_request_bytes)
    roots = WeightRoots(weight_roots)
    for router in (
        generate_router(core, max_request_bytes),  # first: the hot path matches at once
        openai_router(
            core, max_request_bytes, served_model_name, run_name, tool_call_parser, reasoning_parser
        ),
        health_router(core),
        weights_router(core, max_request_bytes, roots),
        lora_router(core, max_request_bytes, roots),
        control_router(core, max_request_bytes),
    ):
        app.include_router(router)
    return app


def check_chat_parsers(
    tool_call_parser: str | None, reasoning_parser: str | None, prefix: str = "--sglang-"
) -> None:
    """SGLang's `--tool-call-parser` / `--reasoning-parser` names the embedded engine has (ConfigError
    naming the flag and the built ones)."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ConfigError(
            f"{prefix}tool-call-parser {tool_call_parser!r}: not a tool-call parser of the embedded engine; "
            f"built: {sorted(TOOL_CALL_PARSERS)} (SGLang's others: --rollout-engine sglang)"
        )
    if reasoning_parser is not None:
        check_reasoning_parser(reasoning_parser, f"{prefix}reasoning-parser")


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
    dtype: str = "auto",
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
    device: str | None = None,
    mem_fraction_static: float | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    router_dtype: str | None = None,
) -> EngineServer:
    """Start the HTTP engine in a background thread (port 0 = free port). Pass `core` to serve an
    existing EngineCore (it is then not stopped with the server; the pause limits are its own).
    `served_model_name` / `run_name`: the OpenAI model id (openai_api.served_model_id). `device`,
    `mem_fraction_static`: EngineCore's (the CPU and no KV bound by default). `tool_call_parser`,
    `reasoning_parser`: SGLang's names, for chat answers (create_app). `router_dtype`: EngineCore's
    (--moe-router-dtype)."""
    check_chat_parsers(tool_call_parser, reasoning_parser)
    owns = core is None
    if core is None:
        core = EngineCore(
            hf_checkpoint, dtype, max_batch_size, batch_wait_ms, weight_version, num_threads,
            pause_wait_timeout_s, pause_max_queued_requests, device, mem_fraction_static, router_dtype,
        )  # fmt: skip
    try:
        app = create_app(core, api_key, max_request_bytes, weight_roots, served_model_name, run_name,
                         tool_call_parser, reasoning_parser)  # fmt: skip
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
        from miles_platform.cluster.cpu_pinning import pin_others

        pin_others()  # --pin-trainer-cpus: off the trainer ranks' cores (the run's plan, in the env)
        kwargs.setdefault("host", "127.0.0.1")
        self._server = start_engine_server(hf_checkpoint, **kwargs)

    def url(self) -> str:
        return self._server.url

    def locate(self) -> tuple[str, tuple[int, str, float]]:
        """(URL, (pid, Ray node id, process start time)): what engine_fleet.engine_handle records."""
        import os

        import ray

        from miles_platform.weights.transports import process_started

        pid = os.getpid()
        return self._server.url, (pid, ray.get_runtime_context().get_node_id(), process_started(pid))

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

    def release_memory_occupation(self, tags: list[str] | None = None) -> list[str]:
        return self._server.core.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> list[str]:
        return self._server.core.resume_memory_occupation(tags)

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
    ap.add_argument(
        "--dtype", choices=["auto", "fp32", "bf16"], default="auto",
        help="serving dtype (default auto: bf16 on CUDA, fp32 on the CPU)",
    )  # fmt: skip
    ap.add_argument(
        "--device", default="auto",
        help="where the engine computes: cpu, cuda, cuda:N (default auto: cuda:0 when CUDA is available, else cpu)",
    )  # fmt: skip
    ap.add_argument(
        "--mem-fraction-static", type=float, default=None,
        help="SGLang's: weights + KV cache stay under this fraction of the device's memory (default: no bound)",
    )  # fmt: skip
    ap.add_argument(
        "--tool-call-parser", default=None,
        help="SGLang's: the format /v1/chat/completions reads tool calls in (default: qwen25's)",
    )  # fmt: skip
    ap.add_argument(
        "--reasoning-parser", default=None,
        help="SGLang's: chat answers' thinking goes to message.reasoning_content (default: no split)",
    )  # fmt: skip
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
        check_chat_parsers(args.tool_call_parser, args.reasoning_parser, "--")
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
        device=args.device,
        mem_fraction_static=args.mem_fraction_static,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    core = server.core
    print(f"serve-engine: {args.hf_checkpoint} on {server.url} ({core.device}, {core.dtype})", flush=True)
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


def tenant_key_main(argv: list[str]) -> int:
    """`miles-platform engine-key --tenant NAME`: print the key of a run that shares this engine
    (http_common.tenant_key), from the engine's admin key in `$MILES_API_KEY` or `--api-key-file`
    (never argv). The run passes it as its `--api-key`; its adapters are then its own."""
    from miles_platform.rollout.http_common import tenant_key

    ap = argparse.ArgumentParser(allow_abbrev=False, prog="miles-platform engine-key", description=tenant_key_main.__doc__.splitlines()[0])  # fmt: skip
    ap.add_argument("--tenant", required=True, help="the run's name on the shared engine")
    ap.add_argument("--api-key-file", default=None, help="the engine's admin key (default: $MILES_API_KEY)")
    args = ap.parse_args(argv)
    try:
        admin = (
            open(args.api_key_file).read().strip() if args.api_key_file else os.environ.get("MILES_API_KEY")
        )
    except OSError as e:
        ap.error(f"--api-key-file {args.api_key_file}: cannot read it ({e.strerror})")
    if not admin:
        ap.error("the engine's admin key: give --api-key-file or set $MILES_API_KEY")
    try:
        print(tenant_key(admin, args.tenant))
    except ValueError as e:
        ap.error(f"--tenant: {e}")
    return 0
