"""Where a trainer rank computes on a CPU: its torch threads (`trainer_threads`: MILES_TRAIN_THREADS,
read by the driver before Ray and by each rank) and, with --pin-trainer-cpus, cores of its own, the
engines, the driver and their threads on the others.

Under `train-async` (or --fully-async) the engine generates the next rollout and the driver
publishes, records and evaluates the last version while the trainer trains: three busy processes on
as few cores as the run has. Left to the scheduler, the driver's and the engine's bursts preempt the
train step on either core: on a 2-core VM the demo's train call took 0.095-0.100 s a step under
train-async against 0.081-0.085 s with the trainer alone on one core (2026-12-07,
docs/BENCHMARKS.md). Pinned, the trainer's core runs the step only, and the others absorb the rest.

The plan is made before Ray starts (`plan`: this machine's CPUs, a local cluster, enough cores for
every rank's MILES_TRAIN_THREADS and one more) and handed to the actors in their environment
(`ENV`); each process pins all of its threads itself (`pin_trainer_rank`, `pin_others`). Threads a
pinned thread starts later inherit its cores. Ray's own daemons (GCS, raylet, agents: idle during
a step) are left where the system puts them.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable

from miles_platform.errors import ConfigError

ENV = "MILES_PIN_CPUS"  # "0;1|2,3": rank 0 on {0}, rank 1 on {1}, the others on {2, 3}
active: str | None = None  # the plan of the run this driver runs (`pin_driver`): what its actors get


def trainer_threads() -> str:
    """Each trainer rank's torch threads: $MILES_TRAIN_THREADS, else 1. One by default even in the
    sync loop on CPU, where the engines sit idle while the trainer trains: two threads took a quiet
    2-core VM's demo step 205 -> 186 ms, but any other load on either core stalls the pair (the
    quickstart's GRPO op, beside its checkpoint conversion: 51 -> 74 s), 2026-12-07."""
    given = os.environ.get("MILES_TRAIN_THREADS", "").strip() or "1"
    if not given.isdigit() or int(given) < 1:
        raise ConfigError(f"MILES_TRAIN_THREADS={given!r}: a whole number of torch threads >= 1, or unset")
    return given


def plan(cfg, threads: int) -> str | None:
    """The split --pin-trainer-cpus asks for, as `ENV`'s value (None: off). Raises ConfigError where
    it cannot be honoured: a joined cluster (its processes are not this machine's), a GPU machine, or
    too few cores for every trainer rank's `threads` plus one for everything else."""
    if not getattr(cfg, "pin_trainer_cpus", False):  # (a diffusion run has no such flag)
        return None
    from miles_platform.cluster.ray_cluster import resolve_ray_address

    if resolve_ray_address(cfg) is not None:
        raise ConfigError(
            "--pin-trainer-cpus pins the processes of a local cluster this run starts; with "
            "--ray-address / RAY_ADDRESS the trainer ranks run on that cluster's nodes: drop the flag"
        )
    if glob.glob("/dev/nvidia[0-9]*"):
        raise ConfigError(
            "--pin-trainer-cpus is for CPU-only machines, where the trainer's step is the CPU's work; "
            "here the trainer ranks compute on their GPUs: drop the flag"
        )
    if not hasattr(os, "sched_getaffinity"):
        raise ConfigError("--pin-trainer-cpus needs Linux's CPU affinity (os.sched_setaffinity)")
    cores = sorted(os.sched_getaffinity(0))
    ranks = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
    need = ranks * threads
    if len(cores) <= need:
        raise ConfigError(
            f"--pin-trainer-cpus: {ranks} trainer rank(s) x {threads} thread(s) (MILES_TRAIN_THREADS) need "
            f"{need} cores of their own and one more for the engines and the driver; this process may "
            f"use {len(cores)} ({','.join(map(str, cores))})"
        )
    per_rank = [cores[r * threads : (r + 1) * threads] for r in range(ranks)]
    rest = cores[need:]
    return ";".join(",".join(map(str, c)) for c in per_rank) + "|" + ",".join(map(str, rest))


def _parse(value: str) -> tuple[list[set[int]], set[int]]:
    ranks, _, rest = value.partition("|")
    return [{int(c) for c in r.split(",")} for r in ranks.split(";")], {int(c) for c in rest.split(",")}


def pin_process(cores: set[int]) -> None:
    """Every thread of this process on `cores` (threads started later inherit their starter's)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, FileNotFoundError):  # a thread that just ended
            pass


def pin_trainer_rank(rank: int) -> set[int] | None:
    """In a trainer rank: onto its own cores when the run's plan says so (`ENV`); -> them, or None."""
    value = os.environ.get(ENV)
    if not value:
        return None
    cores = _parse(value)[0][rank]
    pin_process(cores)
    return cores


def pin_others(value: str | None = None) -> set[int] | None:
    """In an engine or the driver: onto the cores no trainer rank has (`value`, else `ENV`); -> the
    cores this thread had before (what `pin_process` restores), or None when there is no plan."""
    value = value if value is not None else os.environ.get(ENV)
    if not value:
        return None
    before = os.sched_getaffinity(0)
    pin_process(_parse(value)[1])
    return before


def pin_driver(value: str | None) -> Callable[[], None] | None:
    """The driver onto the others' cores before it starts Ray (whose daemons inherit them), `value`
    kept in `active` for the actors it starts; -> what undoes both (an in-process caller's threads
    get their cores back), or None without a plan."""
    global active
    before = pin_others(value)
    if before is None:
        return None
    active = value

    def undo() -> None:
        global active
        active = None
        pin_process(before)

    return undo


def cores_of(_actor=None) -> list[int]:
    """This process's cores (its calling thread's): what a pinned actor reports (`__ray_call__`)."""
    return sorted(os.sched_getaffinity(0))
