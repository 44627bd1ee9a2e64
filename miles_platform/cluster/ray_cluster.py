"""Ray: join an existing cluster or start a local one, and place trainer / rollout roles.

Placement follows Miles: a *bundle* is one device unit. On GPU a bundle is
`{"GPU": 1, "CPU": num_cpus_per_actor}`; on CPU the same plan becomes `{"CPU": num_cpus_per_actor}`,
so the placement logic that runs on a laptop is the one that runs on a GPU cluster.

- trainer ("actor"): `--actor-num-nodes x --actor-num-gpus-per-node` bundles.
- rollout: `--rollout-num-gpus` bundles; engine i owns the `--rollout-num-gpus-per-engine`
  consecutive bundles starting at `i * tp` (sorted by node, so an engine never straddles nodes
  under PACK). No bundles with `--rollout-external-engine-addrs` (engines live elsewhere).
- `--colocate`: one placement group; both roles get every bundle and share it fractionally
  (trainer 0.4, engine 0.2 of a bundle, as in Miles).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
from dataclasses import dataclass
from typing import Any

from miles_platform.config import ConfigError, RunConfig

log = logging.getLogger(__name__)
ROLES = ("actor", "rollout")
# Fraction of a bundle each process takes. Colocated roles share a bundle; Miles uses 0.4 / 0.2.
ACTOR_SHARE = {True: 0.4, False: 0.8}
ENGINE_SHARE = 0.2


@dataclass
class RayContext:
    """What `init_ray` did, so `shutdown_ray` undoes only that."""

    address: str | None  # GCS address of a joined cluster; None for a local one
    started_local: bool  # we started a local cluster (shutdown stops it)
    connected: bool  # we connected this driver (shutdown disconnects it)


def resolve_ray_address(cfg: RunConfig) -> str | None:
    """`--ray-address`, else `RAY_ADDRESS`, else None (start a local cluster)."""
    addr = cfg.ray_address or os.environ.get("RAY_ADDRESS") or None
    if addr in ("local",):
        return None
    return addr


def init_ray(
    cfg: RunConfig, namespace: str | None = None, *, cpus_needed: float | None = None, **init_kwargs: Any
) -> RayContext:
    """Join `--ray-address` / `RAY_ADDRESS`, or start a private local cluster.

    A local start never attaches to someone else's `ray start` on this machine (`address="local"`),
    advertises 127.0.0.1 as its node address and listens on it only (`start_local_ray`), runs with
    Ray's token auth (Ray's default; the token lives in ~/.ray/auth_token, so only this user's
    processes can submit work), has no dashboard, and offers `max(os.cpu_count(), CPUs the
    placement plan needs)` logical CPUs so the plan fits even on a small laptop. `cpus_needed`: a
    run without an LLM placement plan (diffusion) says how many CPUs its actors take.
    """
    import ray

    if ray.is_initialized():  # someone else owns this driver connection
        return RayContext(address=None, started_local=False, connected=False)
    secure_ray_token()
    addr = resolve_ray_address(cfg)
    if addr:
        # a cluster reached on loopback may be one started in single-machine mode (start_local_ray),
        # whose nodes are at 127.0.0.1: a driver outside that mode looks for its raylet at the
        # host's IP and waits forever (measured); in it, it joins either kind
        mode = _single_machine_mode() if _is_loopback_address(addr) else contextlib.nullcontext()
        try:
            with mode:
                ray.init(address=addr, namespace=namespace, log_to_driver=False, **init_kwargs)
        except (ConnectionError, RuntimeError) as e:
            raise ConfigError(
                f"--ray-address {addr}: cannot join the Ray cluster ({e}); check `ray status --address {addr}` "
                "or unset --ray-address / RAY_ADDRESS to start a local cluster"
            ) from e
        if _nodes_all_on_this_machine():  # e.g. the driver of a Ray job on a one-machine cluster
            start_fork_server(*_fork_extras(cfg))
        return RayContext(address=addr, started_local=False, connected=True)
    need = cpus_needed
    if need is None:
        need = sum(
            p.num_bundles * p.bundle.get("CPU", 0.0) for p in plan_placement(cfg, use_gpu=False).values()
        )
    num_cpus = max(os.cpu_count() or 1, int(-(-need // 1)))
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        log.warning(
            "RAY_AUTH_MODE=disabled: the local Ray cluster accepts work from any process that reaches "
            "its ports; unset it to keep Ray's token auth"
        )
    start_fork_server(*_fork_extras(cfg))
    start_local_ray(num_cpus, namespace=namespace, **init_kwargs)
    return RayContext(address=None, started_local=True, connected=True)


def secure_ray_token() -> str | None:
    """Ray's token file, readable by this user only, before Ray reads or writes it. Ray creates
    `~/.ray/auth_token` with the umask's mode (0644: with a traversable home another local user read
    it and submitted a job); here it is created 0600 in a 0700 dir when absent, and tightened to 0600
    when looser. A file owned by someone else is refused. Returns its path (None: the token comes
    from RAY_AUTH_TOKEN, or auth is disabled)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled" or os.environ.get("RAY_AUTH_TOKEN"):
        return None
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(
        os.path.expanduser("~"), ".ray", "auth_token"
    )
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it meanwhile: checked below
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise ConfigError(f"Ray's token file {path} belongs to uid {st.st_uid}, not this user: remove it or "
                          "set RAY_AUTH_TOKEN_PATH to a file of your own")  # fmt: skip
    if st.st_mode & 0o077:
        os.chmod(path, 0o600)
        log.warning(
            "Ray's token file %s was readable by others (mode %o): now 0600", path, st.st_mode & 0o777
        )
    return path


