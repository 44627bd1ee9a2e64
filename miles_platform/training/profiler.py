"""--use-pytorch-profiler on the trainer ranks, as Miles' TrainProfiler (miles/utils/profile_utils.py):
one torch.profiler per rank, started when the rank is built and stepped at the end of every `train`
(one rollout), with Miles' schedule: wait --profile-step-start - 1 rollouts, warm up one, record
rollouts [--profile-step-start, --profile-step-end) of this launch. The trace of the recorded rollouts
is written when the window closes, by torch's tensorboard_trace_handler, gzipped, as
`<--tensorboard-dir>/train_overall_rank_<rank>.<pid>.<ms>.pt.trace.json.gz` (default dir:
<storage-root>/runs/<run>/tensorboard): TensorBoard's profiler plugin, Perfetto and chrome://tracing
read it.

--profile-target train_actor / train_log_probs (fsdp, as Miles'): a profiler per micro-batch loop
(each optimizer step's training micro-batches; each log-prob pass), stepped as each micro-batch's
forward starts, the same schedule over micro-batches; its trace is `<target>_rank_<rank>.*` per loop.

Also the trainer's wait (Miles' `perf/train_wait_time`): the seconds a rank spent between the end of
its previous `train` (or its start) and this one, i.e. waiting for rollouts and weight updates."""

from __future__ import annotations

import os
import time

import torch


def trace_dir(cfg) -> str:
    """Where the traces go: --tensorboard-dir, else <storage-root>/runs/<run>/tensorboard (Miles'
    profiler writes into its --tensorboard-dir)."""
    if cfg.tensorboard_dir:
        return cfg.tensorboard_dir
    from miles_platform.store.paths import StoragePaths

    return StoragePaths(cfg.storage_root).join("runs", cfg.run_name, "tensorboard")


def _profiler(cfg, rank: int, name: str) -> torch.profiler.profile:
    """Miles' _create_torch_profiler: its schedule over steps [start, end), a gzipped trace per rank."""
    start, end = cfg.profile_step_start, cfg.profile_step_end
    d = trace_dir(cfg)
    os.makedirs(d, exist_ok=True)
    return torch.profiler.profile(
        schedule=torch.profiler.schedule(
            wait=max(start - 1, 0), warmup=1 if start > 0 else 0, active=end - start, repeat=1
        ),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(
            d, worker_name=f"{name}_rank_{rank}", use_gzip=True
        ),
        record_shapes=True,
        with_stack=True,
        profile_memory=True,
        with_flops=True,
    )


def profile_micro_batches(cfg, rank: int, name: str, reqs) -> torch.profiler.profile | None:
    """--profile-target train_actor / train_log_probs: a started profiler for this loop of micro-batch
    requests `reqs`, stepped as each one's forward starts (its `context`); None when not profiled.
    `finish_micro_batches` after the loop."""
    if not (cfg.use_pytorch_profiler and name in cfg.profile_target):
        return None
    prof = _profiler(cfg, rank, name)
    prof.start()
    for k, req in enumerate(reqs):
        if k:
            req.context = lambda inner=req.context: (prof.step(), inner())[1]
    return prof


def finish_micro_batches(prof: torch.profiler.profile | None) -> None:
    if prof is not None:
        prof.step()  # the last micro-batch's
        prof.stop()  # a window still open ends here (its trace is written)


class TrainProfiler:
    """The rank's profiler (None inside without --use-pytorch-profiler): `start()` once the rank is
    built, `step()` after each train call."""

    def __init__(self, cfg, rank: int):
        self.prof = None
        if cfg.use_pytorch_profiler and "train_overall" in cfg.profile_target:
            self.prof = _profiler(cfg, rank, "train_overall")

    def start(self) -> None:
        if self.prof is not None:
            self.prof.start()

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()


class TrainWait:
    """perf/train_wait_time, perf/train_time, perf/step_time and perf/wait_time_ratio (Miles' timers
    `train_wait` and `train`): `begin()` at the start of train, `end()` when it returns."""

    def __init__(self):
        self._idle_since = time.time()  # the rank is built: it waits for its first rollout
        self._t0 = None

    def begin(self) -> float:
        self._t0 = time.time()
        return self._t0

    def end(self) -> dict[str, float]:
        now = time.time()
        wait, train = self._t0 - self._idle_since, now - self._t0
        self._idle_since = now
        out = {"perf/train_wait_time": wait, "perf/train_time": train}
        if wait + train > 0:
            out["perf/step_time"] = wait + train
            out["perf/wait_time_ratio"] = wait / (wait + train)
        return out
