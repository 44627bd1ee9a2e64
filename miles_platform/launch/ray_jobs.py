"""Runs as Ray jobs: `miles-platform train --submit ADDRESS`, and the `rl_training` op's
`launcher: ray_job`, through Ray's Job Submission API (the dashboard's HTTP address, :8265).

A submitted run is the same run as a local one. The submitter validates the config first (a
mistake costs a second and submits nothing), makes its local paths absolute, and submits the
entrypoint `python -m miles_platform.launch.job_driver` with the RunConfig as JSON in the job's
runtime env (MILES_RUN_CONFIG). On the cluster that driver joins through the RAY_ADDRESS the job
supervisor sets and trains exactly as `train` does, printing its log lines (and, under Dagster,
Pipes messages) to the job's log. The job belongs to the cluster: closing the terminal or killing
the Dagster run worker does not stop it; Ctrl-C on `--submit` and cancelling the Dagster run do.

One job per run: its submission id is `miles-<run>-<n>` and its metadata carries the run name,
storage root and config hash, so launching a run that has a live job attaches to that job (its
logs, its end) instead of starting a second writer; a live job of the same run with another
config is an error naming it. A finished job's run launched again is a new job (`-<n+1>`) that
resumes from the run's last checkpoint.

The cluster's `python` must have miles-platform installed (the image of deploy/, or the venv a
loopback `ray start` was run from); the storage root and the checkpoint / dataset paths must be
reachable from the cluster (a shared filesystem or an fsspec URI). `--submit-runtime-env-json`
adds Ray runtime-env fields (env_vars, working_dir, py_modules, ...) to the job.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles_platform.config import ConfigError, RunConfig
from miles_platform.config.flags import json_flag

CONFIG_ENV = "MILES_RUN_CONFIG"
# `exec`: the driver is the process Ray's job supervisor started. Ray runs the entrypoint with
# `sh -c`, and dash forks a plain command: a stop that came while the job started (a Dagster run
# cancelled as it submitted) listed the shell's children before python was forked, killed only the
# shell, and left the driver training, orphaned, while the job read STOPPED (measured: 87 versions
# written after the stop; tests/e2e/test_cluster_ray.py's cancel case)
ENTRYPOINT = "exec python -m miles_platform.launch.job_driver"
META_RUN, META_ROOT, META_HASH = "miles_run", "miles_storage_root", "miles_config_hash"
ACTIVE = ("PENDING", "RUNNING")
# RunConfig fields that name local files or dirs: made absolute before submitting (the job's working
# directory is a Ray session dir, not the submitter's)
PATH_FIELDS = (
    "storage_root", "hf_checkpoint", "ref_load", "load", "save", "prompt_data", "api_key_file",
    "opd_teacher_load", "opd_teacher_hf_checkpoint", "update_weight_disk_dir",
    "update_weight_local_checkpoint_dir", "lora_adapter_path", "wandb_dir", "tensorboard_dir",
    "save_debug_rollout_data", "load_debug_rollout_data",
)  # fmt: skip


# ---------------------------------------------------------------------------- launch options


@dataclass
class LaunchOptions:
    """The flags of `train` that say where a run runs, not what it trains (not in RunConfig)."""

    submit: str | None = None  # Ray Jobs address; None = run here
    no_wait: bool = False
    runtime_env: dict[str, Any] = field(default_factory=dict)


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("launcher arguments (where the run runs; not part of the run's config)")
    g.add_argument(
        "--submit", nargs="?", const="auto", default=None, metavar="ADDRESS",
        help="submit the run to a Ray cluster as a Ray job instead of running it here: the Ray Jobs "
        "(dashboard) address, e.g. http://127.0.0.1:8265; bare --submit reads $RAY_API_SERVER_ADDRESS, "
        "then $RAY_ADDRESS. Logs stream here; Ctrl-C stops the job",
    )  # fmt: skip
    g.add_argument(
        "--no-wait", action="store_true", help="with --submit: print the job id and return at once"
    )
    g.add_argument(
        "--submit-runtime-env-json", default=None, metavar="JSON",
        help="with --submit: Ray runtime-env fields for the job, e.g. "
        '\'{"env_vars": {"HF_HOME": "/data/hf"}, "working_dir": "."}\'',
    )  # fmt: skip


def split_launch_flags(argv: list[str]) -> tuple[LaunchOptions, list[str]]:
    """(launch options, the rest of argv for parse_run_config). Bad launcher values: ConfigError."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_launch_flags(parser)
    ns, rest = parser.parse_known_args(argv)
    if (ns.no_wait or ns.submit_runtime_env_json) and ns.submit is None:
        raise ConfigError("--no-wait / --submit-runtime-env-json only apply with --submit")
    return LaunchOptions(ns.submit, ns.no_wait, parse_runtime_env(ns.submit_runtime_env_json)), rest