# An object up to Ray's `max_direct_call_object_size` travels inside the call that carries it (an
# argument, a return) through the owner's in-process store; a larger one goes through the node's
# shared-memory store, whose create / seal / get / release / free each round-trip through the raylet.
# Ray's default is 100 KiB; a private cluster of ours raises it to 8 MiB: a small model's weights
# (the demo's 1.7 MB, the trainer's return and the engines' update) and a rollout's train data
# then never touch the raylet, which took ~6-8 ms of CPU a train-async step on 2 cores for the
# three shared-memory objects of each (2026-12-07). Anything larger still goes through it.
INLINE_BYTES = 8 << 20
RAY_INLINE_BYTES = 100 * 1024  # Ray's default, a cluster's that does not set it
_INLINE_BY_SESSION: dict[str, int] = {}


def inline_bytes() -> int:
    """The largest object this process's Ray cluster passes inside a call (its system config's
    `max_direct_call_object_size`: ours for a private cluster, Ray's default for one that does not
    set it); read once per cluster session."""
    from ray._private import worker

    node = getattr(worker.global_worker, "node", None)
    session = getattr(node, "session_name", None)
    if session is None:
        return RAY_INLINE_BYTES
    if session not in _INLINE_BY_SESSION:
        from ray._private.state import state

        try:
            config = state.get_system_config()
        except Exception:  # noqa: BLE001 - unknown: Ray's default, the safe side
            config = {}
        _INLINE_BY_SESSION[session] = int(config.get("max_direct_call_object_size", RAY_INLINE_BYTES))
    return _INLINE_BY_SESSION[session]


INLINE_HEADROOM = 64 << 10  # what else a call carries beside an inline payload (its other arguments)


def fits_in_call(nbytes: int) -> bool:
    """Whether a payload of `nbytes` travels inside a call of this cluster (`inline_bytes`), with
    room for the call's other arguments; else it goes through the object store."""
    return nbytes <= inline_bytes() - INLINE_HEADROOM


