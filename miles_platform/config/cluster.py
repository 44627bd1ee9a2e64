"""Where a run's processes run: Ray, trainer ranks, rollout engines, the router, fault tolerance,
the embedded engines' pause bounds, the run secret and the rollout-data object store."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from miles_platform.config.flags import NON_NEGATIVE, POSITIVE, changed_flags, flag, json_flag
from miles_platform.errors import ConfigError

RANGES: dict[str, tuple] = {
    **dict.fromkeys(
        (
            "actor_num_nodes",
            "actor_num_gpus_per_node",
            "rollout_num_gpus_per_engine",
            "distributed_timeout_minutes",
        ),
        POSITIVE,
    ),
    **dict.fromkeys(("rollout_num_gpus", "num_cpus_per_actor"), NON_NEGATIVE),
    "rollout_health_check_interval": (0, None, True, "> 0 (seconds)"),
    "rollout_health_check_timeout": (0, None, True, "> 0 (seconds)"),
    "rollout_health_check_first_wait": (0, None, False, ">= 0 (seconds)"),
    "pause_wait_timeout_s": (0, None, True, "> 0 (seconds)"),
    "pause_max_queued_requests": POSITIVE,
}


@dataclass
class ClusterFlags:
    ray_address: str | None = flag(
        None, "cluster", "join an existing Ray cluster (else RAY_ADDRESS, else start a local one)"
    )
    actor_num_nodes: int = flag(1, "cluster", "nodes for actor training")
    actor_num_gpus_per_node: int = flag(
        1, "cluster", "trainer ranks per node (GPUs on GPU, CPU gloo ranks on CPU; Miles default 8)"
    )
    rollout_num_gpus: int | None = flag(
        None, "cluster", "devices for rollout engines (derived; ignored with --colocate)"
    )
    rollout_num_gpus_per_engine: int = flag(1, "cluster", "TP size of each engine")
    colocate: bool = flag(False, "cluster", "share devices between actor and rollout")
    # --- devices and colocation (issue #46; Miles' names; docs/scale_out.md "Devices and colocation").
    # Each process computes on its own device (cluster/devices.py): a trainer rank and an embedded
    # engine on the GPU Ray gave them, else the CPU. --colocate turns both offloads on, as in Miles.
    offload_train: bool | None = flag(
        None, "cluster",
        "park the trainer's model and optimizer state in host memory while the engines generate "
        "(default: on with --colocate, else off; --no-offload-train keeps them on the device)",
    )  # fmt: skip
    offload_rollout: bool | None = flag(
        None, "cluster",
        "engines release their memory (/release_memory_occupation) while the trainer trains and resume "
        "it (/resume_memory_occupation) for the weight update (default: on with --colocate, else off)",
    )  # fmt: skip
    offload_rollout_level: list[str] = flag(
        ["kv_cache", "weight"], "cluster", "what --offload-rollout releases", choices=("kv_cache", "weight"),
        nargs="+",
    )  # fmt: skip
    # --- end of the devices and colocation block ---
    num_cpus_per_actor: float = flag(1.0, "cluster", "Ray CPUs reserved per trainer rank / engine on CPU")
    pin_trainer_cpus: bool = flag(
        False, "cluster",
        "CPU-only local runs: each trainer rank on cores of its own (its MILES_TRAIN_THREADS), the engines "
        "and the driver on the others, so that generation and the driver's work never preempt a train "
        "step (train-async / --fully-async on a few cores; cluster/cpu_pinning.py)",
    )  # fmt: skip
    rollout_engine: str = flag("embedded", "cluster", "rollout engine kind", choices=("embedded", "sglang"))
    rollout_external_engine_addrs: list[str] = flag(
        [], "cluster", "attach engines started elsewhere (host:port ...)", nargs="*"
    )
    sglang_router_port: int | None = flag(None, "cluster", "pin the router port (else a free one)")
    use_fault_tolerance: bool = flag(
        False,
        "cluster",
        "health-check every engine (/health_generate); one that fails or hangs is killed, restarted on "
        "its bundle, loaded with the current version and put back behind the router",
    )
    rollout_health_check_interval: float = flag(30.0, "cluster", "seconds between engine health checks")
    rollout_health_check_timeout: float = flag(
        30.0, "cluster", "seconds an engine has to answer a health check before it is replaced"
    )
    rollout_health_check_first_wait: float = flag(
        0.0, "cluster", "grace period in seconds before the first health check"
    )
    # defaults: rollout.engine_core.DEFAULT_PAUSE_* (not imported here: it loads torch)
    pause_wait_timeout_s: float = flag(
        600.0, "cluster", "embedded engines: a request /pause_generation holds longer than this gets 503"
    )
    pause_max_queued_requests: int = flag(
        16384, "cluster", "embedded engines: while paused, a request beyond this many queued gets 503 at once"
    )
    api_key: str | None = flag(
        None,
        "cluster",
        "bearer token for engines, router and weight updates (default: $MILES_API_KEY, "
        "--api-key-file, else a fresh secret per run)",
    )
    api_key_file: str | None = flag(None, "cluster", "read --api-key from this file (keeps it out of argv)")
    allow_config_change: bool = flag(
        False, "checkpoint", "resume a run whose saved config differs in what is trained (logged)"
    )
    distributed_timeout_minutes: int = flag(
        30, "cluster", "how long the trainer ranks' process group waits for a rank (Miles' default: 10)"
    )
    train_env_vars: str | None = flag(
        None,
        "cluster",
        'JSON object of environment variables for the trainer processes, e.g. {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}',
    )
    object_store_backend: str = flag("ray", "cluster", "rollout data handoff", choices=("ray", "mooncake"))
    mooncake_store_init_kwargs: str | None = flag(
        None, "cluster", "JSON kwargs for the Mooncake store (env fallbacks apply)"
    )

    def _check_cluster_flags(self) -> None:
        """--use-fault-tolerance restarts embedded engines only; the pause bounds are the embedded engine's;
        a --fully-async run cannot give its engines' devices away."""
        self.train_env()
        self._check_fault_tolerance()
        if self.fully_async and (self.colocate or self.offload_train or self.offload_rollout):
            raise ConfigError(
                "--fully-async keeps the engines generating while the trainer trains: it cannot share their "
                "devices (--colocate) or take their memory away (--offload-train / --offload-rollout)"
            )
        pause = changed_flags(self, ("pause_wait_timeout_s", "pause_max_queued_requests"))
        if pause and not self.embedded_engines_only:
            raise ConfigError(f"{', '.join(pause)}: bounds of the embedded engine's pause (SGLang has "
                              "none); use --rollout-engine embedded or drop the flag")  # fmt: skip

    def _check_fault_tolerance(self) -> None:
        if not self.use_fault_tolerance:
            return
        why = None
        if self.debug_train_only:
            why = "--debug-train-only starts no engines"
        elif not self.embedded_engines_only:
            why = "restarting an SGLang or external engine is not built (embedded engines only)"
        elif self.uses_lora:
            why = "a restarted engine would need the run's adapters re-loaded (not built)"
        if why:
            raise ConfigError(f"--use-fault-tolerance: {why}")

    def train_env(self) -> dict[str, str]:
        """--train-env-vars as a {name: value} dict (empty when unset)."""
        if not self.train_env_vars:
            return {}
        env = json_flag(self.train_env_vars, "--train-env-vars", dict, "a JSON object of strings")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ConfigError(f"--train-env-vars {self.train_env_vars!r}: expected a JSON object of strings")
        return env

    @property
    def embedded_engines_only(self) -> bool:
        """Every rollout engine is an embedded one the run starts: no SGLang, none attached by address."""
        return self.rollout_engine == "embedded" and not self.rollout_external_engine_addrs

    def resolve_api_key(self) -> str:
        """The run's secret, set on `api_key`: --api-key, else --api-key-file, else $MILES_API_KEY,
        else a fresh random one. Every engine, router and weight-update call of the run carries it."""
        if self.api_key and self.api_key_file:
            raise ConfigError("--api-key and --api-key-file: give one")
        if self.api_key_file:
            try:
                key = Path(self.api_key_file).read_text().strip()
            except OSError as e:
                raise ConfigError(
                    f"--api-key-file {self.api_key_file}: cannot read it ({e.strerror})"
                ) from None
            if not key:
                raise ConfigError(f"--api-key-file {self.api_key_file}: the file is empty")
            self.api_key = key
        elif not self.api_key:
            self.api_key = os.environ.get("MILES_API_KEY") or secrets.token_urlsafe(32)
        return self.api_key
