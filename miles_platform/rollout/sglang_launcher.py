"""SGLang rollout engines: launch `python -m sglang.launch_server` inside Ray actors, or attach
engines started elsewhere (`--rollout-external-engine-addrs`).

Command (Miles' convention): `--model-path` from `--hf-checkpoint`, `--tp-size` from
`--rollout-num-gpus-per-engine`, `--dtype` from `--rollout-dtype`, `--host` 127.0.0.1 unless
`--sglang-host`, a free `--port`, then every `--sglang-<flag> <value>` with the prefix stripped
(bool True -> bare flag, False/None -> omitted, list -> repeated values). A passthrough flag
replaces our default for the same flag.

The interpreter is `$MILES_SGLANG_PYTHON` when set, else ours: SGLang pins torch, transformers and
numba exactly, to versions other than ours, so it usually lives in a venv of its own (docs/engine.md).

Either way the rest of the platform sees a list of `EngineInfo` (address + `/get_server_info`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from miles_platform.cluster.devices import run_rollout_dtype
from miles_platform.cluster.ports import free_port
from miles_platform.config import ConfigError, RunConfig

SGLANG_MODULE = "sglang.launch_server"
# --rollout-dtype -> SGLang's --dtype; SGLang's own default ("auto") would serve the checkpoint's dtype
SGLANG_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_SGLANG_DTYPE_ALIASES = {"float": "float32", "half": "float16"}
SGLANG_PYTHON_ENV = "MILES_SGLANG_PYTHON"
# set per engine by the launcher; a passthrough for these would break placement / addressing
RESERVED_PASSTHROUGH = ("port", "base-gpu-id", "nnodes", "node-rank")


@dataclass
class EngineInfo:
    address: str  # host:port
    server_info: dict[str, Any] = field(default_factory=dict)
    external: bool = False

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def tp_size(self) -> int:
        return int(self.server_info.get("tp_size", 1))


# ---------------------------------------------------------------------------- command


def sglang_flags(sglang_args: dict[str, Any]) -> list[str]:
    """{"mem-fraction-static": "0.8", "enable-dp-attention": True} -> CLI flags (prefix already stripped)."""
    out: list[str] = []
    for key, value in sglang_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list | tuple):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def check_sglang_args(cfg: RunConfig) -> None:
    args = {k.replace("_", "-"): v for k, v in cfg.sglang_args.items()}
    for key in RESERVED_PASSTHROUGH:
        if key in args:
            raise ConfigError(f"--sglang-{key} is set per engine by the launcher; remove it")
    if "dtype" in args:
        given = _SGLANG_DTYPE_ALIASES.get(str(args["dtype"]), str(args["dtype"]))
        served = run_rollout_dtype(cfg)
        if given != SGLANG_DTYPES[served]:
            raise ConfigError(
                f"--sglang-dtype {args['dtype']} contradicts --rollout-dtype {served} "
                f"(SGLang --dtype {SGLANG_DTYPES[served]}); set --rollout-dtype only"
            )
    tp = int(args.get("tp-size", cfg.rollout_num_gpus_per_engine))
    sp = int(args.get("sp-degree", 1))
    if tp * sp != cfg.rollout_num_gpus_per_engine:
        raise ConfigError(
            f"--sglang-tp-size {tp} x --sglang-sp-degree {sp} must equal --rollout-num-gpus-per-engine "
            f"{cfg.rollout_num_gpus_per_engine}"
        )


def build_sglang_command(
    cfg: RunConfig,
    port: int,
    host: str = "127.0.0.1",
    base_gpu_id: int | None = None,
    python: str = sys.executable,
    module: str = SGLANG_MODULE,
    secret_dir: str | None = None,
) -> list[str]:
    """The argv of one engine. Our defaults first; passthrough flags replace same-named ones.

    The run's key never goes in argv (`ps` shows argv to every local user): it goes to SGLang in a
    0600 YAML file under `secret_dir` passed as `--config` (SGLang's ConfigArgumentMerger), merged
    with the user's own `--sglang-config` file when there is one.

    --moe-router-dtype maps to no SGLang argument, as in Miles (its sglang args never read
    moe_router_dtype): SGLang's routers compute as its model code does, in the served dtype, while
    the trainer's compute in fp32; the embedded engine instead routes in fp32 like the trainer."""
    if not cfg.hf_checkpoint:
        raise ConfigError("--rollout-engine sglang needs --hf-checkpoint (the model SGLang serves)")
    check_sglang_args(cfg)
    ours: dict[str, Any] = {
        "model-path": cfg.hf_checkpoint,
        "tp-size": cfg.rollout_num_gpus_per_engine,
        "dtype": SGLANG_DTYPES[run_rollout_dtype(cfg)],
        "host": host,
        "port": port,
        "enable-metrics": True,  # GET /metrics in Prometheus text, as the embedded engine's (rollout/metrics.py)
    }
    if base_gpu_id is not None:
        ours["base-gpu-id"] = base_gpu_id
    from miles_platform.cluster.colocation import offload_rollout_on

    if offload_rollout_on(cfg):  # /release_memory_occupation needs SGLang's torch_memory_saver
        ours["enable-memory-saver"] = True
    if cfg.syncs_lora_adapter:  # adapters loaded at run time (/load_lora_adapter)
        ours.update({"enable-lora": True, "max-lora-rank": cfg.lora_rank, "lora-target-modules": "all"})
    passthrough = {k.replace("_", "-"): v for k, v in cfg.sglang_args.items()}
    if "api-key" in passthrough:
        raise ConfigError("--sglang-api-key: the engines use the run's key (--api-key); pass that instead")
    merged = {**ours, **passthrough}
    if cfg.api_key:
        if secret_dir is None:
            raise ValueError("the run's key goes to SGLang in a file: build_sglang_command needs secret_dir")
        merged["config"] = write_secret_config(secret_dir, port, cfg.api_key, merged.get("config"))
    return [python, "-m", module, *sglang_flags(merged)]


def write_secret_config(secret_dir: str, port: int, api_key: str, user_config: str | None) -> str:
    """`api-key` (and the user's --sglang-config keys) in a fresh 0600 file, never through a link."""
    import yaml

    body: dict[str, Any] = {}
    if user_config:
        try:
            with open(user_config) as f:
                body = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"--sglang-config {user_config}: cannot read it as YAML ({e})") from e
        if not isinstance(body, dict):
            raise ConfigError(f"--sglang-config {user_config}: not a YAML mapping of SGLang flags")
    body["api-key"] = api_key
    path = os.path.join(secret_dir, f"engine_{port}.yaml")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    with os.fdopen(os.open(path, flags, 0o600), "w") as f:
        os.fchmod(f.fileno(), 0o600)
        yaml.safe_dump(body, f)
    return path