def start_local_ray(num_cpus: int, **init_kwargs: Any) -> None:
    """Start a private one-machine Ray cluster whose every server listens on 127.0.0.1 only.

    `ray.init(_node_ip_address="127.0.0.1")` alone does not do it: Ray swaps a loopback node address
    for the host's outward IP (`services.resolve_ip_for_localhost`), and its GCS, raylet, workers and
    agents then listen on `::` / 0.0.0.0 / that IP. Ray's single-machine mode (what it runs on macOS
    and Windows: `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`) keeps 127.0.0.1, and then Ray's C++ servers
    bind loopback (`listen_to_localhost_only`). The mode is set while the cluster starts, so its
    processes inherit it, and restored after, so a later join of a real cluster is unaffected.
    With this driver's fork server up, Ray prestarts no idle workers (no actor would use them).
    Nor does it start the three Python servers a private cluster has no use for (`_without_monitors`),
    and its dashboard agent loads none of the modules that would serve them (`_light_dashboard_agent`).
    """
    import ray

    from miles_platform.cluster import forkserver

    ours: dict[str, Any] = {"max_direct_call_object_size": INLINE_BYTES}  # inline_bytes()
    if forkserver.current() is not None:
        # the actors fork from this driver's server: the idle workers Ray prestarts for the first
        # driver (one per core, ~0.5-1 CPU-s each, in the middle of start-up) would serve none of them
        ours["prestart_worker_first_driver"] = False
    init_kwargs["_system_config"] = {**ours, **(init_kwargs.pop("_system_config", None) or {})}
    with _single_machine_mode(), _light_setup_worker(), _without_monitors(), _light_dashboard_agent():
        ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=num_cpus,
                 include_dashboard=False, log_to_driver=False, **init_kwargs)  # fmt: skip


@contextlib.contextmanager
def _without_monitors():
    """The head node `ray.init` starts here runs no log monitor, no autoscaler monitor and no
    dashboard API server: three Python servers a private one-node cluster has no use for.

    The log monitor tails every worker's log file to stream it to drivers, and every driver of ours
    connects with `log_to_driver=False`: it streamed to no one, and its polling grew with the log
    files of each actor the cluster had run (up to 9 CPU-s over a `make test` worker's cluster; 27
    CPU-s in all, 2026-12-06). The autoscaler monitor has nothing to scale on one fixed node; it did
    not answer SIGTERM, so Ray's shutdown waited out its 1 s grace at the end of each local run.
    The API server (started even with `include_dashboard=False`) serves Ray's job-submission and
    state HTTP APIs, on a random loopback port no one is told of. Together ~2.3 CPU-s and ~1.3 s of
    wall time off each start (`bench_startup`'s `ray` phase). `ray.init` exposes none of the three
    switches: the node's `include_log_monitor` and `no_monitor` parameters, its `start_api_server`."""
    from ray._private import node as ray_node

    real = ray_node.Node.__init__

    def init(self, ray_params, *args, **kwargs):
        if kwargs.get("head", args[0] if args else False):
            ray_params.include_log_monitor = False
            ray_params.no_monitor = True
        real(self, ray_params, *args, **kwargs)

    def no_api_server(self, **kwargs):
        self._webui_url = None

    api = ray_node.Node.start_api_server
    ray_node.Node.__init__ = init
    ray_node.Node.start_api_server = no_api_server
    try:
        yield
    finally:
        ray_node.Node.__init__ = real
        ray_node.Node.start_api_server = api


@contextlib.contextmanager
def _light_dashboard_agent():
    """The head node's dashboard agent in Ray's minimal mode and without its modules
    (cluster/dashboard_agent.py says why): the raylet registers the node once the agent is up, so this is
    the cluster's start, 3.1-3.3 -> 1.8-1.9 s to `ray.init`'s return (3 + 3 starts alternated, 2026-12-06).
    Ray picks the mode from whether the dashboard's optional dependencies import, and builds the agent's
    command from `_build_python_executable_command_memory_profileable`; while this start builds it, the
    first answers "missing" and the second puts our launcher before Ray's agent script."""
    from ray._private import ray_constants, services
    from ray._private import utils as ray_utils

    from miles_platform.cluster import dashboard_agent

    deps, command = (
        ray_utils.get_dashboard_dependency_error,
        services._build_python_executable_command_memory_profileable,
    )

    def agent_command(component, session_dir):
        cmd = command(component, session_dir)
        if component == ray_constants.PROCESS_TYPE_DASHBOARD_AGENT:
            return [*cmd, os.path.abspath(dashboard_agent.__file__)]
        return cmd

    ray_utils.get_dashboard_dependency_error = lambda: ImportError("a private cluster's agent runs minimal")
    services._build_python_executable_command_memory_profileable = agent_command
    try:
        yield
    finally:
        ray_utils.get_dashboard_dependency_error = deps
        services._build_python_executable_command_memory_profileable = command


