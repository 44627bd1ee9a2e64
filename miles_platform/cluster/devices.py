"""The device a process computes on: one per trainer rank and one per embedded engine.

    rank_device()         the device Ray assigned this actor (its first GPU), else LOCAL_RANK on a
                          CUDA machine outside Ray, else the CPU; `requested` wins ("cpu", "cuda:1")
    group_backend(dev)    torch.distributed backend of a group of such ranks: NCCL for CUDA tensors
                          (with gloo beside it for the CPU ones), gloo on the CPU
    default_dtype(dev)    the forward / serving dtype when neither --train-forward-dtype nor
                          --rollout-dtype is given: bf16 on CUDA (Miles' default) with the fsdp
                          backend, fp32 on the CPU and with megatron (whose mixed-precision
                          optimizer is not built: config.py refuses its bf16)
    total_memory(dev)     bytes of the device (host RAM for the CPU): what --sglang-mem-fraction-static
                          is a fraction of

Ray sets CUDA_VISIBLE_DEVICES of a GPU actor to the GPUs it was given, so its first GPU is `cuda:0`
inside the actor whatever its physical index. A fractional share (`--colocate`: trainer 0.4, engine
0.2 of a bundle) gives both roles the same GPU.
"""

from __future__ import annotations

import os
import sys

import torch

AUTO = "auto"


def _ray_gpu_ids() -> list | None:
    """The GPU ids Ray assigned this worker; None outside a Ray worker (the driver, a plain script)."""
    if "ray" not in sys.modules:  # never import Ray for this (the GPU check machine has none)
        return None
    import ray

    if not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    if getattr(ctx, "worker", None) is None or ctx.worker.mode != ray.WORKER_MODE:
        return None
    return list(ray.get_gpu_ids())


def rank_device(requested: str | torch.device | None = None) -> torch.device:
    """This process's device. `requested` ("cpu", "cuda", "cuda:N", "meta" in tests; None or "auto":
    choose): a Ray actor takes its first assigned GPU, or the CPU when Ray gave it none (a CPU bundle
    on a GPU machine stays on the CPU); outside Ray, `cuda:$LOCAL_RANK` when CUDA is available."""
    if requested is not None and str(requested) != AUTO:
        dev = torch.device(requested)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", 0)
        return dev
    gpus = _ray_gpu_ids()
    if gpus is not None:
        return torch.device("cuda", 0) if gpus and torch.cuda.is_available() else torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def use_device(device: torch.device) -> None:
    """Make `device` the current CUDA device of this process (NCCL and CUDA caching follow it)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def group_backend(device: torch.device) -> str:
    """NCCL between CUDA ranks (gloo beside it for CPU tensors: metrics, object broadcasts), else gloo."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


def default_dtype(device: torch.device | str, train_backend: str = "fsdp") -> str:
    """The forward / serving dtype when none is given: bf16 on CUDA (fsdp), fp32 elsewhere."""
    return "bf16" if torch.device(device).type == "cuda" and train_backend == "fsdp" else "fp32"


def forward_dtypes(
    train: str | None, rollout: str | None, device: torch.device | str, train_backend: str = "fsdp"
) -> tuple[str, str]:
    """(--train-forward-dtype, --rollout-dtype) resolved on `device`: one given sets both (they must
    agree, config.py checks it), none given -> default_dtype for both."""
    chosen = train or rollout or default_dtype(device, train_backend)
    return train or chosen, rollout or chosen


def run_device_type(cfg) -> str:
    """The device kind of a run's trainers and engines, on its driver: "cuda" when the Ray cluster it
    joined or started has GPUs (placement then gives every rank and engine one), else "cpu"."""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            from miles_platform.cluster.ray_cluster import cluster_has_gpus

            return "cuda" if cluster_has_gpus() else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_rollout_dtype(cfg) -> str:
    """--rollout-dtype as the run's engines serve it (resolved on the run's device kind)."""
    return forward_dtypes(
        cfg.train_forward_dtype, cfg.rollout_dtype, run_device_type(cfg), cfg.train_backend
    )[1]


def total_memory(device: torch.device | str) -> int:
    """Bytes of memory on `device` (the host's RAM for the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def empty_cache(device: torch.device | str) -> None:
    """Hand the caching allocator's free blocks back to the device (after an offload or a release)."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def peak_memory_mb(device: torch.device | str) -> float | None:
    """Peak bytes allocated on a CUDA device since the process started, in MiB (None elsewhere)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


def config_on_device(cfg, device: torch.device | str):
    """`cfg` as one process on `device` sees it: a shallow copy whose --train-forward-dtype and
    --rollout-dtype are resolved (`forward_dtypes`), so everything below reads plain dtypes."""
    import copy

    if not hasattr(cfg, "train_forward_dtype"):  # a bare namespace (a backend built by a test or a tool)
        return cfg
    backend = getattr(cfg, "train_backend", "fsdp")
    train, rollout = forward_dtypes(
        cfg.train_forward_dtype, getattr(cfg, "rollout_dtype", None), device, backend
    )
    if (train, rollout) == (cfg.train_forward_dtype, cfg.rollout_dtype):
        return cfg
    out = copy.copy(cfg)
    out.train_forward_dtype, out.rollout_dtype = train, rollout  # a field-for-field copy, not revalidated
    return out
