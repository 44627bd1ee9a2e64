"""A run's engine fleet: start, restart and stop its engines (embedded Ray actors, SGLang, or external)
with the router in front of them, and its OPD teacher engine (`run_services` calls these)."""

from __future__ import annotations

import contextlib
from typing import Any

from miles_platform.cluster.devices import run_rollout_dtype
from miles_platform.config import ConfigError, RunConfig
from miles_platform.rollout.engine_server import EngineActor
from miles_platform.weights.transports import EngineHandle, EngineProcess


class RolloutEngineActor(EngineActor):
    """The embedded engine as a placed Ray actor (placement passes `rank=`)."""

    def __init__(self, hf_checkpoint: str, rank: int = 0, secret_env: dict | None = None, **kwargs):
        from miles_platform.store.remote import apply_secret_env

        apply_secret_env(secret_env)  # the object store's credentials (never in the runtime env)
        self.rank = rank
        super().__init__(hf_checkpoint, **kwargs)

    def update_weights_from_store(self, handle, weight_version: int) -> int:
        """Load weights put into the object store by the trainer (`--update-weight-transfer-mode mooncake`)."""
        from miles_platform.cluster.object_store import get_rollout_data
        from miles_platform.weights.transports import decode_state

        return self.update_weights_from_tensors(decode_state(get_rollout_data(handle)), weight_version)


def start_engines(cfg: RunConfig, groups: dict[str, tuple[Any, list[int]]]):
    """-> (engine handles, router handle with .url/.stop()). Engines start at weight version 0."""

    from miles_platform.cluster.ray_cluster import create_role_actors
    from miles_platform.rollout.router import start_router

    if not cfg.embedded_engines_only:
        from miles_platform.rollout.sglang_launcher import rollout_engines

        actors, infos = rollout_engines(cfg, groups)
        actors = actors or [None] * len(infos)
        handles = [EngineHandle(url=i.url, actor=a) for i, a in zip(infos, actors, strict=True)]
    else:
        actors = create_role_actors(
            RolloutEngineActor, cfg, groups, "rollout", cfg.hf_checkpoint, **_embedded_kwargs(cfg)
        )
        handles = engine_handles(actors)
    router = start_router(
        port=cfg.sglang_router_port or 0,
        api_key=cfg.api_key,
        worker_api_key=cfg.api_key,
        worker_urls=[h.url for h in handles],
    )
    return handles, router


def _embedded_kwargs(cfg: RunConfig) -> dict[str, Any]:
    return dict(
        api_key=cfg.api_key,
        dtype=run_rollout_dtype(cfg),  # resolved: bf16 on a GPU cluster unless --rollout-dtype says
        max_batch_size=embedded_max_running_requests(cfg),
        device="auto",  # the GPU of its bundle (cluster/devices.rank_device), else the CPU
        mem_fraction_static=embedded_mem_fraction_static(cfg),
        router_dtype=cfg.moe_router_dtype,  # the engine's routers compute as the trainer's
        **embedded_chat_parsers(cfg),
        weight_roots=engine_weight_roots(cfg),
        pause_wait_timeout_s=cfg.pause_wait_timeout_s,
        pause_max_queued_requests=cfg.pause_max_queued_requests,
        secret_env=run_storage_secrets(cfg),
        run_name=cfg.run_name,  # the OpenAI model id: <run>.v<NNNNNN>
        options={
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1", **run_storage_env(cfg), **pin_env(cfg)}}
        },
    )


def pin_env(cfg: RunConfig) -> dict[str, str]:
    """--pin-trainer-cpus: the plan an engine pins itself by (off the trainers' cores): the one the
    driver pinned itself by (cluster/cpu_pinning.pin_driver)."""
    from miles_platform.cluster import cpu_pinning

    return {cpu_pinning.ENV: cpu_pinning.active} if cfg.pin_trainer_cpus and cpu_pinning.active else {}


def run_storage_env(cfg: RunConfig) -> dict[str, str]:
    """The object-store endpoint and settings of this driver, for actors that read or write the
    run's remote dirs (Ray's workers on another node do not have the driver's environment)."""
    from miles_platform.store.remote import storage_env

    return storage_env(cfg.storage_root, cfg.save, cfg.load, cfg.update_weight_disk_dir)