def sglang_python() -> str:
    """The interpreter that runs `-m sglang.launch_server`: $MILES_SGLANG_PYTHON, else this one."""
    return os.environ.get(SGLANG_PYTHON_ENV) or sys.executable


# ---------------------------------------------------------------------------- HTTP probes


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def probe_engine(address: str, api_key: str | None = None, timeout_s: float = 5.0) -> EngineInfo:
    """`GET /health` then `GET /get_server_info`; raises ConfigError naming the address on failure."""
    import httpx

    from miles_platform.tls import client_tls

    url = f"http://{address}"
    try:
        with httpx.Client(timeout=timeout_s, headers=_headers(api_key), verify=client_tls()) as client:
            health = client.get(f"{url}/health")
            health.raise_for_status()
            info = client.get(f"{url}/get_server_info")
            info.raise_for_status()
            return EngineInfo(address=address, server_info=info.json())
    except (httpx.HTTPError, ValueError) as e:
        raise ConfigError(
            f"engine {address}: not reachable or unhealthy ({type(e).__name__}: {e}); "
            "check the address in --rollout-external-engine-addrs and that the server is up"
        ) from e


def wait_healthy(
    address: str, proc: subprocess.Popen | None, api_key: str | None, timeout_s: float
) -> EngineInfo:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"engine {address} exited with code {proc.returncode} before becoming healthy")
        try:
            return probe_engine(address, api_key, timeout_s=2.0)
        except ConfigError as e:
            last = e
            time.sleep(0.5)
    raise TimeoutError(f"engine {address} not healthy within {timeout_s:.0f}s: {last}")


# ---------------------------------------------------------------------------- external attach


def attach_external_engines(cfg: RunConfig, timeout_s: float = 5.0) -> list[EngineInfo]:
    """Validate every `--rollout-external-engine-addrs` entry and read its topology."""
    engines = []
    for addr in cfg.rollout_external_engine_addrs:
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--rollout-external-engine-addrs: {addr!r} is not host:port")
        info = probe_engine(addr, cfg.api_key, timeout_s=timeout_s)
        info.external = True
        tp = info.server_info.get("tp_size")
        if tp is not None and int(tp) != cfg.rollout_num_gpus_per_engine:
            raise ConfigError(
                f"engine {addr} reports tp_size={tp} but --rollout-num-gpus-per-engine is "
                f"{cfg.rollout_num_gpus_per_engine}; set it to match the attached fleet"
            )
        engines.append(info)
    return engines


