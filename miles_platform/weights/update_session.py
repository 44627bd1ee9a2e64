"""The update session, one place for every backend and transport (Miles' update_weights()).

    prepare (transport: serialize / publish / engines pull; overlaps generation)
    pause   (router -> every engine: /pause_generation, --pause-generation-mode; not for LoRA,
             whose versions are new adapter names: weights/transports/lora.py)
    activate(engines load the new weights, advance weight_version)
    resume  (/continue_generation)

Timings per phase are reported as `perf/update_weights_*`.
"""

from __future__ import annotations

import threading
import time

import torch

from miles_platform.config import RunConfig
from miles_platform.rollout.client import post
from miles_platform.store.paths import StoragePaths
from miles_platform.weights.transports import EngineHandle, get_transport


class UpdateSession:
    def __init__(
        self,
        cfg: RunConfig,
        paths: StoragePaths,
        engines: list[EngineHandle],
        trainers: list | None = None,
        adapter=None,
        hook=None,
    ):
        """`trainers`: TrainerActor handles, used by transports the trainer drives (broadcast);
        `adapter`: a LoRA run's AdapterName; `hook(name)`: the run's --ci-fault-hooks, fired after
        each phase (weight_update_prepared / _paused / _activated)."""
        self.cfg, self.engines, self.hook = cfg, engines, hook or (lambda name: None)
        self.transport = get_transport(cfg, paths, engines, trainers, adapter=adapter)
        # what every engine serves: v0 is --hf-checkpoint; an engine restarted under
        # --use-fault-tolerance loads this version's export, holding `lock` so no update interleaves
        self.served_version, self.served_hf_dir = 0, None
        self.lock = threading.Lock()

    def served(self) -> tuple[int, str | None]:
        return self.served_version, self.served_hf_dir

    def _broadcast(self, path: str, body: dict | None = None) -> None:
        for e in self.engines:
            post(e.url, path, body or {}, api_key=self.cfg.api_key, timeout=600)

    def update(
        self, state: dict[str, torch.Tensor], version: int, hf_dir: str | None = None
    ) -> dict[str, float]:
        with self.lock:
            out = self._update(state, version, hf_dir)
            self.served_version, self.served_hf_dir = version, hf_dir
            return out

    def _update(self, state: dict[str, torch.Tensor], version: int, hf_dir: str | None) -> dict[str, float]:
        t0 = time.time()
        stats = self.transport.prepare(state, version, hf_dir)
        self.hook("weight_update_prepared")
        t1 = time.time()
        pause = self.transport.pauses  # LoRA: a new adapter name per version, the engines never stop
        if pause:
            self._broadcast("/pause_generation", {"mode": self.cfg.pause_generation_mode})
        try:
            self.hook("weight_update_paused")
            t2 = time.time()
            self.transport.activate(version)
            self.hook("weight_update_activated")
            t3 = time.time()
        finally:
            if pause:
                self._broadcast("/continue_generation")
        t4 = time.time()
        return {
            "perf/update_weights_time": t4 - t0,
            "perf/update_weights_prepare_time": t1 - t0,
            "perf/update_weights_pause_time": t2 - t1,
            "perf/update_weights_load_time": t3 - t2,
            "perf/update_weights_resume_time": t4 - t3,
            "perf/update_weights_wire_bytes": float(stats.wire_bytes),
            "perf/update_weights_full_bytes": float(stats.full_bytes),
            "perf/update_weights_density": stats.density,
            **stats.extra,
        }
