"""The embedded engine's weights: loading a checkpoint at start, updating it in place (tensors, disk,
broadcast; LoRA adapters) and reading back what is served (values, checksums).

Weight updates take the step lock, so a forward pass never sees half-old, half-new weights; they are
validated (names, shapes) before any tensor is copied, so a failed update keeps old weights and version.
Requests already running whose exact / min weight_version the new version violates fail with 409.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from miles_platform.errors import CheckpointError, MilesError
from miles_platform.rollout.engine_batch import keep_rows
from miles_platform.rollout.engine_requests import AdapterOwned, RequestError, version_violation
from miles_platform.rollout.lora_serving import parse_adapter

GROUP_JOIN_TIMEOUT_S = 30.0  # an engine joining a trainer's weight-broadcast group
MAX_WEIGHT_VERSION = 2**53 - 1  # exact as a JSON number and a float64 wherever a version travels


def parse_weight_version(value, default: int, floor: int) -> int:
    """A request's `weight_version`: a whole number (SGLang sends it as a string of digits) in
    [floor, 2^53 - 1]; None -> `default`. Anything else is a 400, before any weight changes (a
    version of 2^70 or 1e308 used to be accepted and break every later /generate)."""
    if value is None:
        return default
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 16:
        value = int(value)
    if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_WEIGHT_VERSION:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_WEIGHT_VERSION:
        raise RequestError(f"weight_version {value!r}: must be a whole number in [0, 2^53 - 1]")
    if value < floor:
        raise RequestError(
            f"weight_version {value}: versions only move forward (this engine serves v{floor})"
        )
    return value


class EngineWeightsMixin:
    """EngineCore's weight API (SGLang's update / get-weights / LoRA endpoints). It uses the core's
    `model`, `dtype`, `model_path`, `_params` (name -> served Parameter, tied names alias one),
    `_lora`, `_weight_version`, `_weight_groups`, `_group_init`, `_step_lock`, `_batch`, `stats`,
    `_in_scheduler` (all torch work runs on the scheduler thread) and `_fail_version`."""

    # ---- base weights ------------------------------------------------------------------------------

    def update_weights_from_tensors(
        self, named_tensors: dict[str, torch.Tensor], weight_version: int
    ) -> None:
        """Copy (a subset of) parameters in, atomically between forward passes; set the version.
        `named_tensors` may be raw bytes + a JSON header (weights/transports/__init__.py encode_state)."""
        from miles_platform.weights.rollout_quant import dense_from_update, quantized_names

        if "__tensors__" in named_tensors:  # the tensor and mooncake transports' form
            from miles_platform.weights.transports import decode_state

            named_tensors = decode_state(named_tensors)
        version = parse_weight_version(weight_version, self._weight_version + 1, self._weight_version)
        sums = _checksums({n: named_tensors[n] for n in quantized_names(named_tensors)})
        dense, fmt = dense_from_update(named_tensors)  # fp8 / int4 updates: what this engine serves
        self._in_scheduler(lambda: self._swap(self._prepare_tensors(dense, require_all=False), version))
        self._served_quant = (version, fmt, sums)

    def update_weights_from_tensor(self, named_tensors: dict, weight_version: int | None = None) -> int:
        """SGLang's /update_weights_from_tensor for a colocated trainer: `named_tensors` is the
        descriptor of a shared-memory segment the trainer staged (weights/shared_tensors.py); the
        tensors are copied out and loaded as one update. Returns the new version."""
        from miles_platform.weights.shared_tensors import open_staged

        version = parse_weight_version(weight_version, self._weight_version + 1, self._weight_version)
        with open_staged(named_tensors) as named:
            self.update_weights_from_tensors(named, version)
        return version

    def update_weights_from_disk(self, path: str | os.PathLike, weight_version: int | None = None) -> int:
        """Load a full HF checkpoint dir (quantized ones via the dequantizing loader); returns the new version."""
        version = parse_weight_version(weight_version, self._weight_version + 1, self._weight_version)
        from miles_platform.store.remote import local_dir
        from miles_platform.weights.rollout_quant import read_served_state

        with local_dir(str(path)) as local:  # an object-store export: downloaded, read, removed
            state, fmt, quantized = read_served_state(local)
        self._in_scheduler(
            lambda: self._swap(self._prepare_tensors(state, require_all=True, source=str(path)), version)
        )
        self.model_path, self._served_quant = str(path), (version, fmt, _checksums(quantized))
        return version

    def served_quantization(self) -> dict:
        """What the base weights are served as (SGLang's `quantization` server arg, here per version):
        {"weight_version", "format": "fp8" / "int4" / None, "xxh3_128": {name: checksum} of the
        quantized tensors as loaded}. Version 0 reads them from the checkpoint it started from."""
        served = getattr(self, "_served_quant", None)
        if served is None:  # version 0: --hf-checkpoint, as loaded at start
            from miles_platform.weights.rollout_quant import read_served_state

            _, fmt, quantized = read_served_state(self.model_path)
            served = self._served_quant = (self._weight_version, fmt, _checksums(quantized))
        version, fmt, sums = served
        return {"weight_version": version, "format": fmt, "xxh3_128": dict(sums)}

    def served_quant_format(self) -> str | None:
        """The served format without reading a checkpoint (version 0: its config says it)."""
        served = getattr(self, "_served_quant", None)
        if served is not None:
            return served[1]
        from miles_platform.models.checkpoint import quantization

        return {"fp8": "fp8", "compressed-tensors": "int4"}.get(quantization(self.model_path) or "")

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
    ) -> None:
        """Join the trainer's weight-broadcast group as rank `rank_offset` (SGLang's API). Blocks
        until every rank joined; a second init under the same name replaces the group."""
        from miles_platform.weights.transports.broadcast import new_weights_group

        if backend not in ("gloo", "nccl"):
            raise RequestError(f"init_weights_update_group backend={backend!r}: must be gloo or nccl")
        # one join at a time, each bounded: calls to a dead port cannot pile up and block updates
        if not self._group_init.acquire(blocking=False):
            raise RequestError("init_weights_update_group: another join is in progress on this engine")
        try:
            group = new_weights_group(
                master_address, master_port, rank_offset, world_size, group_name, backend,
                join_timeout_s=GROUP_JOIN_TIMEOUT_S,
            )  # fmt: skip
        finally:
            self._group_init.release()
        self._weight_groups[group_name] = (group, backend)

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: int | None = None,
    ) -> int:
        """Receive each tensor by broadcast from rank 0 in the order given, then load them atomically
        (names and shapes are checked after receiving, so the group stays in step on a bad update).
        Returns the new version. The receive runs on the caller's thread; the swap on the scheduler."""
        from miles_platform.weights.transports.broadcast import broadcast, parse_dtype

        if group_name not in self._weight_groups:
            raise RequestError(
                f"no weights update group {group_name!r}: call /init_weights_update_group first"
            )
        if not (len(names) == len(dtypes) == len(shapes)):
            raise RequestError(
                f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}"
            )
        try:
            kinds = [parse_dtype(d) for d in dtypes]
        except ValueError as e:
            raise RequestError(f"update_weights_from_distributed: {e}") from e
        group, backend = self._weight_groups[group_name]
        device = self.device if backend == "nccl" else "cpu"  # NCCL receives on this engine's GPU
        named = {}
        for name, dtype, shape in zip(names, kinds, shapes, strict=True):
            t = torch.empty([int(x) for x in shape], dtype=dtype, device=device)
            broadcast(group, t)
            named[name] = t
        version = parse_weight_version(weight_version, self._weight_version + 1, self._weight_version)
        self.update_weights_from_tensors(named, version)
        return version

    def get_weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of every parameter (tied ones once), for --check-weight-update-equal."""

        def read():
            self._check_not_released("get_weights")
            return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}

        return self._in_scheduler(read)

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        """SGLang's `/get_weights_by_name`: the first `truncate_size` rows (elements of a 1-D tensor)
        of one parameter, by HF name (tied names too), as a float64 numpy array (every served value
        exactly; the HTTP layer writes it as nested JSON lists, as SGLang does)."""
        if name not in self._params:
            raise RequestError(
                f"unknown parameter {name!r} (this model has e.g. {next(iter(self._params))!r})"
            )
        n = int(truncate_size)

        def read():
            self._check_not_released("get_weights_by_name")
            return self._params[name].detach()[:n].to("cpu", torch.float64).numpy().copy()

        return self._in_scheduler(read)

    def weights_checksums(self, names: list[str] | None = None) -> dict[str, dict]:
        """Our extension to SGLang's API (`POST /weights_checksum`): {name: {"dtype", "shape",
        "xxh3_128"}} of each parameter's bytes as served, every one (`names=None`) or those named.
        One request answers what `/get_weights_by_name` needs one request per tensor for."""
        from miles_platform.weights.checksum import checksum

        names = list(self._params) if names is None else list(names)
        unknown = [n for n in names if n not in self._params]
        if unknown:
            raise RequestError(
                f"unknown parameter {unknown[0]!r} (this model has e.g. {next(iter(self._params))!r})"
            )

        def digest():
            self._check_not_released("weights_checksum")
            out = {}
            for n in names:
                t = self._params[n].detach()
                out[n] = {
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                    "xxh3_128": checksum(t),
                }
            return out

        return self._in_scheduler(digest)

    def _prepare_tensors(self, named: dict, require_all: bool, source: str = "tensors") -> dict:
        unknown = [n for n in named if n not in self._params]
        if unknown:
            raise CheckpointError(
                f"weights from {source}: unknown tensor names {unknown[:5]} (model has e.g. {next(iter(self._params))})"
            )
        if require_all:
            covered = {id(self._params[n]) for n in named}
            missing = [n for n, p in self.model.named_parameters() if id(p) not in covered]
            if missing:
                raise CheckpointError(f"weights from {source}: missing tensors {missing[:5]}")
        out = {}
        for n, t in named.items():
            p = self._params[n]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(p.shape):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise CheckpointError(
                    f"weights from {source}: {n} has shape {shape}, model expects {tuple(p.shape)}"
                )
            out[n] = t.detach().to(device=p.device, dtype=p.dtype)
        return out

    def _swap(self, prepared: dict, version: int) -> None:
        self._check_not_released("a weight update")
        with self._step_lock, torch.no_grad():
            for n, t in prepared.items():
                self._params[n].copy_(t)
            self._weight_version = version
            self.stats["num_weight_updates"] += 1
            self._fail_running_violations(version, lora=None)

    def _fail_running_violations(self, version: int, lora: str | None) -> None:
        """After `version` of the base weights (lora=None) or of adapter `lora` went live: fail the
        running requests it serves whose exact/min constraint is now violated (409)."""
        b, keep = self._batch, []
        for i, r in enumerate(b.reqs):
            why = version_violation(r, version) if r.lora == lora else None
            if why:
                self._fail_version(r, why)
            else:
                keep.append(i)
        if len(keep) != len(b):
            self._batch = keep_rows(b, keep, self.model.config)

    # ---- LoRA adapters (SGLang's /load_lora_adapter, /unload_lora_adapter, `lora_path`) ----------

    def load_lora_adapter(
        self, name: str, tensors: dict, config: dict, weight_version: int | None = None,
        path: str | None = None, replace: bool = False, owner: str | None = None,
    ) -> int:  # fmt: skip
        """Serve a PEFT LoRA adapter as `name` (requests select it with `lora_path`). `replace`: swap
        an adapter of that name in one step (a weight update); else, as SGLang, a loaded name is an
        error. `owner`: the tenant loading it (None: the admin key); a name another owner holds is
        refused (AdapterOwned). Validated before anything changes. Returns the adapter's version."""
        if not isinstance(name, str) or not name:
            raise RequestError("lora_name must be a non-empty string")
        self.check_adapter_owner(name, owner, "replace")
        old = self._lora.adapters.get(name)
        floor = old.version if old is not None else 0
        version = parse_weight_version(
            weight_version, old.version + 1 if old is not None else self._weight_version, floor
        )

        def load():
            adapter = parse_adapter(name, tensors, config, self.model, self.dtype, version, path)
            adapter = dataclasses.replace(adapter, owner=owner)
            self.check_adapter_owner(name, owner, "replace")  # again, on the scheduler thread: atomic
            with self._step_lock:
                self._lora.load(adapter, replace=replace)
                self._fail_running_violations(version, lora=name)
                self.stats["num_lora_loads"] = self.stats.get("num_lora_loads", 0) + 1

        try:
            self._in_scheduler(load)
        except AdapterOwned:
            raise
        except ValueError as e:
            raise RequestError(str(e)) from e
        return version

    def check_adapter_owner(self, name: str, caller: str | None, action: str) -> None:
        """Only the key that loaded an adapter (or the admin key, `caller` None) may change it."""
        a = self._lora.adapters.get(name)
        if caller is None or a is None or a.owner == caller:
            return
        by = f"tenant {a.owner!r}" if a.owner is not None else "the engine's admin key"
        raise AdapterOwned(
            f"LoRA adapter {name!r} belongs to {by}: tenant {caller!r} may not {action} it "
            "(only the key that loaded an adapter, or the engine's admin key, may unload or replace it)"
        )

    def unload_lora_adapter(self, name: str, timeout_s: float = 600.0, owner: str | None = None) -> None:
        """Stop serving `name`, as SGLang's unload: requests naming it are refused from now on,
        requests already holding it finish first (after `timeout_s` they fail, 400). While the engine
        is paused the unload is immediate: an unload + load under one name inside a pause is a
        seamless update. `owner`: the caller's tenant (None: the admin key); another's adapter is
        refused (AdapterOwned)."""
        if name not in self._lora.adapters or name in self._lora_draining:
            raise RequestError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self._lora.adapters)})")
        self.check_adapter_owner(name, owner, "unload")
        self._lora_draining.add(name)
        deadline = time.monotonic() + timeout_s

        def drained() -> bool:
            return self._paused or not self._lora_in_use(name) or time.monotonic() >= deadline

        def unload() -> bool:  # on the scheduler thread: nothing can start holding `name` meanwhile
            if not drained():
                return False
            self.check_adapter_owner(name, owner, "unload")  # the name may have been reloaded meanwhile
            with self._step_lock:
                self._lora.unload(name)
            return True

        try:
            while True:
                while not drained():
                    time.sleep(0.005)
                if self._in_scheduler(unload):
                    return
        except AdapterOwned:
            raise
        except ValueError as e:
            raise RequestError(str(e)) from e
        finally:
            self._lora_draining.discard(name)

    def _lora_in_use(self, name: str) -> bool:
        with self._cv:
            waiting = any(r.lora == name for r in self._waiting)
        return waiting or any(r.lora == name for r in list(self._batch.reqs))

    def lora_adapters(self) -> dict[str, dict]:
        return {n: {"lora_path": a.path, "weight_version": a.version, "rank": a.rank, "owner": a.owner}
                for n, a in sorted(self._lora.adapters.items())}  # fmt: skip

    def get_lora_adapter_checksums(self, name: str) -> dict:
        """SHA-256 of each served lora_A / lora_B tensor (in the serving dtype): --check-lora-weight-equal."""
        a = self._lora.adapters.get(name)
        if a is None:
            raise RequestError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self._lora.adapters)})")
        return {"lora_name": name, "weight_version": a.version, "sha256": a.checksums()}


