"""Colocation as Miles does it: trainer and engines take turns on the same devices.

Per rollout (loop.py calls these at the points named; each is a no-op when its flag is off):

    generate                          engines hold weights + KV cache, the trainer is parked on the host
    after_generate()                  --offload-rollout: engines /release_memory_occupation (--offload-rollout-level)
    train                             the trainer moves back to its device by itself (TrainerActor.onload)
    before_weight_update()            --offload-rollout: engines /resume_memory_occupation ["weights"]
    publish the version               --colocate: weights to each engine through shared memory (transports/colocated.py)
    after_weight_update()             --offload-train: trainer ranks offload; engines resume ["kv_cache"]
    eval, save                        save: `around_save()` brings the trainer back for the write

`start()` parks the trainer before the first generation. `--colocate` turns both offloads on unless
`--no-offload-train` / `--no-offload-rollout` say otherwise (Miles' defaults). The engine calls go
over HTTP with SGLang's paths and tags, so the embedded engine and an SGLang server (started with
--enable-memory-saver, which the launcher adds) take the same calls.
"""

from __future__ import annotations

import contextlib
import time

from miles_platform.config import RunConfig

# --offload-rollout-level (Miles) -> SGLang's memory tags; SGLang's CUDA graphs go with the KV cache
LEVEL_TAGS = {"kv_cache": ["kv_cache", "cuda_graph"], "weight": ["weights"]}


def offload_train_on(cfg: RunConfig) -> bool:
    return cfg.colocate if cfg.offload_train is None else bool(cfg.offload_train)


def offload_rollout_on(cfg: RunConfig) -> bool:
    return cfg.colocate if cfg.offload_rollout is None else bool(cfg.offload_rollout)


class Colocation:
    """The offload / onload schedule of one run (`RunServices.colocation`)."""

    def __init__(self, cfg: RunConfig, trainers: list, engines: list | None, call_trainers=None):
        """`call_trainers(cfg, trainers, method)`: run_services' (every rank, bounded by --train-timeout-s)."""
        self.cfg, self.trainers, self.engines = cfg, trainers, engines or []
        self._call = call_trainers
        self.train = (
            offload_train_on(cfg) and bool(trainers) and bool(self.engines)
        )  # nothing to make room for
        self.rollout = offload_rollout_on(cfg) and bool(self.engines)
        self.tags = [t for level in cfg.offload_rollout_level for t in LEVEL_TAGS[level]]
        self.times: dict[str, float] = {}

    @property
    def active(self) -> bool:
        return self.train or self.rollout

    def _engines(self, path: str, tags: list[str]) -> None:
        from miles_platform.rollout.client import post

        for e in self.engines:
            post(e.url, path, {"tags": tags}, api_key=self.cfg.api_key, timeout=600)

    def _trainers(self, method: str) -> None:
        self._call(self.cfg, self.trainers, method)

    def _timed(self, key: str, fn, *args) -> None:
        t0 = time.time()
        fn(*args)
        self.times[key] = self.times.get(key, 0.0) + time.time() - t0

    def start(self) -> None:
        if self.train:
            self._timed("perf/offload_train_time", self._trainers, "offload")

    def after_generate(self) -> None:
        if self.rollout:
            self._timed("perf/offload_rollout_time", self._engines, "/release_memory_occupation", self.tags)

    def before_weight_update(self) -> None:
        if self.rollout and "weights" in self.tags:
            self._timed("perf/onload_rollout_time", self._engines, "/resume_memory_occupation", ["weights"])

    def after_weight_update(self) -> None:
        if self.train:
            self._timed("perf/offload_train_time", self._trainers, "offload")
        if self.rollout:
            rest = [t for t in self.tags if t != "weights"] or ["kv_cache"]
            self._timed("perf/onload_rollout_time", self._engines, "/resume_memory_occupation", rest)

    @contextlib.contextmanager
    def around_save(self):
        """A checkpoint is written from the device (megatron's torch_dist among others): onload, save, park."""
        if self.train:
            self._trainers("onload")
        try:
            yield
        finally:
            if self.train:
                self._trainers("offload")

    def metrics(self) -> dict[str, float]:
        """This rollout's offload / onload times (reset after each call)."""
        out, self.times = self.times, {}
        return out
