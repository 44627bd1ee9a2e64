"""`tensor`: the CPU default. Weights go through the Ray object store to Ray-hosted engines."""

from __future__ import annotations

import ray
import torch

from miles_platform.weights.transports import TransferStats, Transport, full_bytes
from miles_platform.weights.transports.mooncake import encode_state


class TensorTransport(Transport):
    name = "tensor"

    def prepare(self, state, version, hf_dir):
        missing = [e.url for e in self.engines if e.actor is None]
        if missing:
            raise RuntimeError(
                f"tensor transport needs Ray-hosted engines; {missing} are external (use disk-delta)"
            )
        # torch cannot unpickle float8 storages (a quantized rollout's fp8 update): those travel as
        # raw bytes with a JSON header, as through Mooncake, and the engine decodes them
        raw = any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in state.values())
        self._ref = ray.put(encode_state(state) if raw else state)
        n = full_bytes(state)
        return TransferStats(wire_bytes=n * len(self.engines), full_bytes=n * len(self.engines))

    def activate(self, version):
        ray.get([e.actor.update_weights_from_tensors.remote(self._ref, version) for e in self.engines])
        self._ref = None