# ---- loading a checkpoint ------------------------------------------------------------------------------


def parse_engine_dtype(dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """`--dtype` (fp32 / bf16 / auto, or a torch dtype) -> the dtype the engine serves in; "auto" (or
    None): bf16 on CUDA, fp32 elsewhere (cluster/devices.default_dtype)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        from miles_platform.cluster.devices import default_dtype

        dtype = default_dtype(device)
    table = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
    }
    if dtype not in table:
        raise MilesError(f"--dtype {dtype!r}: must be one of fp32, bf16")
    return table[dtype]


def load_model(path: str, dtype: torch.dtype, router_dtype: str | None = None):
    """(model, tokenizer) of an HF checkpoint dir, frozen; a quantized one is dequantized to `dtype`.
    `router_dtype` "fp32" (--moe-router-dtype): an MoE model's routers compute in fp32 from the
    `dtype` hidden states and weights, as the trainer's do (models/moe.py route_in_fp32), so both
    pick the same experts."""
    from miles_platform.models.checkpoint import load_tokenizer, validate_hf_dir
    from miles_platform.models.mla_cache import absorb_mla_decode
    from miles_platform.weights.quantize import load_dense_hf_model

    validate_hf_dir(path)
    model, tok = load_dense_hf_model(path, dtype), load_tokenizer(path)
    for p in model.parameters():
        p.requires_grad_(False)
    check_cache_kwarg(model)
    absorb_mla_decode(model)  # MLA decode against the compressed cache (models/mla_cache.py)
    # Qwen3.5's A_log is already fp32 at any --dtype, as SGLang holds it: load_dense_hf_model loads it so (models/gdn.py)
    if router_dtype == "fp32":
        from miles_platform.models.moe import route_in_fp32

        route_in_fp32(model)
    return model, tok


def check_cache_kwarg(model) -> None:
    """The decode loop hands its KV cache to forward as `cache=` (transformers 5.2x). An older
    transformers names it `past_key_values` and swallows `cache` into **kwargs, so every decode step
    would silently run without context (wrong tokens and log-probs): refuse to start instead."""
    import inspect

    import transformers

    if "cache" not in inspect.signature(type(model).forward).parameters:
        raise MilesError(
            f"transformers {transformers.__version__}: {type(model).__name__}.forward takes no `cache` "
            "argument; the embedded engine needs the pinned transformers (pip install -e .)"
        )


def _checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    from miles_platform.weights.checksum import checksum

    return {n: checksum(t) for n, t in tensors.items()}


def eos_ids(model, tokenizer) -> set[int]:
    """Token ids that end a generation: generation config, model config and tokenizer together."""
    ids = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        e = getattr(src, "eos_token_id", None)
        if e is not None:
            ids.update(e if isinstance(e, list | tuple) else [e])
    return ids
