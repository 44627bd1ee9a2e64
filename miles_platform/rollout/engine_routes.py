"""The embedded engine's SGLang routes, one `APIRouter` per concern, over an `EngineCore`:
generation (`/generate`), health, info and metrics, weights (update, read back, checksums), LoRA adapters,
and generation control (pause / continue / flush). `engine_server.create_app` mounts them with the
OpenAI routes (openai_api.py) behind one guard (http_common.add_guards): every route needs the
run's key except `GET /health`.
"""

from __future__ import annotations

import asyncio

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from miles_platform.errors import MilesError
from miles_platform.rollout.engine_abort import abort_requests
from miles_platform.rollout.engine_core import EngineCore
from miles_platform.rollout.engine_requests import AdapterOwned, EngineStopped, RequestError
from miles_platform.rollout.http_common import (
    ENGINE_ERRORS,
    WeightRoots,
    all_results,
    caller_tenant,
    engine_error,
    error,
    json_body,
    streamed_results,
)
from miles_platform.rollout.lora_serving import read_adapter_dir
from miles_platform.rollout.metrics import CONTENT_TYPE, engine_exposition


def generate_router(core: EngineCore, max_request_bytes: int) -> APIRouter:
    """`POST /generate`: SGLang's body, one prompt or a batch."""
    router = APIRouter()

    @router.post("/generate")
    async def generate(request: Request):
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        stream = bool(body.pop("stream", False))  # each prompt's result as it finishes (http_common)
        try:
            # parsing and tokenization off the event loop: a huge prompt cannot stall /health
            futures, is_batch = await asyncio.to_thread(core.submit_json, body)
            if stream:
                return StreamingResponse(
                    streamed_results(futures, is_batch), media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )  # fmt: skip
            results = await all_results(futures)
        except ENGINE_ERRORS as e:
            return engine_error(e)
        return Response(orjson.dumps(results if is_batch else results[0]), media_type="application/json")

    return router


