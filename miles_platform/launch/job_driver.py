"""The driver of a run submitted as a Ray job (launch/ray_jobs.py): the job's entrypoint
`python -m miles_platform.launch.job_driver`, on the cluster.

It reads the validated RunConfig from $MILES_RUN_CONFIG, joins the cluster through the RAY_ADDRESS
the job supervisor sets, and trains as `miles-platform train` does; its log lines (and under
Dagster, Pipes messages) go to the job's log, which `train --submit` and the `rl_training` op tail.
"""

from __future__ import annotations

import json
import os
import sys

from miles_platform.config import RunConfig
from miles_platform.launch.ray_jobs import CONFIG_ENV
from miles_platform.store.versions import PolicyVersion


class _PipesReporter:
    """The driver's Reporter under Dagster Pipes: log lines go to the Dagster run's log and each
    new policy version is announced as a custom message (the op reconciles the materializations
    from the catalog: Pipes cannot report partitioned ones in this Dagster version)."""

    def __init__(self, pipes):
        self.pipes = pipes

    def log(self, msg: str) -> None:
        self.pipes.log.info(msg)

    def on_rollout(self, rollout_id: int, metrics: dict[str, float]) -> None:
        pass

    def on_policy_version(self, pv: PolicyVersion) -> None:
        self.pipes.report_custom_message({"policy_version": pv.partition_key})


def driver_main() -> int:
    """The entrypoint of a submitted run, on the cluster."""
    if os.environ.get(WARM):
        from miles_platform.cluster.forkserver import INHERITED

        print(f"[job driver] pid {os.getpid()}: a fork of the fork server in {os.environ.get(INHERITED)}",
              file=sys.stderr, flush=True)  # fmt: skip
    text = os.environ.get(CONFIG_ENV)
    if not text:  # before the loop's imports (torch & co.): a misconfigured job says so at once
        print(f"miles_platform.launch.job_driver: {CONFIG_ENV} is not set (submit with `train --submit`)",
              file=sys.stderr)  # fmt: skip
        return 2
    from miles_platform.errors import MilesError
    from miles_platform.loop import ActorDied, CITestFailure, Reporter, train

    try:
        cfg = RunConfig.from_dict(json.loads(text)).validate()
        if os.environ.get("DAGSTER_PIPES_CONTEXT"):
            from dagster_pipes import open_dagster_pipes

            with open_dagster_pipes() as pipes:
                result = train(cfg, _PipesReporter(pipes))  # type: ignore[arg-type]
        else:
            result = train(cfg, Reporter())
    except CITestFailure as e:
        print(f"miles-platform train: {e}", file=sys.stderr)
        return 3  # deterministic: ray_jobs.FINAL_EXIT_CODES
    except ActorDied as e:
        print(f"miles-platform train: {e}", file=sys.stderr)
        return 1
    except MilesError as e:
        print(f"miles-platform train: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"run": result.run, "last_rollout_id": result.last_rollout_id,
                      "final_version": result.final_version, "final_hf_path": result.final_hf_path}))  # fmt: skip
    return 0


WARM = "MILES_JOB_DRIVER_WARM"  # set in the driver's environment once it runs as a fork of the server


def run_warm_if_possible() -> None:
    """On a machine whose fork server the job inherited through the node's environment
    (forkserver.INHERITED: a one-machine cluster started beside one, as the tests' two-node cluster)
    the driver runs as a fork of that server, as Ray's workers there do: torch, transformers and the
    loop's modules already imported (~6 CPU-s of a cold start, measured 2026-12-06). This process
    becomes the server's launcher (cluster/fork_exec.py: same environment, working dir, stdio; signals
    reach the fork, its exit status is this process's). Anywhere else: nothing, the driver runs here."""
    from miles_platform.cluster import forkserver

    d = os.environ.get(forkserver.INHERITED)
    if not d or os.environ.get(WARM) or not forkserver.ForkServer(None, d).alive():
        return
    os.environ[WARM] = "1"
    sys.stdout.flush()
    os.execv(
        sys.executable,
        [*forkserver.launcher_argv(d), "-m", "miles_platform.launch.job_driver", *sys.argv[1:]],
    )


if __name__ == "__main__":
    run_warm_if_possible()
    sys.exit(driver_main())
