"""Weight transports behind one interface, chosen by `--update-weight-transfer-mode`.

A transport moves the trainer's HF-named weights to every engine in two phases:
`prepare` (outside the pause: serialize, publish, let engines pull) and `activate` (inside
the pause: engines swap to the new weights and advance their version). Adding a transport
is one file plus one line in TRANSPORTS.
"""

from __future__ import annotations

import importlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_platform.config import ConfigError, RunConfig
from miles_platform.store.paths import StoragePaths

TRANSPORTS = {
    "tensor": "miles_platform.weights.transports.tensor:TensorTransport",
    "disk": "miles_platform.weights.transports.disk:DiskTransport",
    "disk-delta": "miles_platform.weights.transports.disk_delta:DiskDeltaTransport",
    "mooncake": "miles_platform.weights.transports.mooncake:MooncakeTransport",
    "broadcast": "miles_platform.weights.transports.broadcast:BroadcastTransport",
}

# accepted by the flag parser, not built yet: say so before anything starts
NOT_BUILT: dict[str, str] = {}

# hand tensors to the embedded engine's Ray actor; SGLang and external engines take weights over HTTP only
NEEDS_EMBEDDED_ACTOR = ("tensor", "mooncake")


def encode_state(state: dict[str, torch.Tensor]) -> dict:
    """A state dict as each tensor's raw bytes (numpy uint8) + {name: [dtype, shape]}: what Ray and
    Mooncake move without pickling a tensor (torch cannot unpickle float8 storages, and Ray pickles
    a torch tensor at ~3x the CPU of the same bytes as an array: 8 ms against 2.8 for the quickstart
    model's 24 tensors, and 2.7 ms against 0.1 to read them back)."""
    meta = {n: [str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in state.items()}
    # on the host (a device tensor is copied there), a 0-dim tensor as one element
    arrays = {
        n: t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy() for n, t in state.items()
    }
    return {"__tensors__": meta, **arrays}


def decode_state(data: dict) -> dict[str, torch.Tensor]:
    """`encode_state`'s tensors; bytes Ray handed over read-only (its object store) are copied once,
    so no tensor aliases memory a write would fault on."""
    import numpy as np

    out = {}
    for name, (dtype, shape) in data["__tensors__"].items():
        arr = data[name]
        arr = np.ascontiguousarray(arr) if arr.flags.writeable else np.array(arr)
        out[name] = torch.from_numpy(arr).view(getattr(torch, dtype)).reshape(shape)
    return out


@dataclass(frozen=True)
class EngineProcess:
    """An embedded engine actor's process: its pid on Ray node `node_id`, started `started` seconds
    after the node booted (a pid the OS gave to another process since does not match)."""

    pid: int
    node_id: str
    started: float


def process_started(pid: int) -> float:
    """When process `pid` started: on Linux, clock ticks since boot (/proc/<pid>/stat's starttime).
    Not psutil's create_time there: it adds /proc/stat's btime, which a clock adjustment moves by a
    second, and then the same process reads as another one (a hung engine was spared its SIGKILL
    that way). Raises psutil.NoSuchProcess when there is no such process."""
    import psutil

    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            raise psutil.NoSuchProcess(pid) from None
        return psutil.Process(pid).create_time()  # no procfs: macOS, where the driver may run
    return float(stat.rsplit(b")", 1)[1].split()[19])  # field 22; comm may hold spaces and ')'


@dataclass
class EngineHandle:
    """What a transport may use of an engine: its URL and, for Ray-hosted engines, the actor (and,
    for embedded ones, its process: rollout/engine_fleet.py kills a hung one without Ray's grace)."""

    url: str
    actor: Any = None
    local_checkpoint_dir: str | None = None
    process: EngineProcess | None = None


@dataclass
class TransferStats:
    wire_bytes: int = 0
    full_bytes: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def density(self) -> float:
        return self.wire_bytes / self.full_bytes if self.full_bytes else 0.0


class Transport(ABC):
    name = ""
    needs_trainers = False  # True: __init__ also takes `trainers=` (the TrainerActor handles)
    pauses = True  # False: activate never disturbs generation (LoRA: a new adapter name per version)

    def __init__(self, cfg: RunConfig, paths: StoragePaths, engines: list[EngineHandle]):
        self.cfg, self.paths, self.engines = cfg, paths, engines

    @abstractmethod
    def prepare(self, state: dict[str, torch.Tensor], version: int, hf_dir: str | None) -> TransferStats:
        """Outside the pause: move the bytes as close to the engines as possible."""

    @abstractmethod
    def activate(self, version: int) -> None:
        """Inside the pause: every engine loads the prepared weights and reports `version`."""

    def engine_replaced(self, i: int) -> None:
        """--use-fault-tolerance replaced engine i (`self.engines[i]` is the new one, serving the
        run's version): drop what the transport held for the old one. Stateless by default."""
        return None


def full_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def check_engine_kind(cfg: RunConfig) -> None:
    """Refuse a transport the run's engines cannot take, before anything starts (not at the first update)."""
    mode = cfg.update_weight_transfer_mode
    if mode not in NEEDS_EMBEDDED_ACTOR or cfg.debug_train_only or cfg.debug_rollout_only:
        return
    if cfg.rollout_external_engine_addrs:
        engines = "--rollout-external-engine-addrs (engines started elsewhere)"
    elif cfg.rollout_engine != "embedded":
        engines = f"--rollout-engine {cfg.rollout_engine}"
    else:
        return
    http = sorted(set(TRANSPORTS) - set(NEEDS_EMBEDDED_ACTOR))
    raise ConfigError(
        f"--update-weight-transfer-mode {mode} loads weights through the embedded engine's Ray actor, "
        f"which {engines} does not have; use --update-weight-transfer-mode one of {http} (HTTP), "
        "or --rollout-engine embedded"
    )


def get_transport(
    cfg: RunConfig,
    paths: StoragePaths,
    engines: list[EngineHandle],
    trainers: list | None = None,
    adapter=None,
) -> Transport:
    """`trainers`: the TrainerActor handles, for transports the trainer drives (broadcast);
    `adapter`: a LoRA run's AdapterName (the name its requests carry, switched by each update)."""
    check_engine_kind(cfg)
    if cfg.update_weight_transfer_mode in NOT_BUILT:
        raise ConfigError(
            f"--update-weight-transfer-mode {cfg.update_weight_transfer_mode}: "
            + NOT_BUILT[cfg.update_weight_transfer_mode]
        )
    spec = TRANSPORTS.get(cfg.update_weight_transfer_mode)
    if (
        cfg.update_weight_transfer_mode == "tensor" and cfg.colocate and trainers
    ):  # same device: shared memory
        spec = "miles_platform.weights.transports.colocated:ColocatedTensorTransport"
    if cfg.uses_lora:  # adapters only, over SGLang's LoRA API (config/lora.py refused the other modes)
        from miles_platform.weights.transports.lora import LoraTransport

        return LoraTransport(cfg, paths, engines, adapter=adapter)
    if spec is None:
        raise ConfigError(
            f"--update-weight-transfer-mode {cfg.update_weight_transfer_mode!r}: allowed {sorted(TRANSPORTS)}"
        )
    mod, cls = spec.split(":")
    kind = getattr(importlib.import_module(mod), cls)
    return kind(cfg, paths, engines, trainers=trainers) if kind.needs_trainers else kind(cfg, paths, engines)
