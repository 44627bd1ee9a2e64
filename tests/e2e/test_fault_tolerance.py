"""--use-fault-tolerance: an engine that dies (SIGKILL) or hangs (SIGSTOP) mid-run (--ci-fault-hooks
aimed at the engine) is detected by the health monitor, replaced on its bundle with the version the run serves, and the run finishes
with every rollout, the trainer and engine weights equal at each update (--ci-test)."""

import contextlib
import json
import os
import signal

import pytest
from loop_helpers import small_run_config, small_run_kwargs

from miles_platform.config import ConfigError, RunConfig
from miles_platform.errors import ActorDied
from miles_platform.loop import RLRun
from miles_platform.run_types import Reporter
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(rollout_engine="sglang"), "embedded engines only"),
        (dict(rollout_external_engine_addrs=["127.0.0.1:1"]), "embedded engines only"),
        (dict(lora_rank=8), "adapters"),
        (dict(rollout_health_check_interval=0.0), "--rollout-health-check-interval 0.0: must be > 0"),
        (dict(rollout_health_check_timeout=float("nan")), "--rollout-health-check-timeout nan"),
        (dict(rollout_health_check_first_wait=-1.0), "--rollout-health-check-first-wait -1.0: must be >= 0"),
    ],
)
def test_fault_tolerance_refuses_what_it_cannot_restart(tiny_hf_checkpoint, tmp_path, kw, needle):
    cfg = RunConfig(**small_run_kwargs(tiny_hf_checkpoint, tmp_path, use_fault_tolerance=True, **kw))
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert needle in str(e.value)


def _engine_pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


class Logs(Reporter):
    def __init__(self):
        self.logs = []
        self.victims_dead_when_replaced: list[bool] = []

    def log(self, msg: str) -> None:
        self.logs.append(msg)
        if msg.startswith("[fault-tolerance] engine 0 replaced by"):  # the victim is gone by now
            self.victims_dead_when_replaced.append(not _alive(_victims(self.logs)[-1]))

    def on_rollout(self, rollout_id, metrics):
        self.last = metrics
        self.retries = [*getattr(self, "retries", []), metrics["rollout/generate_retries"]]


# --ci-fault-hooks on the engine: SIGKILL once rollout 0 is recorded (v1 loaded), SIGSTOP of its
# replacement once rollout 2 is
FAULTS = [
    {"request_id": "kill-engine", "hook_name": "metrics_recorded", "action": {"kind": "kill_process"},
     "rollout_id": 0, "target": {"engine": 0}},
    {"request_id": "hang-engine", "hook_name": "metrics_recorded", "action": {"kind": "stop_process"},
     "rollout_id": 2, "target": {"engine": 0}},
]  # fmt: skip


# mooncake's replacement reads the store like any engine (its transport: test_loop.py's mooncake
# handoff), no path of its own here: `make test-extended`, for `make test`'s 10-minute budget
@pytest.mark.parametrize(
    "transport", ["tensor", "disk-delta", "broadcast", pytest.param("mooncake", marks=pytest.mark.extended)]
)
def test_a_killed_and_a_hung_engine_are_replaced_and_the_run_finishes(
    tiny_hf_checkpoint, tmp_path, transport, request, monkeypatch
):
    # disk-delta: the engine-local dirs live with the driver, so a replacement loads the served
    # version's export and the next publication patches its dir from there; broadcast: the group
    # with the dead rank is dropped and every rank joins a fresh one at the next update; mooncake:
    # the replacement reads the store like any engine
    kw = {"tensor": {}, "broadcast": dict(update_weight_transfer_mode="broadcast")}.get(transport)
    if transport == "disk-delta":
        kw = dict(update_weight_transfer_mode="disk-delta", update_weight_disk_dir=str(tmp_path / "pub"))
    if transport == "mooncake":
        master = request.getfixturevalue("mooncake_master")
        monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
        flag = json.dumps({"protocol": "tcp", "master_server_address": master, "local_hostname": "127.0.0.1",
                           "global_segment_size": "64mb", "local_buffer_size": "64mb"})  # fmt: skip
        kw = dict(update_weight_transfer_mode="mooncake", mooncake_store_init_kwargs=flag)
    cfg = small_run_config(
        tiny_hf_checkpoint, tmp_path, num_rollout=4, use_fault_tolerance=True, ci_test=True,
        rollout_health_check_interval=0.3, rollout_health_check_timeout=2.0,
        check_weight_update_equal=transport != "tensor", ci_fault_hooks=json.dumps(FAULTS), **kw,
    )  # fmt: skip
    rep = Logs()
    try:
        res = RLRun(cfg, rep).run()
    finally:
        victims = _victims(rep.logs)
        for pid in victims:  # never leave a stopped process behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert len(victims) == 2 and victims[0] != victims[1], rep.logs  # the second: the replacement
    # the hung (SIGSTOPped) engine was SIGKILLed before its replacement started, so its requests
    # failed over at once (ray.kill alone force-kills a process that cannot answer only after 5 s)
    assert rep.victims_dead_when_replaced == [True, True], rep.logs
    assert [v["version"] for v in res.versions] == [1, 2, 3, 4]
    said = [m for m in rep.logs if m.startswith("[fault-tolerance]")]
    assert rep.last["rollout/engine_restarts"] == 2.0, said
    said = [m for m in rep.logs if m.startswith("[fault-tolerance]")]
    assert any("is unreachable" in m for m in said) and any(
        "did not answer /health_generate" in m for m in said
    )
    assert sum("replaced by" in m for m in said) == 2
    # the requests the dead engine failed were retried (on the replacement), and counted (measured:
    # [0, 5, 0, 1] on every transport on a quiet machine); the hung one's at rollout 3 only when its
    # requests reach it before the health check replaces it (2 s): under load the phases between its
    # stop and rollout 3 can take longer (a full make test run: [0, 6, 0, 0]), and then none fail
    assert rep.retries[0] == 0 and rep.retries[1] > 0 and rep.retries[2] == 0, rep.retries
    # the replacements served the run's current version, not --hf-checkpoint: rollout 1 was
    # generated by v1 (killed after v1 was loaded), rollout 3 by v3
    _, rows = Catalog(StoragePaths(cfg.storage_root)).query(
        "select rollout_id, min(weight_version_start), max(weight_version_end) from rollouts group by 1 order by 1"
    )
    assert rows == [(0, 0, 0), (1, 1, 1), (2, 2, 2), (3, 3, 3)]


