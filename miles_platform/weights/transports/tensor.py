"""`tensor`: the CPU default. Weights go through the Ray object store to Ray-hosted engines."""

from __future__ import annotations

import ray

from miles_platform.cluster.ray_cluster import fits_in_call
from miles_platform.weights.transports import TransferStats, Transport, encode_state, full_bytes


class TensorTransport(Transport):
    name = "tensor"

    def prepare(self, state, version, hf_dir):
        missing = [e.url for e in self.engines if e.actor is None]
        if missing:
            raise RuntimeError(
                f"tensor transport needs Ray-hosted engines; {missing} are external (use disk-delta)"
            )
        # raw bytes with a JSON header, as through Mooncake (a quantized rollout's fp8 update too,
        # whose storages torch cannot unpickle); the engine decodes them. Weights the cluster passes
        # inside a call (ray_cluster.fits_in_call) go in each engine's update call, never through
        # the raylet's shared-memory store; larger ones are put there once for every engine.
        n = full_bytes(state)
        encoded = encode_state(state)
        self._ref = encoded if fits_in_call(n) else ray.put(encoded)
        return TransferStats(wire_bytes=n * len(self.engines), full_bytes=n * len(self.engines))

    def activate(self, version):
        ray.get([e.actor.update_weights_from_tensors.remote(self._ref, version) for e in self.engines])
        self._ref = None