@contextlib.contextmanager
def _light_setup_worker():
    """The cluster's raylet starts its workers through cluster/setup_worker.py (standard library
    only; same result as Ray's script, ~0.45 CPU-s less per actor start: see that module). Ray's
    node reads the script's file name when it starts; an absolute name replaces its default path."""
    from ray._private import ray_constants

    from miles_platform.cluster import setup_worker

    name = ray_constants.SETUP_WORKER_FILENAME
    ray_constants.SETUP_WORKER_FILENAME = os.path.abspath(setup_worker.__file__)
    try:
        yield
    finally:
        ray_constants.SETUP_WORKER_FILENAME = name


_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _is_loopback_address(addr: str) -> bool:
    """`127.0.0.1:6379`, `localhost:6379`, `[::1]:6379`, `::1`, a name that resolves to loopback
    only (a GCS address; never a `ray://` one, nor `auto`)."""
    import ipaddress

    from miles_platform.cluster.ports import is_loopback_host

    if "://" in addr or addr == "auto":
        return False
    try:  # a bare IPv6 address: its colons are not a port
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:
        pass
    host = addr.rsplit(":", 1)[0] if ":" in addr else addr
    return is_loopback_host(host)


@contextlib.contextmanager
def _single_machine_mode():
    """Ray's single-machine mode while ray.init starts or joins a cluster: the processes it starts
    inherit the env var. Process-wide for that moment, so a subprocess another thread starts
    meanwhile inherits it too (ray.init runs on the driver's main thread before any actor)."""
    from ray._private import ray_constants  # read once at import; the env var alone is too late

    env, const = os.environ.get(_SINGLE_MACHINE_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_SINGLE_MACHINE_ENV], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = const
        if env is None:
            os.environ.pop(_SINGLE_MACHINE_ENV, None)
        else:
            os.environ[_SINGLE_MACHINE_ENV] = env


def _fork_extras(cfg: RunConfig) -> list[str]:
    lora, backend = getattr(cfg, "lora_rank", 0), getattr(cfg, "train_backend", "fsdp")
    diffusion = getattr(cfg, "diffusion_task", None)
    return [*(["peft"] if lora else []), *(["megatron"] if backend == "megatron" else []),
            *(["diffusion"] if diffusion else [])]  # fmt: skip


def _nodes_all_on_this_machine() -> bool:
    """Every alive node of the joined cluster has this machine's node IP (a loopback `ray start`
    head + workers): its actors can fork from this driver's fork server. Never for a Ray client
    (`ray://`) connection or a cluster that spans machines."""
    import ray

    try:
        if ray.util.client.ray.is_connected():
            return False
        me = ray.util.get_node_ip_address()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
    except Exception:  # noqa: BLE001 - an optimization only: when in doubt, start actors cold
        return False
    return bool(nodes) and all(n.get("NodeManagerAddress") == me for n in nodes)


def shutdown_ray(ctx: RayContext) -> None:
    """Disconnect (joined cluster keeps running) or stop the local cluster we started; else nothing."""
    import ray

    if ctx.connected and ray.is_initialized():
        ray.shutdown()


def prestart_fork_server(cfg: RunConfig) -> None:
    """Start the fork server a local cluster's actors will fork from now, at the run's start: its
    imports (torch, transformers, the trainer's and engine's modules: seconds of CPU in its own
    process) then run beside the preflight on another core, not after Ray's start, when the engines
    and trainers wait for them. Nothing Ray: validation still comes first. Only where `init_ray`
    would start it: a local cluster this process starts (a joined one decides once joined)."""
    ray = sys.modules.get("ray")
    if resolve_ray_address(cfg) is None and not (ray is not None and ray.is_initialized()):
        start_fork_server(*_fork_extras(cfg))


