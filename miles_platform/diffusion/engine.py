"""The embedded diffusion engine: sglang-diffusion's rollout endpoint on CPU, recording trajectories.

    POST /rollout/generate     {"requests": [{"prompt", "num_outputs_per_prompt", "seed",
                                               "sampling_params": {...}}, ...]}   (or one request)
                               -> application/msgpack {"outputs": [{"meta_info", "tensors"}]}
    POST /update_weights_from_disk  {"model_path", "weight_version"}
    GET  /health  /health_generate  /get_model_info  /get_server_info

One request is one microgroup: its `seed` expands to seed, seed+1, ... seed+M-1, one RNG stream per
output (initial noise, then one noise draw per step). `tensors` is a safetensors blob (msgpack raw
bytes, no base64): `images` [M,C,H,W], and for the recorded steps `latents` / `next_latents`
[M,K,C,H,W], `log_probs`, `sigmas`, `next_sigmas` [M,K], `sigma_max` [M], `steps` [K],
`sigma_grid` [S+1] (and `model_output` with `debug_mode`). All requests of one body denoise as
one batch per distinct sampling setting: on a tiny DiT per-request overhead is the cost to avoid.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import msgpack
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from safetensors.torch import load_file, save

from miles_platform.diffusion.family import TINY_DIT, dit_forward, engine_cast
from miles_platform.rollout.engine_server import ServerHandle, serve_in_thread
from miles_platform.rollout.http_common import (
    DEFAULT_MAX_REQUEST_BYTES,
    WeightRoots,
    add_guards,
    error,
    json_body,
)

SAMPLING_KEYS = ("num_inference_steps", "noise_level", "sde_type", "sde_steps", "return_steps",
                 "log_prob_no_const", "flow_shift", "debug_mode", "height", "width")  # fmt: skip


class RequestError(ValueError):
    pass


class DiffusionEngineCore:
    """The DiT, its text encoder and the SDE backends; `generate` is thread-safe (one batch at a time)."""

    def __init__(self, hf_checkpoint: str, dit_precision: str = "fp32", weight_version: int = 0,
                 num_threads: int | None = None):  # fmt: skip
        from miles_platform.diffusion.model import load_pipeline

        if num_threads:
            torch.set_num_threads(num_threads)
        self.hf_checkpoint, self.dit_precision = hf_checkpoint, dit_precision
        self.pipe = load_pipeline(hf_checkpoint)
        self.pipe.transformer.eval().requires_grad_(False)
        engine_cast(self.pipe.transformer, dit_precision)
        self.weight_version = weight_version
        self.size = int(self.pipe.transformer.config.sample_size)
        self.channels = int(self.pipe.transformer.config.in_channels)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ generate
    def _params(self, req: dict[str, Any]) -> dict[str, Any]:
        sp = dict(req.get("sampling_params") or {})
        unknown = sorted(set(sp) - set(SAMPLING_KEYS))
        if unknown:
            raise RequestError(f"sampling_params: unknown keys {unknown}; known: {list(SAMPLING_KEYS)}")
        steps = int(sp.get("num_inference_steps", 10))
        if steps < 1:
            raise RequestError("num_inference_steps must be >= 1")
        for k in ("height", "width"):
            if sp.get(k) not in (None, self.size):
                raise RequestError(f"{k} {sp[k]}: this DiT generates {self.size}x{self.size}")
        sde_type = sp.get("sde_type", "sde")
        sde_steps = [int(i) for i in sp.get("sde_steps", []) or []]
        ret = sp.get("return_steps")
        ret = list(range(steps)) if ret == "all" else [int(i) for i in (ret or [])]
        for i in (*sde_steps, *ret):
            if not 0 <= i < steps:
                raise RequestError(f"step index {i} outside [0, {steps})")
        return {"steps": steps, "noise_level": float(sp.get("noise_level", 0.7)), "sde_type": sde_type,
                "sde_steps": tuple(sorted(set(sde_steps))), "return_steps": tuple(sorted(set(ret))),
                "no_const": bool(sp.get("log_prob_no_const", False)), "debug": bool(sp.get("debug_mode", False)),
                "shift": float(sp.get("flow_shift") or self.pipe.flow_shift)}  # fmt: skip

    def generate(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        parsed = []
        for i, req in enumerate(requests):
            if not isinstance(req, dict) or not isinstance(req.get("prompt"), str):
                raise RequestError(f"requests[{i}]: needs a string `prompt`")
            m = int(req.get("num_outputs_per_prompt", 1))
            if m < 1:
                raise RequestError(f"requests[{i}]: num_outputs_per_prompt must be >= 1")
            parsed.append((req["prompt"], m, int(req.get("seed", 0)), self._params(req)))
        out: list[dict[str, Any] | None] = [None] * len(parsed)
        with self._lock:
            v0 = self.weight_version
            groups: dict[tuple, list[int]] = {}
            for i, (_, _, _, p) in enumerate(parsed):
                groups.setdefault(tuple(sorted(p.items())), []).append(i)
            for idx in groups.values():
                tensors = self._denoise([parsed[i] for i in idx])
                for i, t in zip(idx, tensors):
                    out[i] = {"tensors": t}
            for i, (_, m, seed, _) in enumerate(parsed):
                out[i]["meta_info"] = {"weight_version_start": v0, "weight_version_end": self.weight_version,
                                       "weight_version": self.weight_version, "finish_reason": "stop",
                                       "seeds": [seed + j for j in range(m)]}  # fmt: skip
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def _denoise(self, items: list[tuple[str, int, int, dict]]) -> list[dict[str, torch.Tensor]]:
        from miles_platform.diffusion.model import sigma_schedule
        from miles_platform.diffusion.sde import backend_for

        p = items[0][3]
        backend = backend_for(p["sde_type"])
        prompts = [prompt for prompt, m, _, _ in items for _ in range(m)]
        gens = [torch.Generator().manual_seed(seed + j) for _, m, seed, _ in items for j in range(m)]
        shape = (self.channels, self.size, self.size)
        x = torch.stack([torch.randn(shape, generator=g) for g in gens])
        cond, pooled = self.pipe.text_encoder(prompts)
        grid = sigma_schedule(p["steps"], p["shift"])
        n = x.shape[0]
        sigma_max = torch.full((n,), float(grid[1]) if len(grid) > 1 else 1.0)
        rec: dict[str, list[torch.Tensor]] = {k: [] for k in ("latents", "next_latents", "log_probs", "sigmas",
                                                               "next_sigmas", "model_output")}  # fmt: skip
        for i in range(p["steps"]):
            s, s_next = torch.full((n,), float(grid[i])), torch.full((n,), float(grid[i + 1]))
            v = dit_forward(self.pipe.transformer, x, s, cond, pooled, self.dit_precision, TINY_DIT)
            noise = torch.stack([torch.randn(shape, generator=g) for g in gens])
            if i in p["sde_steps"] and p["sde_type"] != "ode":
                st = backend.step(x, v, s, s_next, sigma_max, p["noise_level"], noise=noise,
                                  log_prob_no_const=p["no_const"])  # fmt: skip
                nxt, lp = st.prev_sample, st.log_prob
            else:  # a deterministic (ODE) step: log-prob 0 by convention, never trained by Flow-GRPO
                nxt, lp = x + (s_next - s).view(-1, 1, 1, 1) * v, torch.zeros(n)
            if i in p["return_steps"]:
                for k, t in (("latents", x), ("next_latents", nxt), ("log_probs", lp), ("sigmas", s),
                             ("next_sigmas", s_next), ("model_output", v)):  # fmt: skip
                    rec[k].append(t)
            x = nxt
        images = x.clamp(-1, 1)
        per: list[dict[str, torch.Tensor]] = []
        start = 0
        steps_t = torch.tensor(p["return_steps"], dtype=torch.int64)
        for _, m, _, _ in items:
            sl = slice(start, start + m)
            t = {"images": images[sl].contiguous(), "sigma_max": sigma_max[sl].contiguous(), "steps": steps_t,
                 "sigma_grid": grid.float().contiguous()}  # fmt: skip
            for k, vals in rec.items():
                if k == "model_output" and not p["debug"]:
                    continue
                if vals:
                    t[k] = torch.stack(vals, dim=1)[sl].contiguous()
            per.append(t)
            start += m
        return per

    # ------------------------------------------------------------------ weights
    def update_weights_from_disk(self, path: str, weight_version: int | None) -> int:
        import os

        f = os.path.join(path, "transformer", "diffusion_pytorch_model.safetensors")
        if not os.path.exists(f):
            raise FileNotFoundError(f"{f}: not a DiT pipeline export (no transformer weights)")
        state = load_file(f)
        with self._lock:
            own = self.pipe.transformer.state_dict()
            missing = sorted(set(own) - set(state))
            if missing:
                raise ValueError(f"{f}: missing tensors {missing[:5]}")
            for name, t in own.items():
                t.copy_(state[name].to(t.dtype))
            self.weight_version = int(
                weight_version if weight_version is not None else self.weight_version + 1
            )
            return self.weight_version

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.hf_checkpoint, "family": TINY_DIT.name, "task": "t2i",
                "dit_precision": self.dit_precision, "sample_size": self.size, "weight_version": self.weight_version,
                "is_generation": True}  # fmt: skip


def create_app(core: DiffusionEngineCore, api_key: str | None, weight_roots: list[str] | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:  # fmt: skip
    app = FastAPI(title="miles-platform diffusion engine")
    add_guards(app, api_key, max_request_bytes)
    roots = WeightRoots(weight_roots)

    @app.post("/rollout/generate")
    async def generate(request: Request):
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        reqs = body.get("requests", [body]) if "requests" in body else [body]
        if not isinstance(reqs, list) or not reqs:
            return error(400, "`requests` must be a non-empty list")
        try:
            outs = await asyncio.to_thread(core.generate, reqs)
        except (RequestError, ValueError, TypeError) as e:
            return error(400, str(e))
        packed = [{"meta_info": o["meta_info"], "tensors": save(o["tensors"])} for o in outs]
        return Response(
            msgpack.packb({"outputs": packed}, use_bin_type=True), media_type="application/msgpack"
        )

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body, err = await json_body(request, max_request_bytes)
        if err:
            return err
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            return JSONResponse({"success": False, "message": "model_path is required"}, status_code=400)
        if not roots.allows(path):
            return JSONResponse(
                {"success": False, "message": roots.refusal("model_path", path)}, status_code=403
            )
        try:
            version = await asyncio.to_thread(core.update_weights_from_disk, path, body.get("weight_version"))
        except (OSError, ValueError) as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=400)
        return {"success": True, "message": "ok", "weight_version": version}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info():
        return core.model_info()

    @app.get("/get_server_info")
    async def server_info():
        return {**core.model_info(), "weight_roots": roots}

    return app


class DiffusionEngineServer(ServerHandle):
    def __init__(self, core: DiffusionEngineCore, server):
        super().__init__(server)
        self.core = core


def start_diffusion_engine(hf_checkpoint: str, *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                           dit_precision: str = "fp32", weight_roots: list[str] | None = None,
                           num_threads: int | None = None) -> DiffusionEngineServer:  # fmt: skip
    core = DiffusionEngineCore(hf_checkpoint, dit_precision, num_threads=num_threads)
    return DiffusionEngineServer(core, serve_in_thread(create_app(core, api_key, weight_roots), host, port,
                                                       "diffusion-engine-http"))  # fmt: skip


class DiffusionEngineActor:
    """Ray actor body: serves the engine over loopback HTTP; the loop talks to it with the run's secret."""

    def __init__(self, hf_checkpoint: str, **kwargs):
        self._server = start_diffusion_engine(hf_checkpoint, **kwargs)

    def url(self) -> str:
        return self._server.url

    def shutdown(self) -> None:
        self._server.stop()


def decode_outputs(raw: bytes) -> list[dict[str, Any]]:
    """The client side of /rollout/generate: msgpack -> [{"meta_info", **tensors}] (no base64)."""
    from safetensors.torch import load

    body = msgpack.unpackb(raw, raw=False)
    return [{"meta_info": o["meta_info"], **load(o["tensors"])} for o in body["outputs"]]
