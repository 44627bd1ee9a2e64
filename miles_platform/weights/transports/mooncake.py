"""`mooncake`: weights travel through a Mooncake store (TCP on CPU, RDMA on GPU clusters).

The trainer side puts one object holding every tensor's raw bytes (dtype and shape in a JSON
header, no pickle); each Ray-hosted engine fetches it as a reader client and loads it in
place. Same master / protocol settings as `--object-store-backend mooncake`
(`--mooncake-store-init-kwargs`, MOONCAKE_* environment fallbacks).
"""

from __future__ import annotations

import ray

from miles_platform.cluster.object_store import MooncakeRolloutStore, get_store, resolve_mooncake_kwargs
from miles_platform.weights.transports import TransferStats, Transport, encode_state, full_bytes


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