def _victims(logs: list[str]) -> list[int]:
    return [int(m.rsplit("pid ", 1)[1].rstrip(")")) for m in logs if ": engine 0 (" in m]


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class TrainerKiller(Reporter):
    def __init__(self):
        self.runner = None

    def on_rollout(self, rollout_id, metrics):
        if rollout_id == 0:
            os.kill(_engine_pid(self.runner.s.trainers[0]), signal.SIGKILL)


def test_a_dead_trainer_stops_the_run_with_the_actor_and_the_resume_command(tiny_hf_checkpoint, tmp_path):
    cfg = small_run_config(
        tiny_hf_checkpoint, tmp_path, num_rollout=3, save=str(tmp_path / "ckpt"), save_interval=1
    )
    rep = TrainerKiller()
    rep.runner = RLRun(cfg, rep)
    with pytest.raises(ActorDied) as e:
        rep.runner.run()
    msg = str(e.value)
    assert (
        "TrainerActor of run 't' died" in msg and f"resume from the last checkpoint under {cfg.save}" in msg
    )


def test_stopping_the_engines_waits_for_them_together_and_a_hung_one_does_not_hold_it(tiny_hf_checkpoint):
    """A run's teardown asks every engine to stop at once and waits a bounded time for all of
    them: two SIGSTOPped engines of three cost that bound once (it was 30 s per engine, one after
    the other; one bound each would be 2 x 3 s here), and every actor, the hung ones included, is
    gone afterwards."""
    import time

    import psutil
    import ray

    from miles_platform.cluster import forkserver
    from miles_platform.cluster.ray_cluster import init_ray
    from miles_platform.rollout.engine_fleet import RolloutEngineActor, engine_handles, stop_engines

    def alive(proc: psutil.Process) -> bool:  # is_running() is safe against pid reuse
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    init_ray(RunConfig())
    cls = ray.remote(num_cpus=0.1, runtime_env=forkserver.runtime_env())(RolloutEngineActor)
    handles = engine_handles([cls.remote(tiny_hf_checkpoint) for _ in range(3)])
    pids = ray.get([h.actor.__ray_call__.remote(lambda self: os.getpid()) for h in handles], timeout=60)
    assert pids == [h.process.pid for h in handles]
    procs = [psutil.Process(p) for p in pids]
    try:
        os.kill(pids[0], signal.SIGSTOP)
        os.kill(pids[2], signal.SIGSTOP)
        t0 = time.monotonic()
        stop_engines(handles, wait_s=3.0)
        took = time.monotonic() - t0
        assert 3.0 <= took < 5.5, took  # one bound for both hung engines, not one each
        # the hung ones are SIGKILLed, not left to ray.kill's 5 s grace they cannot answer
        deadline = time.monotonic() + 2
        while any(alive(p) for p in procs):
            assert time.monotonic() < deadline, [p.pid for p in procs if alive(p)]
            time.sleep(0.05)
    finally:
        for proc in procs:  # a failed assertion must not leave a stopped process behind
            with contextlib.suppress(psutil.Error):
                if alive(proc):
                    proc.kill()
