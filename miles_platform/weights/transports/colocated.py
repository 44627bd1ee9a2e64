"""`tensor` under `--colocate`: each engine takes the weights from the trainer rank on its device
through host shared memory (SGLang's `/update_weights_from_tensor`; weights/shared_tensors.py),
not through the driver or the disk. Engine i shares its bundle with trainer rank
i x --rollout-num-gpus-per-engine (cluster/ray_cluster.py), so that rank stages for it."""

from __future__ import annotations

import ray

from miles_platform.rollout.client import post
from miles_platform.weights.transports import TransferStats, Transport


class ColocatedTensorTransport(Transport):
    name = "tensor"
    needs_trainers = True

    def __init__(self, cfg, paths, engines, trainers=None):
        super().__init__(cfg, paths, engines)
        if not trainers:
            raise RuntimeError("--colocate tensor transport: the run has no trainer ranks to stage weights")
        self.trainers, self._staged = trainers, None

    def prepare(self, state, version, hf_dir):
        # every rank exports (a collective under FSDP); each keeps its segment until activate
        self._staged = ray.get([t.stage_weights.remote() for t in self.trainers])
        tp = max(self.cfg.rollout_num_gpus_per_engine, 1)
        n = sum(d["nbytes"] for d in self._staged[::tp][: len(self.engines)])
        return TransferStats(
            wire_bytes=n, full_bytes=n, extra={"perf/update_weights_shared_memory_bytes": float(n)}
        )

    def activate(self, version):
        tp = max(self.cfg.rollout_num_gpus_per_engine, 1)
        try:
            for i, e in enumerate(self.engines):
                body = {"named_tensors": self._staged[i * tp], "load_format": "shared_memory",
                        "weight_version": version}  # fmt: skip
                post(e.url, "/update_weights_from_tensor", body, api_key=self.cfg.api_key, timeout=600)
        finally:
            ray.get([t.unstage_weights.remote() for t in self.trainers])
            self._staged = None