def start_fork_server(*extras: str) -> None:
    """A local cluster's actors fork from one warm process (cluster/forkserver.py); not on a machine
    with an NVIDIA device (CUDA does not survive fork) or with MILES_FORK_WORKERS=0. `extras`:
    forkserver.EXTRAS the run needs ("peft", "megatron")."""
    import glob

    if not glob.glob("/dev/nvidia[0-9]*"):
        from miles_platform.cluster import forkserver

        forkserver.start(tuple(extras))


# ---------------------------------------------------------------------------- placement plan


@dataclass(frozen=True)
class RolePlacement:
    role: str
    num_bundles: int
    bundle: dict[str, float]
    strategy: str
    shared_with: str | None = None  # colocate: the role whose placement group this one reuses


def cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def rollout_num_devices(cfg: RunConfig) -> int:
    """Devices the rollout role needs in this Ray job (0 for attached external engines)."""
    actor_devices = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
    if cfg.rollout_external_engine_addrs:
        return 0
    if cfg.colocate:
        return actor_devices  # Miles: forced to the train world size
    n = cfg.rollout_num_gpus if cfg.rollout_num_gpus is not None else cfg.rollout_num_gpus_per_engine
    tp = cfg.rollout_num_gpus_per_engine
    if tp <= 0 or n <= 0 or n % tp:
        raise ConfigError(
            f"--rollout-num-gpus {n} must be a positive multiple of --rollout-num-gpus-per-engine {tp}"
        )
    return n


def plan_placement(cfg: RunConfig, use_gpu: bool, strategy: str = "PACK") -> dict[str, RolePlacement]:
    """Bundles per role, without touching Ray. `use_gpu=False` turns GPU bundles into CPU bundles."""
    if cfg.actor_num_nodes <= 0 or cfg.actor_num_gpus_per_node <= 0:
        raise ConfigError(
            f"--actor-num-nodes {cfg.actor_num_nodes} and --actor-num-gpus-per-node "
            f"{cfg.actor_num_gpus_per_node} must be positive"
        )
    if cfg.num_cpus_per_actor <= 0:
        raise ConfigError(f"--num-cpus-per-actor must be > 0, got {cfg.num_cpus_per_actor}")
    bundle = {"GPU": 1.0, "CPU": cfg.num_cpus_per_actor} if use_gpu else {"CPU": cfg.num_cpus_per_actor}
    n_actor = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
    n_rollout = rollout_num_devices(cfg)
    if cfg.colocate and cfg.rollout_num_gpus_per_engine > 0 and n_actor % cfg.rollout_num_gpus_per_engine:
        raise ConfigError(
            f"--colocate: train world size {n_actor} must be a multiple of "
            f"--rollout-num-gpus-per-engine {cfg.rollout_num_gpus_per_engine}"
        )
    plan = {"actor": RolePlacement("actor", n_actor, dict(bundle), strategy)}
    if cfg.colocate:
        plan["rollout"] = RolePlacement("rollout", n_actor, dict(bundle), strategy, shared_with="actor")
    else:
        plan["rollout"] = RolePlacement("rollout", n_rollout, dict(bundle), strategy)
    return plan


# ---------------------------------------------------------------------------- placement groups


def create_placement_groups(
    cfg: RunConfig,
    strategy: str = "PACK",
    use_gpu: bool | None = None,
    timeout_s: float = 60.0,
) -> dict[str, tuple[Any, list[int]]]:
    """role -> (placement group, bundle indices), Miles' shape. Waits until every group is ready.

    Bundle indices are ordered by node so consecutive ranks (and an engine's TP group) share a
    node. A role with no bundles (external engines) maps to `(None, [])`.
    """
    import ray
    from ray.util.placement_group import placement_group

    use_gpu = cluster_has_gpus() if use_gpu is None else use_gpu
    plan = plan_placement(cfg, use_gpu=use_gpu, strategy=strategy)
    out: dict[str, tuple[Any, list[int]]] = {}
    for role in ROLES:
        p = plan[role]
        if p.shared_with:
            out[role] = out[p.shared_with]
            continue
        if p.num_bundles == 0:
            out[role] = (None, [])
            continue
        pg = placement_group([dict(p.bundle) for _ in range(p.num_bundles)], strategy=p.strategy, name="")
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            ray.util.remove_placement_group(pg)
            raise ConfigError(
                f"placement group for {role!r} ({p.num_bundles} x {p.bundle}, {p.strategy}) not schedulable "
                f"within {timeout_s:.0f}s; cluster has {ray.cluster_resources()}. Lower --actor-num-gpus-per-node / "
                "--rollout-num-gpus or add nodes"
            )
        out[role] = (pg, bundle_indices_by_node(pg))
    return out


