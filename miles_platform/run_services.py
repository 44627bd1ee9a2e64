"""The processes a training run needs, up in order and down in reverse: the run's lifecycle (run
lock, dead writers' staging, resume config, Ray, trackers: run_lifecycle.py), placement groups,
trainer actors, engines + router, rollout manager, weight-update session, fully async worker.
`RLRun` enters it and then only loops."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from miles_platform.cluster.cpu_pinning import trainer_threads
from miles_platform.config import RunConfig
from miles_platform.errors import ActorDied
from miles_platform.run_types import Reporter
from miles_platform.startup import StartupClock
from miles_platform.store.paths import StoragePaths


class RunServices(contextlib.AbstractContextManager):
    """`with RunServices(cfg, paths, reporter, tok, src) as s:` -> s.trainers, s.engines, s.router,
    s.manager, s.session, s.worker, s.trackers, s.state (the trainer checkpoint state or None).
    Teardown runs in reverse order whatever failed, and releases the run lock last."""

    def __init__(self, cfg: RunConfig, paths: StoragePaths, reporter: Reporter, tokenizer, data_source,
                 startup: StartupClock | None = None):  # fmt: skip
        self.cfg, self.paths, self.reporter, self.tok, self.src = cfg, paths, reporter, tokenizer, data_source
        self.startup = startup or StartupClock()  # marks the start-up phases (startup.py)
        self.trainers: list = []
        self.engines = self.router = self.manager = self.session = self.worker = self.monitor = None
        self.train_only = None  # --debug-train-only with a rollout function (Miles' SFT): no engines
        self.teachers: list[tuple[str, str, str | None]] = []  # OPD: (teacher, kind, content hash)
        self.state: dict[str, Any] | None = None
        self.cpu_plan: str | None = None  # --pin-trainer-cpus (cluster/cpu_pinning.py)
        from miles_platform.run_lifecycle import RunLifecycle

        # run lock, dead writers' staging, resume config, Ray, trackers: up first, down last
        self.life = RunLifecycle(cfg, paths, reporter.log)
        self.hooks = self.life.hooks
        from miles_platform.cluster.colocation import Colocation

        self.colocation = Colocation(
            cfg, [], None
        )  # the offload schedule; set once trainers and engines are up
        self._stack = contextlib.ExitStack()

    @property
    def trackers(self):
        return self.life.trackers

    @property
    def publishes_versions(self) -> bool:
        """Whether the run makes policy versions: with engines (the weight-update session), and in a
        train-only run of a rollout function (Miles' SFT), whose versions are HF exports no engine
        loads; not in a replay of dumped rollouts (--load-debug-rollout-data) or --debug-rollout-only."""
        return self.session is not None or (self.train_only is not None and bool(self.trainers))

    @property
    def config_changes(self) -> list[str]:
        """Flags a resume changed under --allow-config-change."""
        return self.life.config_changes

    def __enter__(self) -> RunServices:
        try:
            self._start()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _start(self) -> None:
        import ray

        from miles_platform.cluster.cpu_pinning import pin_driver, plan
        from miles_platform.cluster.ray_cluster import create_placement_groups, remove_placement_groups

        cfg, s, log = self.cfg, self._stack, self.reporter.log
        self.cpu_plan = plan(cfg, int(trainer_threads()))  # --pin-trainer-cpus (validated in preflight)
        undo = pin_driver(self.cpu_plan)  # this process and what it starts (Ray's daemons) off the
        if undo is not None:  # trainers' cores; given back to an in-process caller at the end
            s.callback(undo)
        s.enter_context(self.life)
        self.startup.mark("ray")
        self._warm_up_driver()
        groups = create_placement_groups(cfg)
        s.callback(remove_placement_groups, groups)
        self.startup.mark("placement")
        # trainers and engines start side by side: the trainers' imports and model build overlap
        # the engines' (each is seconds of CPU on its own process)
        if not cfg.debug_rollout_only:
            self.trainers = self._create_trainers(groups)
        teacher = None
        if cfg.uses_teacher_engine and cfg.opd_teacher_hf_checkpoint and not cfg.debug_train_only:
            from miles_platform.rollout.engine_fleet import EngineHandle, create_teacher_engine, stop_engines

            teacher = create_teacher_engine(cfg)  # beside the trainers and engines
            s.callback(stop_engines, [EngineHandle(url="", actor=teacher)])
        if not cfg.debug_train_only:
            from miles_platform.rollout.engine_fleet import start_engines, stop_engines

            self.engines, self.router = start_engines(cfg, groups)
            s.callback(stop_engines, self.engines)
            s.callback(self.router.stop)
            if self.engines[0].actor is not None:  # --ci-fault-hooks on an engine: its current actor
                from miles_platform.rollout.engine_fleet import fault_in_engine

                def on_engine(r) -> None:
                    pid = fault_in_engine(self.engines[r.engine], r)
                    log(
                        f"[ci-fault-hooks] {r.request_id}: engine {r.engine} ({self.engines[r.engine].url}, pid {pid})"
                    )

                self.hooks.on_engine = on_engine
        self.startup.mark("engines")
        if self.trainers:
            ready_or_user_error([a.ready.remote() for a in self.trainers])
            self.state = ray.get([t.load.remote() for t in self.trainers])[0]
            if self.cpu_plan:  # where the ranks really run, as each reports it
                from miles_platform.cluster.cpu_pinning import cores_of

                ranks = ray.get([t.__ray_call__.remote(cores_of) for t in self.trainers])
                log(
                    f"[pin-trainer-cpus] trainer rank cores {ranks}; the engines and this driver on {cores_of()}"
                )
        self.startup.mark("trainers")
        if cfg.uses_trainer_teacher:  # the teacher is in the trainer
            from miles_platform.rollout.opd import teacher_sources

            self.teachers = teacher_sources(cfg, {})
        if self.state is not None and self.src is not None:
            self.src.load_state_dict(self.state["data_source"])
        if cfg.debug_train_only:
            if cfg.rollout_function_path and not cfg.load_debug_rollout_data:
                from miles_platform.rollout.train_only import TrainOnlyRollouts

                self.train_only = TrainOnlyRollouts(cfg, self.src)
            return
        from miles_platform.rollout.manager import RolloutManager
        from miles_platform.weights.update_session import UpdateSession

        log(
            f"engines {' '.join(e.url for e in self.engines)} router {self.router.url}: every call needs "
            "the run's bearer token (--api-key / --api-key-file / $MILES_API_KEY, else generated)"
        )
        # one engine: talk to it directly (a router hop would add latency and nothing else)
        # (--use-fault-tolerance: always the router, whose address outlives an engine's replacement)
        direct = len(self.engines) == 1 and not cfg.use_fault_tolerance
        url = self.engines[0].url if direct else self.router.url
        self.manager = RolloutManager(cfg, self.tok, self.src, url)
        s.callback(self.manager.close)
        self._restore_partial_rollout((self.state or {}).get("partial_rollout") or [])
        if cfg.uses_teacher_engine:
            self._start_opd_teachers(url, teacher)
        if self.trainers:
            self.session = UpdateSession(
                cfg,
                self.paths,
                self.engines,
                self.trainers,
                adapter=self.manager.adapter,
                hook=self.hooks.fire,
            )
        if cfg.use_fault_tolerance:
            self._start_health_monitor(groups)
        from miles_platform.cluster.colocation import Colocation

        self.colocation = Colocation(cfg, self.trainers, self.engines, call_trainers)
        self.startup.mark("services")

    def _warm_up_driver(self) -> None:
        """What this process imports later (the graders, which the rollout manager waits for; pandas,
        which pyarrow pulls in at the first table read or write: the resume's), on daemon threads
        from now on: until the engines are up, this thread mostly waits for the actors. Not before
        Ray's start: up to there both cores are busy (this process's validation and imports beside
        the fork server's). Where modules are compiled at each start (PYTHONDONTWRITEBYTECODE, no
        .pyc) this took the start 14.0 -> 11.6 s on 2 cores (pandas ~1 s, math_verify + sympy ~2
        CPU-s then); with .pyc files (~0.3 and ~0.6 CPU-s) no change was measurable (2026-12-07)."""
        from miles_platform.startup import import_in_background

        import_in_background("pandas", name="warm-up-pandas")
        if not self.cfg.debug_train_only:
            from miles_platform.rollout import rm_hub

            rm_hub.warm_up_rewards_in_background(*rm_hub.run_graders(self.cfg))

    def _start_health_monitor(self, groups) -> None:
        import threading

        from miles_platform.rollout.engine_fleet import restart_engine
        from miles_platform.rollout.health import EngineHealthMonitor

        session = self.session
        self.monitor = EngineHealthMonitor(
            self.cfg,
            self.engines,
            self.router.url,
            restart=lambda i: restart_engine(self.cfg, groups, i),
            served=session.served if session is not None else (lambda: (0, None)),
            lock=session.lock if session is not None else threading.Lock(),
            report=self.reporter.log,
            replaced=session.transport.engine_replaced if session is not None else None,
        ).start()
        self._stack.callback(self.monitor.stop)

    def _start_opd_teachers(self, student_url: str, teacher: Any = None) -> None:
        """Sglang-mode OPD: the teacher engine the run started (--opd-teacher-hf-checkpoint) or the
        configured ones, and the scorer that sends them each rollout (rollout/opd.py)."""
        from miles_platform.rollout.engine_fleet import teacher_handle
        from miles_platform.rollout.opd import TeacherScorer, teacher_sources

        started = None
        if teacher is not None:
            started = teacher_handle(teacher).url
            self.reporter.log(f"[opd] teacher engine {self.cfg.opd_teacher_hf_checkpoint} on {started}")
        urls = self.cfg.teacher_urls(started)
        self.teachers = teacher_sources(self.cfg, urls)
        self.manager.opd = TeacherScorer(
            self.cfg, urls, student_url, self.manager.client, student_lora=self.manager.adapter
        )

    def _restore_partial_rollout(self, saved: list) -> None:
        """A resume: the --partial-rollout store as it was saved (a run resumed without the flag
        generates those prompts again from the start)."""
        if self.manager.partial is not None:
            self.manager.partial.load_state_dict(saved)
        elif saved:
            from miles_platform.rollout.data_buffer import entry_from_json

            self.src.put_back([entry_from_json(e).prompt for e in saved])

    def start_async_worker(self) -> None:
        """--fully-async: the background generator (started after the initial sync and eval)."""
        if self.cfg.fully_async and self.manager is not None:
            from miles_platform.rollout.async_worker import AsyncRolloutWorker

            saved = (self.state or {}).get("async_data_buffer")  # a resume: the buffered groups as they were
            self.worker = AsyncRolloutWorker(self.manager, saved).start()
            self._stack.callback(self.worker.stop)

    def __exit__(self, *exc) -> bool:
        return bool(self._stack.__exit__(*exc))

    def _create_trainers(self, groups) -> list:
        """The trainer actors, created (not yet waited on: `.ready` does that)."""

        from miles_platform.cluster.cpu_pinning import ENV
        from miles_platform.cluster.ports import free_port
        from miles_platform.cluster.ray_cluster import create_role_actors
        from miles_platform.training.actor import TrainerActor

        cfg = self.cfg
        world = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
        dist_init = f"tcp://127.0.0.1:{free_port()}" if world > 1 else None
        threads = trainer_threads()
        from miles_platform.rollout.engine_fleet import run_storage_env, run_storage_secrets
        from miles_platform.training.qat import qat_env_vars

        env = {
            "env_vars": {
                "OMP_NUM_THREADS": threads,
                "MILES_TRAIN_THREADS": threads,
                **run_storage_env(cfg),
                **({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if cfg.deterministic_mode else {}),
                **qat_env_vars(),  # Miles' INT4 QAT variables, as preflight read them (training/qat.py)
                **({ENV: self.cpu_plan} if self.cpu_plan else {}),  # --pin-trainer-cpus: each rank's cores
                **cfg.train_env(),
            }  # fmt: skip
        }
        actors = create_role_actors(
            TrainerActor, cfg, groups, "actor", cfg, world_size=world, dist_init=dist_init,
            secret_env=run_storage_secrets(cfg), options={"runtime_env": env},
        )  # fmt: skip
        return actors

    def service_metrics(self) -> dict[str, float]:
        """Each rollout's metrics of the services: --use-fault-tolerance's engine restarts so far."""
        return {"rollout/engine_restarts": float(self.monitor.restarts)} if self.monitor is not None else {}

    def checkpoint_state(self) -> dict:
        """What a checkpoint records of the rollout side: the data-source position plus every prompt
        taken and not trained; --partial-rollout: the partial store; --fully-async: the data buffer
        and the worker's finished groups."""
        if self.worker is not None:
            ds, worker = self.worker.checkpoint_state()
            return {"data_source": ds, "async_data_buffer": worker}
        state = {"data_source": self.data_source_state()}
        if self.manager is not None and self.manager.partial is not None:
            state["partial_rollout"] = self.manager.partial.state_dict()
        return state

    def data_source_state(self) -> dict:
        """The data-source position plus every prompt taken and not trained (sync rollouts)."""
        if self.train_only is not None:
            return self.src.state_dict()
        m = self.manager
        return m.data_source.state_dict(m.unfinished_records()) if m else {}


def resume_hint(cfg) -> str:
    where = cfg.save or cfg.load
    return (
        f"relaunch the same command to resume from the last checkpoint under {where}"
        if where
        else "no --save: a relaunch starts over"
    )


def call_trainers(cfg, trainers: list, method: str, *args: Any) -> Any:
    """`method(*args)` on every trainer rank; rank 0's answer. A rank that does not answer within
    --train-timeout-s (a stopped or deadlocked process, a peer waiting on it) stops the run with one
    message naming the ranks; without the bound a SIGSTOPped trainer hung the run forever."""
    return wait_trainers(cfg, submit_trainers(trainers, method, *args), method)


def submit_trainers(trainers: list, method: str, *args: Any) -> list:
    """`method(*args)` queued on every trainer rank (each actor runs its calls in order); the refs
    `wait_trainers` reads."""
    return [getattr(t, method).remote(*args) for t in trainers]


def wait_trainers(cfg, refs: list, method: str) -> Any:
    """Rank 0's answer to `submit_trainers`' call, bounded by --train-timeout-s (`call_trainers`)."""
    import ray

    timeout = cfg.train_timeout_s or None
    try:
        return ray.get(refs, timeout=timeout)[0]
    except ray.exceptions.GetTimeoutError:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        hung = [k for k, r in enumerate(refs) if r not in done]  # the teardown kills them
        raise ActorDied(
            f"trainer rank(s) {hung} of run {cfg.run_name!r} did not finish {method} within {timeout:g} s "
            "(--train-timeout-s): a rank is stopped, deadlocked or waiting on one; the run stopped: "
            f"{resume_hint(cfg)}"
        ) from None


def ready_or_user_error(refs: list) -> None:
    """Wait for the trainers to be built; a user mistake their constructor found (a checkpoint with
    NaN weights, ...) is raised as itself, one line, not as Ray's "actor died" traceback (Ray keeps
    only the text of a creation task's error: the class and message are read back from it)."""
    import re

    import ray
    from ray.exceptions import ActorDiedError, RayTaskError

    from miles_platform import errors

    try:
        ray.get(refs)
    except (ActorDiedError, RayTaskError) as e:
        text = f"{getattr(e, 'error_msg', '')}\n{e}"
        found = re.findall(r"^miles_platform\.errors\.(\w+): (.+)$", text, flags=re.M)
        cls = getattr(errors, found[-1][0], None) if found else None
        if isinstance(cls, type) and issubclass(cls, errors.MilesError):
            raise cls(found[-1][1]) from None
        raise


def actor_died(cfg: RunConfig, e: Exception, injected: list | None = None) -> Exception | None:
    """A Ray actor of the run died (a trainer rank, an engine without --use-fault-tolerance): one
    message naming the actor and how to resume, instead of Ray's traceback. `injected`: the
    --ci-fault-hooks rank requests due in this rollout (`FaultHooks.due_in_ranks`), named for a
    trainer so an injected death reads as one."""
    import httpx
    import ray

    from miles_platform.rollout.client import EngineHTTPError

    resume = resume_hint(cfg)
    gone = isinstance(e, EngineHTTPError) and e.status in (502, 503, 504)  # the router: no worker
    if gone or (isinstance(e, httpx.TransportError) and not isinstance(e, httpx.TimeoutException)):
        # an engine (or the router) that stopped answering: one line, not httpx's traceback
        what = f"HTTP {e.status}" if isinstance(e, EngineHTTPError) else type(e).__name__
        try:
            url = e.request.url if isinstance(e, httpx.TransportError) else ""
        except RuntimeError:  # raised without a request
            url = ""
        detail = str(e).splitlines()[0][:200] if str(e) else what
        hint = (
            "" if cfg.use_fault_tolerance else " (--use-fault-tolerance replaces a dead engine and goes on)"
        )
        return ActorDied(f"an engine of run {cfg.run_name!r} stopped answering ({what} {url}: {detail}){hint}; "
                         f"the run stopped: {resume}")  # fmt: skip
    if not isinstance(e, ray.exceptions.RayActorError):
        return None
    text = str(e)
    name = next((n for n in ("TrainerActor", "RolloutEngineActor", "EngineActor") if n in text), "an actor")
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)
    due = ""
    if injected and name == "TrainerActor":
        due = (f"; --ci-fault-hooks due in the trainer ranks: {', '.join(r.describe() for r in injected)} "
               "(a relaunch that keeps them fires them again)")  # fmt: skip
    return ActorDied(f"{name} of run {cfg.run_name!r} died ({first[:200]}){due}; the run stopped: {resume}")