def parse_runtime_env(text: str | None, flag: str = "--submit-runtime-env-json") -> dict[str, Any]:
    if not text:
        return {}
    env = json_flag(text, flag, dict, "a JSON object of runtime-env fields")
    if CONFIG_ENV in (env.get("env_vars") or {}):
        raise ConfigError(f"{flag}: env_vars.{CONFIG_ENV} is the run's config; set flags instead")
    return env


def resolve_job_address(address: str | None, flag: str = "--submit") -> str:
    """The Ray Jobs HTTP address: the flag, else $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS."""
    addr = None if address in (None, "", "auto") else address
    addr = addr or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")
    if not addr:
        raise ConfigError(
            f"{flag}: no Ray Jobs address; pass the dashboard's address (http://<head>:8265) or set "
            "RAY_API_SERVER_ADDRESS"
        )
    if not addr.startswith(("http://", "https://")):
        raise ConfigError(
            f"{flag} {addr}: expected the Ray dashboard's HTTP address (http://<head>:8265), not a GCS "
            "or ray:// client address (that is --ray-address, for runs that join a cluster from here)"
        )
    return addr.rstrip("/")


# ---------------------------------------------------------------------------- submit / attach


def job_client(address: str):
    """A JobSubmissionClient that sends this user's Ray token when one exists (Ray's token auth,
    on by default: the dashboard refuses requests without it)."""
    from ray.job_submission import JobSubmissionClient

    if os.environ.get("RAY_AUTH_MODE", "").lower() != "disabled" and _have_token():
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()  # RAY_AUTH_MODE=token for this process; Ray then reads the token
    try:
        return JobSubmissionClient(address)
    except (ConnectionError, RuntimeError) as e:
        raise ConfigError(f"Ray Jobs address {address}: cannot reach the dashboard ({e})") from None


def _have_token() -> bool:
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or os.path.isfile(path)


def submittable_config(cfg: RunConfig, api_key: str | None = None) -> RunConfig:
    """A copy with local paths absolute (URIs and absolute paths unchanged), a remote storage root
    without a trailing `/`, and `api_key` as the user gave it (`--api-key`, else None): never the
    key validation resolved from `--api-key-file` / $MILES_API_KEY or generated, which would sit in
    the job's runtime env for anyone who can list jobs; the driver resolves its own."""
    data = cfg.to_dict()
    data["api_key"] = api_key
    if "://" in (data.get("storage_root") or ""):
        data["storage_root"] = data["storage_root"].rstrip("/")
    for name in PATH_FIELDS:
        v = data.get(name)
        if isinstance(v, str) and v and "://" not in v:
            data[name] = os.path.abspath(os.path.expanduser(v))
    pairs = list(data.get("eval_prompt_data") or [])
    for i in range(1, len(pairs), 2):
        if "://" not in pairs[i]:
            pairs[i] = os.path.abspath(os.path.expanduser(pairs[i]))
    data["eval_prompt_data"] = pairs
    return RunConfig.from_dict(data)


def run_jobs(client, run: str, storage_root: str, jobs: list | None = None) -> list:
    """This run's jobs on the cluster (JobDetails), oldest first."""
    jobs = [
        j for j in (client.list_jobs() if jobs is None else jobs)
        if (j.metadata or {}).get(META_RUN) == run and (j.metadata or {}).get(META_ROOT) == storage_root
    ]  # fmt: skip
    return sorted(jobs, key=lambda j: j.start_time or 0)


@dataclass
class Launched:
    job_id: str
    attached: bool  # an already running job of the run; nothing was submitted


def submit_or_attach(
    client,
    cfg: RunConfig,
    *,
    runtime_env: dict[str, Any] | None = None,
    env_vars: dict[str, str] | None = None,
    metadata: dict[str, str] | None = None,
    api_key: str | None = None,
) -> Launched:
    """Attach to the run's live job, or submit a new one. `cfg` must be validated already;
    `api_key`: the one the user gave (see submittable_config)."""
    cfg = submittable_config(cfg, api_key)
    all_jobs = client.list_jobs()
    jobs = run_jobs(client, cfg.run_name, cfg.storage_root, all_jobs)
    live = [j for j in jobs if j.status in ACTIVE]  # JobStatus is a str enum
    if live:
        job = live[-1]
        if (job.metadata or {}).get(META_HASH) != cfg.config_hash():
            raise ConfigError(
                f"run {cfg.run_name!r} is already running as Ray job {job.submission_id} with another "
                f"config; stop it (`ray job stop {job.submission_id}`) or launch under another --run-name"
            )
        return Launched(job.submission_id, attached=True)
    env = dict(runtime_env or {})
    env_vars = {**(env.get("env_vars") or {}), **(env_vars or {})}
    env_vars[CONFIG_ENV] = json.dumps(cfg.to_dict(), sort_keys=True)
    env["env_vars"] = env_vars
    meta = {
        **(metadata or {}),
        META_RUN: cfg.run_name,
        META_ROOT: cfg.storage_root,
        META_HASH: cfg.config_hash(),
    }
    taken = {j.submission_id for j in all_jobs}  # every job's: the same run name under another root
    n = len(jobs) + 1
    while f"miles-{cfg.run_name}-{n}" in taken:
        n += 1
    try:
        job_id = client.submit_job(
            entrypoint=ENTRYPOINT,
            submission_id=f"miles-{cfg.run_name}-{n}",
            runtime_env=env,
            metadata={k: str(v) for k, v in meta.items()},
            entrypoint_num_cpus=0,  # the driver only coordinates; trainer and engines are its actors
        )
    except RuntimeError as e:  # another launcher of this run submitted that id just now
        if "already exists" not in str(e):
            raise
        live = [j for j in run_jobs(client, cfg.run_name, cfg.storage_root) if j.status in ACTIVE]
        if not live:
            raise ConfigError(
                f"run {cfg.run_name!r}: Ray job id miles-{cfg.run_name}-{n} is taken ({e})"
            ) from None
        return Launched(live[-1].submission_id, attached=True)
    return Launched(job_id, attached=False)