# ---------------------------------------------------------------------------- Ray actor


class SGLangEngineActor:
    """Owns one SGLang server process on the node (and GPUs) of its placement bundle."""

    def __init__(self, cfg: RunConfig, rank: int = 0, module: str = SGLANG_MODULE, env: dict | None = None):
        self.cfg, self.rank, self.module, self.env = cfg, rank, module, env or {}
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None
        self.command: list[str] = []
        self.log_path: str | None = None

    def start(self, timeout_s: float = 600.0) -> dict[str, Any]:
        import ray

        host = str(self.cfg.sglang_args.get("host", "127.0.0.1"))
        port = free_port(host)
        gpu_ids = ray.get_gpu_ids()
        base_gpu_id = int(gpu_ids[0]) if gpu_ids else None
        # a private dir (0700, a fresh name) and 0600 files that are never a symlink: under a fixed
        # /tmp/miles_sglang another local user could pre-create the dir or a link and redirect it
        log_dir = os.environ.get("MILES_SGLANG_LOG_DIR") or tempfile.mkdtemp(prefix="miles_sglang_")
        os.makedirs(log_dir, mode=0o700, exist_ok=True)
        self.command = build_sglang_command(
            self.cfg,
            port=port,
            host=host,
            base_gpu_id=base_gpu_id,
            python=sglang_python(),
            module=self.module,
            secret_dir=log_dir,
        )
        self.address = f"{host}:{port}"
        self.log_path = os.path.join(log_dir, f"engine_{self.rank}_{port}.log")
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
        log = os.fdopen(os.open(self.log_path, flags, 0o600), "ab")
        # log-probs of the distribution sampled from, log_softmax(z / T): what the trainer scores
        # (docs/algorithms.md); forced, as Miles forces it, so an inherited =1 cannot change the objective
        env = {**os.environ, **self.env, "SGLANG_RETURN_ORIGINAL_LOGPROB": "0"}
        self.proc = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        info = wait_healthy(self.address, self.proc, self.cfg.api_key, timeout_s)
        return {"address": info.address, "server_info": info.server_info, "command": self.command,
                "log_path": self.log_path}  # fmt: skip

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
        return self.proc.returncode

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def launch_sglang_engines(
    cfg: RunConfig,
    groups: dict[str, tuple[Any, list[int]]],
    module: str = SGLANG_MODULE,
    env: dict | None = None,
    timeout_s: float = 600.0,
    use_gpu: bool | None = None,
) -> tuple[list[Any], list[EngineInfo]]:
    """One `SGLangEngineActor` per engine on the rollout placement group; waits until all are healthy.

    On GPU the actor keeps Ray from narrowing CUDA_VISIBLE_DEVICES so SGLang sees its TP group's
    devices from `--base-gpu-id` on (as Miles does). Returns (actors, engines).
    """
    import ray

    from miles_platform.cluster.ray_cluster import create_role_actors

    check_sglang_args(cfg)
    env_vars = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    if os.environ.get(SGLANG_PYTHON_ENV):  # the driver's choice reaches actors on any node
        env_vars[SGLANG_PYTHON_ENV] = os.environ[SGLANG_PYTHON_ENV]
    options = {"runtime_env": {"env_vars": env_vars}}
    actors = create_role_actors(
        SGLangEngineActor,
        cfg,
        groups,
        "rollout",
        cfg,
        module=module,
        env=env,
        use_gpu=use_gpu,
        options=options,
    )
    started = ray.get([a.start.remote(timeout_s) for a in actors])
    return actors, [EngineInfo(address=s["address"], server_info=s["server_info"]) for s in started]


def rollout_engines(cfg: RunConfig, groups: dict[str, tuple[Any, list[int]]] | None = None, **kw: Any):
    """The loop's entry point: attach external engines if given, else launch SGLang in Ray."""
    if cfg.rollout_external_engine_addrs:
        return [], attach_external_engines(cfg)
    if cfg.rollout_engine != "sglang":
        raise ConfigError(f"rollout_engines() is for --rollout-engine sglang, got {cfg.rollout_engine!r}")
    if groups is None:
        raise ConfigError("launching SGLang engines needs placement groups (create_placement_groups(cfg))")
    return launch_sglang_engines(cfg, groups, **kw)
