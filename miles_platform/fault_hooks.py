"""`--ci-fault-hooks`: faults injected at named points of the train loop, as Miles' fault suite does.

    --ci-fault-hooks '[{"request_id": "k", "hook_name": "weight_update_prepared",
                        "action": {"kind": "kill_process"}, "rollout_id": 3}]'

A request waits at its hook (in the driver, the process that records every row, or inside the
trainer ranks for the rank hooks below) and runs its action the first time the hook is reached in
its rollout (any rollout when `rollout_id` is absent). The driver's hooks, in the order one
rollout reaches them:

    orchestrator_step_start         before the rollout is generated
    rollout_end                     the rollout shard is written
    trainer_controller_step_start   before the trainer ranks train on it
    trainer_controller_step_end     trained, nothing published
    weight_update_start             before the HF export of the new version
    weight_update_prepared          exported; the transport prepared it (disk-delta: published)
    weight_update_paused            engines paused, the new weights not loaded
    weight_update_activated         engines serve the new version, still paused
    version_recorded                the version's catalog row and lineage are written
    eval_start                      before the in-loop eval
    metrics_recorded                the rollout's metrics are written
    save_start / save_end           around the trainer checkpoint (when one is due)
    orchestrator_step_end           the rollout is done

(`train-async` queues rollout k+1's train behind rollout k's where it can: then k+1's rollout_end and
trainer_controller_step_start fire inside rollout k's train phase; docs/rollout.md.)

Inside each trainer rank (`training/actor.py`, the rank's own process: `kill_process` there kills
the rank, and the driver stops with `ActorDied` naming it and the resume command), Miles' names:

    trainer_weight_update_before_all_gather   before the rank gathers the full HF weights of a
                                              weight update (the initial sync's included)
    trainer_step_before_allreduce             a step's gradients computed, before their
                                              data-parallel all-reduce and the optimizer step
    trainer_weight_update_before_send         the sending rank (rank 0 of the broadcast transport,
                                              the only one that sends from a rank), weights
                                              gathered, the engines waiting in the group

The rollout of a rank's hook is the one it last trained (-1 before the first); a request for a
rank hook may name one rank (`"target": {"rank": 0}`; default: every rank).

A driver hook's request may instead act on a rollout engine (`"target": {"engine": N}`, the N-th
embedded engine of the run, its current replacement after a restart): at the hook the driver
sends the action to that engine's process (kill_process, segfault_process, stop_process: SIGKILL,
SIGSEGV, SIGSTOP), which is how the
--use-fault-tolerance tests kill and hang engines at chosen points of a run.

Actions: kill_process (SIGKILL), exit_process (`exit_code`, default 1, no cleanup), segfault_process
(SIGSEGV), stop_process (SIGSTOP: a hung driver), sleep (`seconds`), sleep_forever, observe (a log
line), raise (a `FaultInjected` exception). Miles' cell and API-server actions have no counterpart
here and are refused by name.

The flag changes nothing that is trained: a relaunch without it resumes the same run
(config.RESUMABLE) and the config hash ignores it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from miles_platform.errors import ConfigError, MilesError

HOOKS = (
    "orchestrator_step_start", "rollout_end", "trainer_controller_step_start", "trainer_controller_step_end",
    "weight_update_start", "weight_update_prepared", "weight_update_paused", "weight_update_activated",
    "version_recorded", "eval_start", "metrics_recorded", "save_start", "save_end", "orchestrator_step_end",
)  # fmt: skip
# the loops' phases and the driver hooks fired around each, (before, after): a phase that does not run
# in a rollout fires neither; `weight_update_paused` fires inside `train`'s update session
PHASES = {
    "step": ("orchestrator_step_start", "orchestrator_step_end"),  # one rollout, start to end
    "rollout": (None, "rollout_end"),  # generate, write the shard
    "train": ("trainer_controller_step_start", "trainer_controller_step_end"),
    "weight_update": ("weight_update_start", None),  # a new version: export, transport, engines load it
    "weight_export": (None, "weight_update_prepared"),  # (train-diffusion's; train's update session fires it)
    "weight_activate": (None, "weight_update_activated"),  # (likewise)
    "record": (None, "version_recorded"),  # the version's row and lineage
    "eval": ("eval_start", None),
    "metrics": (None, "metrics_recorded"),  # the rollout's metrics
    "save": ("save_start", "save_end"),  # the trainer checkpoint
}
# fired inside the trainer ranks (their own processes), not by the driver
RANK_HOOKS = ("trainer_weight_update_before_all_gather", "trainer_step_before_allreduce",
              "trainer_weight_update_before_send")  # fmt: skip
MAX_SLEEP_S = 86400  # a day: longer is sleep_forever
ACTIONS = ("kill_process", "exit_process", "segfault_process", "stop_process", "sleep", "sleep_forever",
           "observe", "raise")  # fmt: skip
# what the driver can do to an engine's process: a signal (ENGINE_SIGNALS)
ENGINE_ACTIONS = ("kill_process", "segfault_process", "stop_process")
# Miles' actions that act on cells, threads or the API server: no counterpart in this loop
NOT_HERE = ("freeze_process", "deadlock_thread", "stop_cell", "start_cell", "api_server_fault",
            "restart_rollout_cell")  # fmt: skip


class FaultInjected(MilesError):
    """A `raise` fault hook fired."""


@dataclass
class FaultRequest:
    hook_name: str
    kind: str
    rollout_id: int | None = None
    request_id: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    rank: int | None = None  # a rank hook's target rank (None: every rank)
    engine: int | None = None  # a driver hook's target engine (None: the driver itself)
    fired: bool = False

    def describe(self) -> str:
        at = f", rollout {self.rollout_id}" if self.rollout_id is not None else ""
        on = f" of engine {self.engine}" if self.engine is not None else ""
        return f"{self.request_id} ({self.kind}{on} at {self.hook_name}{at})"


def parse_fault_hooks(value: str | list | None) -> list[FaultRequest]:
    """The flag's JSON (or a YAML list) -> requests; any mistake is a ConfigError naming the entry."""
    if value in (None, "", []):
        return []
    from miles_platform.config.flags import json_flag

    flag = "--ci-fault-hooks"
    value = json_flag(value, flag, list, "a JSON array of hook requests")
    out = []
    for i, r in enumerate(value):
        where = f"{flag} entry {i}"
        if not isinstance(r, dict):
            raise ConfigError(f"{where}: expected an object, got {type(r).__name__}")
        unknown = set(r) - {"request_id", "hook_name", "action", "rollout_id", "target"}
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}")
        hook, action = r.get("hook_name"), r.get("action")
        if hook not in HOOKS + RANK_HOOKS:
            raise ConfigError(f"{where}: hook_name {hook!r}; choose one of {', '.join(HOOKS + RANK_HOOKS)}")
        if not isinstance(action, dict) or "kind" not in action:
            raise ConfigError(f'{where}: action must be an object with a "kind"')
        kind = action["kind"]
        if kind in NOT_HERE:
            raise ConfigError(f"{where}: action {kind!r} acts on Miles cells or threads, which this loop "
                              f"does not have; choose one of {', '.join(ACTIONS)}")  # fmt: skip
        if kind not in ACTIONS:
            raise ConfigError(f"{where}: action kind {kind!r}; choose one of {', '.join(ACTIONS)}")
        params = {k: v for k, v in action.items() if k != "kind"}
        allowed = {"sleep": {"seconds"}, "exit_process": {"exit_code"}, "raise": {"message"},
                   "observe": {"message"}}.get(kind, set())  # fmt: skip
        if set(params) - allowed:
            raise ConfigError(f"{where}: action {kind!r} takes {sorted(allowed) or 'no parameters'}, "
                              f"got {sorted(params)}")  # fmt: skip
        secs = params.get("seconds")
        if kind == "sleep" and not (
            isinstance(secs, int | float) and not isinstance(secs, bool) and 0 <= secs <= MAX_SLEEP_S
        ):  # 1e308 raised OverflowError in the run; sleep_forever is the unbounded one
            raise ConfigError(f'{where}: sleep needs "seconds" in [0, {MAX_SLEEP_S}] (or use sleep_forever)')
        code = params.get("exit_code", 1)
        if kind == "exit_process" and (
            isinstance(code, bool) or not isinstance(code, int) or not 1 <= code <= 255
        ):
            # 0 would end the run worker as a success: an injected fault must read as one
            raise ConfigError(f'{where}: "exit_code" must be an integer in [1, 255]')
        rid = r.get("rollout_id")
        if rid is not None and (isinstance(rid, bool) or not isinstance(rid, int) or rid < 0):
            raise ConfigError(f"{where}: rollout_id must be an integer >= 0, got {rid!r}")
        rank, engine = _target(r.get("target"), hook, kind, where)
        out.append(FaultRequest(hook, kind, rid, str(r.get("request_id", f"hook-{i}")), params, rank, engine))
    return out


