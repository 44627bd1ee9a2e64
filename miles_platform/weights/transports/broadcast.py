"""`broadcast`: the trainer broadcasts every tensor to the engines over a collective group.

Miles / SGLang style. The trainer (rank 0) and engine i (rank 1+i) join a standalone process
group through SGLang's `POST /init_weights_update_group`; each update is one
`POST /update_weights_from_distributed` per engine (names, dtypes, shapes, in order) while the
trainer broadcasts the tensors in that order. The engines receive into fresh tensors and load
them atomically, so a failed transfer keeps their old weights and version. No bytes pass through
the driver, and external SGLang engines work too: only HTTP and the trainer are used.

Backend by device: `gloo` on CPU (127.0.0.1), `nccl` when the trainer has CUDA (its node IP).
The group never touches the default group the trainer may hold for FSDP.

The helpers below are both sides of the protocol: the trainer actor and the embedded engine
import them.
"""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor

import ray
import torch
import torch.distributed as dist

from miles_platform.cluster.ports import free_port, gloo_on_loopback, tcp_store
from miles_platform.rollout.client import post
from miles_platform.weights.transports import TransferStats, Transport, full_bytes

GROUP_NAME = "miles_weights"
TIMEOUT_S = 120.0


def weights_update_endpoint() -> dict:
    """Where the trainer hosts the group: address, a free port, backend by device."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    address = ray.util.get_node_ip_address() if backend == "nccl" else "127.0.0.1"
    return {"master_address": address, "master_port": free_port(address), "backend": backend}


def new_weights_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = TIMEOUT_S,
    join_timeout_s: float | None = None,
):
    """A standalone process group (own TCPStore, rank 0 hosts it); blocks until all ranks join
    (at most `join_timeout_s`, default `timeout_s`, the bound of each collective)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        gloo_on_loopback(master_address)
    store = tcp_store(master_address, int(master_port), world_size, rank == 0,
                      timeout_s=join_timeout_s or timeout_s, wait_for_workers=False)  # fmt: skip
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"weights update group backend {backend!r}: must be gloo or nccl")


def broadcast(group, tensor: torch.Tensor, root: int = 0) -> None:
    """In place on every rank; fp8 (a quantized rollout's update) as its bytes: gloo has no float8."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        tensor = tensor.view(torch.uint8)  # the same storage: received bytes land in the fp8 tensor
    group.broadcast([tensor], opts).wait()


def broadcast_buckets(group, device: str, buckets, names: list[str] | None, before_first_send) -> dict:
    """The trainer's side of an update: broadcast each tensor of an iterator of HF-named buckets in
    `names` order (default: the buckets' order), each as soon as its bucket is in (a tensor due later
    waits, the rest of its bucket goes on). Returns the metadata the engines were sent."""
    pending, meta, sent, started = {}, {"names": [], "dtypes": [], "shapes": []}, 0, False
    for bucket in buckets:
        if not started:
            before_first_send()
            started = True
        pending.update(bucket)
        queue = list(bucket) if names is None else names
        while sent < len(queue) and queue[sent] in pending:
            t = pending.pop(queue[sent])
            broadcast(group, t.detach().to(device).contiguous())
            meta["names"].append(queue[sent])
            meta["dtypes"].append(dtype_name(t.dtype))
            meta["shapes"].append(list(t.shape))
            sent += 1
        if names is None:
            sent = 0
    if names is not None and sent < len(names):
        raise KeyError(f"broadcast_weights: trainer has no tensors {names[sent:][:5]}")
    return meta


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (e.g. float32, bfloat16)")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class BroadcastTransport(Transport):
    name = "broadcast"
    needs_trainers = True

    def __init__(self, cfg, paths, engines, trainers=None):
        super().__init__(cfg, paths, engines)
        if not trainers:
            raise RuntimeError(
                "broadcast transport needs the trainer actors (rank 0 broadcasts); "
                "pass trainers= to UpdateSession, or use --update-weight-transfer-mode tensor"
            )
        self.trainers, self.group_ready, self.meta = trainers, False, None

    def _post_all(self, path: str, bodies: list[dict], trainer_calls) -> None:
        """The engines' HTTP calls run in threads while the trainer's Ray call is in flight: the
        collective needs every rank at once. Errors name the engine URL."""
        timeout = TIMEOUT_S + 30
        with ThreadPoolExecutor(len(self.engines)) as pool:
            futs = {
                e.url: pool.submit(post, e.url, path, b, api_key=self.cfg.api_key, timeout=timeout)
                for e, b in zip(self.engines, bodies, strict=True)
            }
            errors, trainer_error = [], None
            try:
                ray.get(trainer_calls, timeout=timeout)
            except Exception as e:  # reported once the engines answered (or timed out)
                trainer_error = e
                errors.append(f"trainer: {e}")
            for url, f in futs.items():
                try:
                    f.result()
                except Exception as e:
                    errors.append(f"{url}{path}: {e}")
        if errors:
            self.group_ready = False  # a half-done collective leaves the group unusable: rejoin next time
            if isinstance(trainer_error, ray.exceptions.RayActorError):
                # a dead trainer rank: the engines' failures (peer reset) follow from it; the run
                # stops with the message that names the actor (run_services.actor_died)
                raise trainer_error
            raise RuntimeError(f"broadcast weight update {path} failed: " + "; ".join(errors))

    def _init_group(self) -> None:
        ep = ray.get(self.trainers[0].weights_update_endpoint.remote())
        world = 1 + len(self.engines)
        bodies = [
            {**ep, "rank_offset": 1 + i, "world_size": world, "group_name": GROUP_NAME}
            for i in range(len(self.engines))
        ]
        call = self.trainers[0].init_weights_update_group.remote(
            ep["master_address"], ep["master_port"], world, GROUP_NAME, ep["backend"]
        )
        self._post_all("/init_weights_update_group", bodies, call)
        self.group_ready = True

    def engine_replaced(self, i: int) -> None:
        """The group has a dead rank and the new engine is in none: the next activate has every
        rank join a fresh group (a second init under the same name replaces it, on both sides)."""
        self.group_ready = False

    def prepare(self, state, version, hf_dir):
        self.meta = {
            "names": list(state),
            "dtypes": [dtype_name(t.dtype) for t in state.values()],
            "shapes": [list(t.shape) for t in state.values()],
        }
        n = full_bytes(state)
        return TransferStats(wire_bytes=n * len(self.engines), full_bytes=n * len(self.engines))

    def activate(self, version):
        if not self.group_ready:
            self._init_group()
        calls = [t.broadcast_weights.remote(GROUP_NAME, self.meta["names"]) for t in self.trainers]
        body = {**self.meta, "group_name": GROUP_NAME, "weight_version": version, "flush_cache": True}
        self._post_all("/update_weights_from_distributed", [body] * len(self.engines), calls)