def wait_for_job(client, job_id: str, poll_s: float = 2.0, on_poll: Callable[[], None] | None = None) -> str:
    """Block until the job ends; returns its status name. `on_poll` runs on every poll."""
    while True:
        status = client.get_job_status(job_id)
        if on_poll is not None:
            on_poll()
        if status.is_terminal():
            return status.value
        time.sleep(poll_s)


RESTOP_S = 2.0  # Ctrl-C's stop request is repeated this often until the job ends


def stop_job(client, job_id: str, timeout_s: float = 60.0) -> str:
    """Stop the job and wait (bounded) for it to end; returns its last status name.

    The stop is asked again every `RESTOP_S` until the job ends: Ray's stop is fire-and-forget and
    answers False (doing nothing) while the job's supervisor is not up yet, e.g. a job still setting
    up its runtime env when Ctrl-C came."""
    deadline = time.monotonic() + timeout_s
    asked = -RESTOP_S
    while True:
        if time.monotonic() - asked >= RESTOP_S:
            client.stop_job(job_id)
            asked = time.monotonic()
        status = client.get_job_status(job_id)
        if status.is_terminal() or time.monotonic() > deadline:
            return status.value
        time.sleep(0.5)


def stream_logs(client, job_id: str, out=None) -> threading.Thread:
    """Copy the job's log to `out` (stdout) until the job ends, in a daemon thread: the main thread
    keeps Ctrl-C (a SIGINT inside asyncio.run waits for the log websocket to close, which can take
    minutes on a loaded head)."""
    out = out or sys.stdout

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()

    def run() -> None:
        with contextlib.suppress(Exception):  # the status poll, not the log, decides the outcome
            asyncio.run(tail())

    thread = threading.Thread(target=run, name=f"logs-{job_id}", daemon=True)
    thread.start()
    return thread


EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 130}
# the driver's exit codes that a retry would only repeat: a config error (incl. another writer of
# the run) and a --ci-test failure; an actor that died or an unexpected error may pass on a retry
FINAL_EXIT_CODES = (2, 3)


def submit_cli(cfg: RunConfig, opts: LaunchOptions) -> int:
    """`train --submit`: submit (or attach), stream the log, stop the job on Ctrl-C."""
    from miles_platform.preflight import validate_before_start

    address = resolve_job_address(opts.submit)
    given_key = cfg.api_key
    validate_before_start(cfg)  # the user's mistake fails here, before anything is submitted
    client = job_client(address)
    launched = submit_or_attach(client, cfg, runtime_env=opts.runtime_env, api_key=given_key)
    verb = "attached to the running" if launched.attached else "submitted"
    try:  # from here on, Ctrl-C stops the job
        print(
            f"miles-platform train: {verb} Ray job {launched.job_id} at {address}",
            file=sys.stderr,
            flush=True,
        )
        if opts.no_wait:
            print(json.dumps({"job_id": launched.job_id, "address": address, "attached": launched.attached}))
            return 0
        logs = stream_logs(client, launched.job_id)
        status = wait_for_job(client, launched.job_id, poll_s=0.5)
        logs.join(timeout=10)  # the log's tail after the job ended
    except KeyboardInterrupt:
        print(f"\nmiles-platform train: stopping Ray job {launched.job_id}", file=sys.stderr, flush=True)
        status = stop_job(client, launched.job_id)
    info = client.get_job_info(launched.job_id)
    print(f"miles-platform train: Ray job {launched.job_id} {status}: {info.message or ''}".rstrip(": "),
          file=sys.stderr)  # fmt: skip
    return EXIT_CODES.get(status, 1)