def _target(target: Any, hook: str, kind: str, where: str) -> tuple[int | None, int | None]:
    """Miles' `target`: `{"rank": N}` of a rank hook, or `{"engine": N}` of a driver hook (no cells
    to name). -> (rank, engine)."""
    if target is None:
        return None, None
    if not isinstance(target, dict) or len(target) != 1 or set(target) - {"rank", "engine"}:
        raise ConfigError(
            f'{where}: target must be {{"rank": N}} or {{"engine": N}} (this loop has no cells), got {target!r}'
        )
    ((key, n),) = target.items()
    if key == "rank" and hook not in RANK_HOOKS:
        raise ConfigError(f"{where}: target names a trainer rank; {hook} runs in the driver (no target)")
    if key == "engine" and hook in RANK_HOOKS:
        raise ConfigError(f"{where}: target names an engine; {hook} runs in a trainer rank")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ConfigError(f"{where}: target {key} must be an integer >= 0, got {n!r}")
    if key == "engine" and kind not in ENGINE_ACTIONS:
        raise ConfigError(f"{where}: action {kind!r} on an engine; choose one of {', '.join(ENGINE_ACTIONS)}")
    return (n, None) if key == "rank" else (None, n)


class FaultHooks:
    """One process's requests; `fire(hook)` at each point (the loop, or the trainer rank, sets
    `rollout_id` per rollout). The driver's (`rank` None) fire the driver hooks; a trainer rank's
    fire the rank hooks that target it."""

    def __init__(
        self, requests: list[FaultRequest], log: Callable[[str], None] = print, rank: int | None = None
    ):
        self.log, self.rollout_id, self.rank = log, -1, rank
        # the driver's: runs an engine-targeted request's action in that engine (run_services sets it)
        self.on_engine: Callable[[FaultRequest], None] | None = None
        names = HOOKS if rank is None else RANK_HOOKS
        # copies: whether a request fired is this process's state
        self.requests = [replace(r) for r in requests if r.hook_name in names and r.rank in (None, rank)]
        self.in_ranks = [r for r in requests if r.hook_name in RANK_HOOKS] if rank is None else []

    def fire(self, hook: str) -> None:
        for r in self.requests:
            if r.fired or r.hook_name != hook or r.rollout_id not in (None, self.rollout_id):
                continue
            r.fired = True
            where = "" if self.rank is None else f" in TrainerActor rank {self.rank}"
            on = "" if r.engine is None else f" of engine {r.engine}"
            self.log(
                f"[ci-fault-hooks] {r.request_id}: {r.kind}{on} at {hook}, rollout {self.rollout_id}{where}"
            )
            if r.engine is None:
                _act(r)
            elif self.on_engine is None:
                raise FaultInjected(f"{r.describe()}: this run has no embedded engines to act on")
            else:
                self.on_engine(r)

    @contextlib.contextmanager
    def phase(self, name: str, end: bool = True) -> Iterator[None]:
        """`with hooks.phase("train"):` fires the phase's before-hook, runs the block, then its
        after-hook (not when the block raised; not with `end=False`). PHASES names them."""
        before, after = PHASES[name]
        if before:
            self.fire(before)
        yield
        if after and end:
            self.fire(after)

    def due_in_ranks(self) -> list[FaultRequest]:
        """The driver's view: rank-hook requests that may have fired in this rollout (a dead rank's
        message names them)."""
        return [r for r in self.in_ranks if r.rollout_id in (None, self.rollout_id)]


ENGINE_SIGNALS = {
    "kill_process": signal.SIGKILL,
    "segfault_process": signal.SIGSEGV,
    "stop_process": signal.SIGSTOP,
}


def _act(r: FaultRequest) -> None:
    if r.kind == "kill_process":
        os.kill(os.getpid(), signal.SIGKILL)
    elif r.kind == "segfault_process":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif r.kind == "stop_process":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif r.kind == "exit_process":
        os._exit(int(r.params.get("exit_code", 1)))
    elif r.kind == "sleep":
        time.sleep(float(r.params["seconds"]))
    elif r.kind == "sleep_forever":
        while True:
            time.sleep(3600)
    elif r.kind == "raise":
        raise FaultInjected(r.params.get("message") or f"fault hook {r.request_id} at {r.hook_name}")
    # observe: the log line is the action