def bundle_indices_by_node(pg: Any) -> list[int]:
    """Bundle indices sorted by the node they were placed on (stable within a node)."""
    from ray.util.placement_group import placement_group_table

    nodes = placement_group_table(pg)["bundles_to_node_id"]
    return sorted(nodes, key=lambda i: (nodes[i], i))


def bundle_node_ids(pg: Any) -> dict[int, str]:
    from ray.util.placement_group import placement_group_table

    return dict(placement_group_table(pg)["bundles_to_node_id"])


def remove_placement_groups(groups: dict[str, tuple[Any, list[int]]]) -> None:
    import ray

    seen: set[Any] = set()
    for pg, _ in groups.values():
        if pg is not None and pg.id not in seen:
            seen.add(pg.id)
            ray.util.remove_placement_group(pg)


# ---------------------------------------------------------------------------- actors on bundles


def bundle_actor_options(
    pg: Any, bundle_index: int, share: float, bundle: dict[str, float], **extra: Any
) -> dict[str, Any]:
    """`.options(...)` for an actor taking `share` of one bundle's resources."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    opts: dict[str, Any] = {
        "num_cpus": share * bundle.get("CPU", 0.0),
        "num_gpus": share * bundle.get("GPU", 0.0),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg,
            placement_group_bundle_index=bundle_index,
            placement_group_capture_child_tasks=True,
        ),
    }
    opts.update(extra)
    if "runtime_env" in opts:  # a local CPU cluster: the actor's worker is forked warm
        from miles_platform.cluster import forkserver

        opts["runtime_env"] = forkserver.runtime_env(opts["runtime_env"])
    return opts


_REMOTE_CLASSES: dict[type, Any] = {}


def remote_class(cls: type) -> Any:
    """`ray.remote(cls)`, made once per process. Ray exports an actor class to the cluster the first
    time one of its actors is created and fingerprints it by disassembling every method (~0.2 s of
    the driver's CPU for the trainer's); a fresh `ray.remote` wrapper each run exported the class
    again on every run of a process (the Dagster op's, a test worker's). The wrapper re-exports by
    itself when the cluster or job changed."""
    import ray

    if cls not in _REMOTE_CLASSES:
        _REMOTE_CLASSES[cls] = ray.remote(cls)
    return _REMOTE_CLASSES[cls]


def create_role_actors(
    actor_cls: Any,
    cfg: RunConfig,
    groups: dict[str, tuple[Any, list[int]]],
    role: str,
    *args: Any,
    use_gpu: bool | None = None,
    options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """One actor per trainer rank ("actor") or per engine ("rollout"), pinned to its bundle.

    `actor_cls` is a plain class or an `@ray.remote` class. Engine i sits on the first bundle of
    its TP group. Each actor receives `rank=` as a keyword argument.
    """
    pg, indices = groups[role]
    if pg is None:
        return []
    use_gpu = cluster_has_gpus() if use_gpu is None else use_gpu
    bundle = plan_placement(cfg, use_gpu=use_gpu)[role].bundle
    remote_cls = actor_cls if hasattr(actor_cls, "remote") else remote_class(actor_cls)
    if role == "actor":
        slots, share = indices, ACTOR_SHARE[cfg.colocate]
    else:
        slots, share = indices[:: max(cfg.rollout_num_gpus_per_engine, 1)], ENGINE_SHARE
    return [
        remote_cls.options(**bundle_actor_options(pg, idx, share, bundle, **(options or {}))).remote(
            *args, rank=rank, **kwargs
        )
        for rank, idx in enumerate(slots)
    ]