def run_storage_secrets(cfg: RunConfig) -> dict[str, str]:
    """The driver's object-store credentials, for the actors' constructors (`secret_env`)."""
    from miles_platform.store.remote import storage_secrets

    return storage_secrets(cfg.storage_root, cfg.save, cfg.load, cfg.update_weight_disk_dir)


def restart_engine(cfg: RunConfig, groups: dict[str, tuple[Any, list[int]]], index: int) -> EngineHandle:
    """A fresh embedded engine on the bundle of engine `index` (--use-fault-tolerance: the dead
    one was killed first, so its resources are free). It serves --hf-checkpoint until loaded."""
    from miles_platform.cluster.ray_cluster import (
        ENGINE_SHARE,
        bundle_actor_options,
        cluster_has_gpus,
        plan_placement,
        remote_class,
    )

    pg, indices = groups["rollout"]
    slot = indices[:: max(cfg.rollout_num_gpus_per_engine, 1)][index]
    kwargs = _embedded_kwargs(cfg)
    bundle = plan_placement(cfg, use_gpu=cluster_has_gpus())["rollout"].bundle
    opts = bundle_actor_options(pg, slot, ENGINE_SHARE, bundle, **kwargs.pop("options"))
    actor = remote_class(RolloutEngineActor).options(**opts).remote(cfg.hf_checkpoint, rank=index, **kwargs)
    return engine_handles([actor])[0]


def create_teacher_engine(cfg: RunConfig) -> Any:
    """--opd-teacher-hf-checkpoint: the embedded engine serving the teacher for the run (its own Ray
    actor, outside the placement plan: it only prefills, once per rollout; it never loads weights).
    Created, not waited on: it starts beside the run's trainers and engines (teacher_handle waits)."""
    from miles_platform.cluster import forkserver
    from miles_platform.cluster.ray_cluster import remote_class

    env = forkserver.runtime_env({"env_vars": {"OMP_NUM_THREADS": "1"}})
    return (
        remote_class(EngineActor)
        .options(num_cpus=0, runtime_env=env)
        .remote(
            cfg.opd_teacher_hf_checkpoint, api_key=cfg.api_key, dtype=run_rollout_dtype(cfg), weight_roots=[]
        )
    )


def teacher_handle(actor: Any) -> EngineHandle:
    return engine_handles([actor])[0]


def engine_handles(actors: list[Any]) -> list[EngineHandle]:
    """Handles of embedded engine actors (waits until they serve): URL, actor and process."""
    import ray

    where = ray.get([a.locate.remote() for a in actors])
    return [
        EngineHandle(url=u, actor=a, process=EngineProcess(*p))
        for a, (u, p) in zip(actors, where, strict=True)
    ]


def kill_engine_process(handle: EngineHandle) -> bool:
    """SIGKILL an embedded engine's process when it runs on this node (True if it was killed).
    `ray.kill` asks the actor to exit and force-kills it only after Ray's grace (5 s), which a hung or
    SIGSTOPped process never answers: that long its in-flight requests hang instead of failing over,
    and a run's teardown waits. On another node `ray.kill` alone does it."""
    import ray

    p = handle.process
    if p is None or p.node_id != ray.get_runtime_context().get_node_id():
        return False
    return kill_local_process(p)


def kill_local_process(p: EngineProcess) -> bool:
    """SIGKILL process `p` of this node unless its pid is another process's by now (True if killed)."""
    import psutil

    from miles_platform.weights.transports import process_started

    try:
        proc = psutil.Process(p.pid)
        if process_started(p.pid) != p.started:  # gone, and the pid is another process's now
            return False
        proc.kill()
    except psutil.Error:
        return False
    return True


