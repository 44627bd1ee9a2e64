"""Engine fault tolerance (`--use-fault-tolerance`, Miles' RolloutHealthMonitor + engine recovery).

A daemon thread probes every engine's `/health_generate` each `--rollout-health-check-interval`
seconds (after `--rollout-health-check-first-wait`). An engine that answers anything but 200, or
nothing within `--rollout-health-check-timeout` (a hung or SIGSTOPped process), is replaced at
once, not at the next weight update as Miles does, so a run with a single engine survives too:

    take it out of the router -> ray.kill it -> a fresh engine on the same bundle ->
    load the version the run serves (its HF export) -> back behind the router

Before each weight update the loop runs one probe round itself (Miles' recover_updatable_engines),
so an engine that died since the last probe never fails the update. The replacement holds the
update session's lock, so no weight update runs half on the old and
half on the new engine set, and the version it loads is the one every other engine serves.
Requests in flight on the dead engine fail over: the router retries them on another engine, and
the rollout client keeps retrying (503 "no healthy worker") for as long as a replacement takes.
`rollout/engine_restarts` counts replacements (cumulative per run).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import httpx

from miles_platform.config import RunConfig
from miles_platform.rollout.client import EngineHTTPError, post
from miles_platform.tls import client_tls
from miles_platform.weights.transports import EngineHandle

log = logging.getLogger(__name__)

RESTART_BUDGET_S = 120.0  # what a replacement may take (a process start, imports, a model load)


def client_retries(cfg: RunConfig) -> int:
    """Retries of a rollout request under --use-fault-tolerance: enough 2 s backoffs to outlast
    detection (interval + timeout) and one replacement."""
    if not cfg.use_fault_tolerance:
        return 8
    wait = cfg.rollout_health_check_interval + cfg.rollout_health_check_timeout + RESTART_BUDGET_S
    return 8 + math.ceil(wait / 2.0)


class EngineHealthMonitor:
    def __init__(
        self,
        cfg: RunConfig,
        engines: list[EngineHandle],
        router_url: str,
        restart: Callable[[int], EngineHandle],
        served: Callable[[], tuple[int, str | None]],
        lock: threading.Lock,
        report: Callable[[str], None],
        replaced: Callable[[int], None] | None = None,
    ):
        """`engines` is the run's list (replaced in place, so the update session and the weight
        checks see the new engine); `restart(i)` starts engine i afresh; `served()` is the
        (version, HF export dir) the run's engines serve; `lock` is the update session's;
        `replaced(i)` runs (under the lock) once engine i's replacement serves: the transport
        forgets what it held for the old engine (a broadcast group is joined again)."""
        self.cfg, self.engines, self.router_url = cfg, engines, router_url
        self.replaced = replaced or (lambda i: None)
        self.restart, self.served, self.lock, self.report = restart, served, lock, report
        self.restarts = 0
        self.errors: list[str] = []
        self._stop, self._checking = threading.Event(), threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-health", daemon=True)

    def start(self) -> EngineHealthMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.cfg.rollout_health_check_timeout + RESTART_BUDGET_S)

    def _run(self) -> None:
        if self._stop.wait(self.cfg.rollout_health_check_first_wait):
            return
        while not self._stop.wait(self.cfg.rollout_health_check_interval):
            try:
                self.check_once()
            except Exception as e:  # a failed replacement: say so, keep watching the others
                msg = f"[fault-tolerance] replacing an engine failed: {type(e).__name__}: {e}"
                self.errors.append(msg)
                self.report(msg)

    def check_once(self) -> int:
        """Probe every engine once; replace the ones that fail. Returns how many were replaced.
        The loop calls it before each weight update too (Miles' recover_updatable_engines), so an
        engine that died since the last probe never fails an update."""
        with self._checking:
            replaced = 0
            for i, e in enumerate(list(self.engines)):
                why = self._probe(e)
                if why is not None and not self._stop.is_set():
                    self._replace(i, e, why)
                    replaced += 1
            return replaced

    def _probe(self, e: EngineHandle) -> str | None:
        try:
            r = httpx.get(
                f"{e.url}/health_generate",
                verify=client_tls(),
                headers={"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else None,
                timeout=self.cfg.rollout_health_check_timeout,
            )
        except httpx.TimeoutException:
            return f"did not answer /health_generate within {self.cfg.rollout_health_check_timeout} s"
        except httpx.HTTPError as err:
            return f"is unreachable ({type(err).__name__})"
        return None if r.status_code == 200 else f"answered /health_generate with {r.status_code}"

    def _replace(self, i: int, old: EngineHandle, why: str) -> None:
        import ray

        from miles_platform.rollout.engine_fleet import kill_engine_process

        key = self.cfg.api_key
        t0 = time.time()
        with self.lock:
            self.report(f"[fault-tolerance] engine {i} at {old.url} {why}: replacing it")
            try:
                post(self.router_url, "/remove_worker", {"url": old.url}, api_key=key, timeout=10)
            except (EngineHTTPError, httpx.HTTPError):
                pass  # already out of the router's rotation
            if old.actor is not None:
                kill_engine_process(old)  # a hung one now: ray.kill waits 5 s for it to answer
                try:
                    ray.kill(old.actor, no_restart=True)
                except Exception:
                    pass  # already gone
            new = self.restart(i)
            version, hf_dir = self.served()
            if version > 0:
                from miles_platform.weights.transports.disk import update_from_disk

                if hf_dir is None:
                    raise RuntimeError(f"engine {i}: no HF export of v{version} to load into its replacement")
                update_from_disk(new.url, hf_dir, version, key)
            post(self.router_url, "/add_worker", {"url": new.url}, api_key=key, timeout=10)
            self.engines[i] = new
            self.replaced(i)
            self.restarts += 1
        self.report(
            f"[fault-tolerance] engine {i} replaced by {new.url} serving v{version} in {time.time() - t0:.1f} s"
        )
