"""`mooncake`: weights travel through a Mooncake store (TCP on CPU, RDMA on GPU clusters).

The trainer side puts one object holding every tensor's raw bytes (dtype and shape in a JSON
header, no pickle); each Ray-hosted engine fetches it as a reader client and loads it in
place. Same master / protocol settings as `--object-store-backend mooncake`
(`--mooncake-store-init-kwargs`, MOONCAKE_* environment fallbacks).
"""

from __future__ import annotations

import numpy as np
import ray
import torch

from miles_platform.cluster.object_store import MooncakeRolloutStore, get_store, resolve_mooncake_kwargs
from miles_platform.weights.transports import TransferStats, Transport, full_bytes


def encode_state(state: dict[str, torch.Tensor]) -> dict:
    meta = {n: [str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in state.items()}
    arrays = {n: t.detach().contiguous().view(torch.uint8).reshape(-1).numpy() for n, t in state.items()}
    return {"__tensors__": meta, **arrays}


def decode_state(data: dict) -> dict[str, torch.Tensor]:
    out = {}
    for name, (dtype, shape) in data["__tensors__"].items():
        raw = torch.from_numpy(np.ascontiguousarray(data[name]))
        out[name] = raw.view(getattr(torch, dtype)).reshape(shape)
    return out


class MooncakeTransport(Transport):
    name = "mooncake"

    def __init__(self, cfg, paths, engines):
        super().__init__(cfg, paths, engines)
        missing = [e.url for e in engines if e.actor is None]
        if missing:
            raise RuntimeError(
                f"mooncake transport needs Ray-hosted engines; {missing} are external (use disk-delta)"
            )
        store = get_store("mooncake", resolve_mooncake_kwargs(cfg.mooncake_store_init_kwargs))
        assert isinstance(store, MooncakeRolloutStore)
        self.store = store

    def prepare(self, state, version, hf_dir):
        self._handle = self.store.put(encode_state(state))
        n = full_bytes(state)
        return TransferStats(wire_bytes=n * len(self.engines), full_bytes=n * len(self.engines))

    def activate(self, version):
        try:
            ray.get([e.actor.update_weights_from_store.remote(self._handle, version) for e in self.engines])
        finally:
            self.store.remove(self._handle)