def engine_weight_roots(cfg: RunConfig) -> list[str]:
    """Where a run's engines may load weights from over HTTP: the run's own dirs (HF exports,
    disk-delta engine-local copies) and --hf-checkpoint's parent; nothing else on the host or store."""
    import os

    from miles_platform.store.paths import StoragePaths
    from miles_platform.weights.transports.disk_delta import engine_local_root

    roots = [
        StoragePaths(cfg.storage_root).run_dir(cfg.run_name),  # an object-store root: downloaded from
        os.path.dirname(os.path.abspath(cfg.hf_checkpoint)),
    ]
    if cfg.update_weight_disk_dir:
        roots.append(engine_local_root(cfg))
    return roots


def embedded_max_running_requests(cfg: RunConfig) -> int:
    """The embedded engine's batch cap: `--sglang-max-running-requests` as for SGLang (default 512)."""
    args = {k.replace("_", "-"): v for k, v in cfg.sglang_args.items()}
    value = args.get("max-running-requests", 512)
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise ConfigError(f"--sglang-max-running-requests {value!r}: must be an integer >= 1")
    return n


def embedded_mem_fraction_static(cfg: RunConfig) -> float | None:
    """`--sglang-mem-fraction-static` as for SGLang: the embedded engine's weights + KV cache bound
    (a fraction of its device's memory; unset: no bound)."""
    args = {k.replace("_", "-"): v for k, v in cfg.sglang_args.items()}
    value = args.get("mem-fraction-static")
    if value is None:
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        f = 0.0
    if not 0 < f <= 1:
        raise ConfigError(f"--sglang-mem-fraction-static {value!r}: must be a number in (0, 1]")
    return f


def embedded_chat_parsers(cfg: RunConfig) -> dict[str, str | None]:
    """`--sglang-tool-call-parser` / `--sglang-reasoning-parser` as SGLang's server takes them: how
    the embedded engine's /v1/chat/completions splits an answer (checked: names it has)."""
    from miles_platform.rollout.engine_server import check_chat_parsers

    args = {k.replace("_", "-"): v for k, v in cfg.sglang_args.items()}
    out = {"tool_call_parser": args.get("tool-call-parser"), "reasoning_parser": args.get("reasoning-parser")}
    check_chat_parsers(out["tool_call_parser"], out["reasoning_parser"])
    return out


# what the embedded engine takes (preflight refuses any other --sglang-* for it)
EMBEDDED_SGLANG_ARGS = ("max-running-requests", "mem-fraction-static", "tool-call-parser", "reasoning-parser")

SHUTDOWN_WAIT_S = 15.0  # all engines together: a server stops in ~1 s (its thread join is bounded by 10)


def stop_engines(handles: list[EngineHandle], wait_s: float = SHUTDOWN_WAIT_S) -> None:
    """Ask every engine to stop its server at once, wait for them together (at most `wait_s`: a
    hung or stopped engine never answers), then kill every actor; one that did not answer is
    SIGKILLed first where it runs on this node (`kill_engine_process`)."""
    import ray

    asked: list[tuple[Any, EngineHandle]] = []
    for h in handles:
        if h.actor is not None:
            with contextlib.suppress(Exception):  # the actor may already be gone; the kill is what matters
                asked.append((h.actor.shutdown.remote(), h))
    done: list = []
    try:
        if asked:
            done, _ = ray.wait([r for r, _ in asked], num_returns=len(asked), timeout=wait_s)
    finally:  # a wait that raises (Ray going down, Ctrl-C) still kills every actor
        for r, h in asked:
            if r not in done:
                kill_engine_process(h)
        for h in handles:
            if h.actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(h.actor)


def fault_in_engine(handle: EngineHandle, request) -> int:
    """--ci-fault-hooks `"target": {"engine": N}`: send the request's signal to that engine's process
    (fault_hooks.ENGINE_SIGNALS). On the driver's node it is sent from here, so the engine is dead or
    stopped when the hook returns; elsewhere the engine signals itself. -> the engine's pid."""
    import os

    import ray

    from miles_platform.fault_hooks import ENGINE_SIGNALS

    sig = ENGINE_SIGNALS[request.kind]
    p = handle.process  # recorded at its start (embedded engines: preflight refuses the others)
    if p.node_id == ray.get_runtime_context().get_node_id():
        os.kill(p.pid, sig)
    else:
        handle.actor.__ray_call__.remote(lambda self, s: os.kill(os.getpid(), s), sig)
    return p.pid