def health_router(core: EngineCore) -> APIRouter:
    """Liveness, readiness, metrics and what the engine serves (`/get_model_info`, `/get_server_info`)."""
    router = APIRouter()

    @router.get("/health")
    async def health():
        return Response(status_code=200 if core.is_alive() else 503)

    @router.get("/health_generate")
    async def health_generate():
        # Readiness: the scheduler is alive. No generation, so a paused engine is still healthy.
        return Response(status_code=200 if core.is_alive() else 503)

    @router.get("/metrics")
    async def metrics(request: Request):
        """Prometheus text (rollout/metrics.py): SGLang's names where SGLang has them."""
        text = engine_exposition(core, request.app.state.http_counts)
        return Response(text, media_type=CONTENT_TYPE)

    @router.get("/get_model_info")
    async def get_model_info():
        return {
            "model_path": core.model_path,
            "tokenizer_path": core.model_path,
            "is_generation": True,
            "weight_version": core.weight_version,
            "context_length": core.context_length,
            "vocab_size": core.vocab_size,
        }

    @router.get("/get_server_info")
    async def get_server_info():
        return {
            "model_path": core.model_path,
            "dtype": str(core.dtype).removeprefix("torch."),
            "quantization": core.served_quant_format(),  # fp8 / int4 / None, as served now
            "device": str(core.device),
            "mem_fraction_static": core.mem_fraction_static,
            "kv_budget_tokens": core.kv_budget,
            "memory_released": core.memory_released,
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

    return router


def weights_router(core: EngineCore, max_request_bytes: int, roots: WeightRoots) -> APIRouter:
    """Base weight updates (from disk under `roots`, from a trainer's broadcast group) and reading
    the served weights back (values, checksums)."""
    router = APIRouter()

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        path = body.get("model_path") if isinstance(body, dict) else None
        if not path:
            return JSONResponse({"success": False, "message": "model_path is required"}, status_code=400)
        if not isinstance(path, str) or not roots.allows(path):
            return JSONResponse(
                {"success": False, "message": roots.refusal("model_path", path)}, status_code=403
            )
        try:
            version = await asyncio.to_thread(core.update_weights_from_disk, path, body.get("weight_version"))
        except (MilesError, ValueError, OSError) as e:
            msg = f"update_weights_from_disk failed, kept weight_version {core.weight_version}: {e}"
            return JSONResponse({"success": False, "message": msg}, status_code=400)
        return {"success": True, "message": "Succeeded to update model weights.", "weight_version": version}

    @router.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        """SGLang's path. Body: {"named_tensors": <shared-memory descriptor>, "load_format":
        "shared_memory", "weight_version"} (weights/shared_tensors.py); SGLang's pickled
        `serialized_named_tensors` are refused (no unpickling of request bodies here)."""
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        if not isinstance(body, dict) or "serialized_named_tensors" in body:
            msg = ("update_weights_from_tensor takes {named_tensors: <descriptor>, load_format: shared_memory}; "
                   "pickled serialized_named_tensors are not accepted by the embedded engine")  # fmt: skip
            return JSONResponse({"success": False, "message": msg}, status_code=400)
        if body.get("load_format", "shared_memory") != "shared_memory":
            msg = f"load_format {body.get('load_format')!r}: the embedded engine takes shared_memory"
            return JSONResponse({"success": False, "message": msg}, status_code=400)
        try:
            version = await asyncio.to_thread(
                core.update_weights_from_tensor, body.get("named_tensors"), body.get("weight_version")
            )
        except (MilesError, ValueError, KeyError, TypeError) as e:
            msg = f"update_weights_from_tensor failed, kept weight_version {core.weight_version}: {e}"
            return JSONResponse({"success": False, "message": msg}, status_code=400)
        return {"success": True, "message": "Succeeded to update model weights.", "weight_version": version}

    @router.post("/init_weights_update_group")
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

    @router.post("/update_weights_from_distributed")
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

    @router.api_route("/get_weights_by_name", methods=["GET", "POST"])
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

    @router.post("/weights_checksum")
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

    return router


def lora_router(core: EngineCore, max_request_bytes: int, roots: WeightRoots) -> APIRouter:
    """SGLang's LoRA adapter routes (adapters load only from under `roots`) and our checksums."""
    router = APIRouter()

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        """SGLang's {"lora_name", "lora_path", "pinned"}; extension: "weight_version" (the adapter's
        policy version, reported in meta_info of the requests it serves). The adapter belongs to the
        key that loaded it: a tenant key (http_common.tenant_key) may unload only its own, 403 else."""
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        name, path = (
            (body.get("lora_name"), body.get("lora_path")) if isinstance(body, dict) else (None, None)
        )
        if not isinstance(name, str) or not isinstance(path, str):
            return _lora_answer(core, False, "load_lora_adapter takes {lora_name: str, lora_path: str}", 400)
        if not roots.allows(path):
            return _lora_answer(core, False, roots.refusal("lora_path", path), 403)
        owner = caller_tenant(request)
        try:
            core.check_adapter_owner(name, owner, "replace")  # before reading the dir: 403, not 400
            tensors, config = await asyncio.to_thread(read_adapter_dir, path)
            await asyncio.to_thread(
                core.load_lora_adapter, name, tensors, config, body.get("weight_version"), path, owner=owner
            )
        except AdapterOwned as e:
            return _lora_answer(core, False, str(e), 403)
        except (MilesError, ValueError, OSError, KeyError) as e:
            return _lora_answer(core, False, f"load_lora_adapter {name!r} failed: {e}", 400)
        return _lora_answer(core, True, "")

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        name = body.get("lora_name") if isinstance(body, dict) else None
        try:
            await asyncio.to_thread(core.unload_lora_adapter, name, owner=caller_tenant(request))
        except AdapterOwned as e:
            return _lora_answer(core, False, str(e), 403)
        except RequestError as e:
            return _lora_answer(core, False, str(e), 400)
        return _lora_answer(core, True, "")

    @router.post("/get_lora_adapter_checksums")
    async def get_lora_adapter_checksums(request: Request):
        """Extension (not SGLang's): SHA-256 per served adapter tensor, for --check-lora-weight-equal."""
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        try:
            return await asyncio.to_thread(core.get_lora_adapter_checksums, (body or {}).get("lora_name"))
        except RequestError as e:
            return error(400, str(e))

    return router


def _lora_answer(core: EngineCore, success: bool, message: str, status: int = 200) -> JSONResponse:
    """SGLang's LoRA update answer: success, error_message, loaded_adapters (name -> path)."""
    loaded = {n: a["lora_path"] for n, a in core.lora_adapters().items()}
    body = {"success": success, "error_message": message, "loaded_adapters": loaded}
    return JSONResponse(body, status_code=status)


def control_router(core: EngineCore, max_request_bytes: int) -> APIRouter:
    """Generation control around a weight update: pause (abort / retract / in_place), continue, flush;
    colocation's memory release / resume; aborting requests (SGLang's /abort_request)."""
    router = APIRouter()

    @router.post("/pause_generation")
    async def pause_generation(request: Request):
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        try:
            await asyncio.to_thread(core.pause_generation, (body or {}).get("mode", "abort"))
        except RequestError as e:
            return error(400, str(e))
        return {"status": "ok", "message": "Generation paused."}

    @router.post("/abort_request")
    async def abort_request(request: Request):
        """SGLang's {"rid": id} or {"abort_all": true}: those requests answer now, finish_reason
        abort, with their partial output (rollout/engine_abort.py)."""
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        body = body or {}
        rid = body.get("rid")
        n = await asyncio.to_thread(
            abort_requests, core, None if rid is None else str(rid), bool(body.get("abort_all"))
        )
        return {"status": "ok", "aborted": n}

    @router.post("/continue_generation")
    async def continue_generation():
        core.continue_generation()
        return {"status": "ok", "message": "Generation continued."}

    @router.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request):
        """SGLang's {"tags": ["weights", "kv_cache", "cuda_graph"] | null} (engine_memory.py)."""
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        try:
            released = await asyncio.to_thread(core.release_memory_occupation, (body or {}).get("tags"))
        except RequestError as e:
            return error(400, f"release_memory_occupation: {e}")
        return {"success": True, "message": "Succeeded to release memory.", "released": released}

    @router.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request):
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        try:
            released = await asyncio.to_thread(core.resume_memory_occupation, (body or {}).get("tags"))
        except RequestError as e:
            return error(400, f"resume_memory_occupation: {e}")
        return {"success": True, "message": "Succeeded to resume memory.", "released": released}

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        core.flush_cache()
        return Response("Cache flushed.", status_code=200)

    return router
