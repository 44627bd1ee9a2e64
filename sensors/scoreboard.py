"""Rebuild the `scoreboard` once a burst of new `evals` rows has settled (`scoreboard_on_new_evals`
-> `update_scoreboard`).

It watches the `evals` table's part files, not Dagster events, so evals written by the loop of a
`miles-platform train` run count as well as `eval_results` materializations. The table's signature
(`<files>:<newest part name>`) is compared with the one the latest `scoreboard` materialization
was built from (its `evals_signature` metadata, taken after the rows it writes itself: its own
base evals never trigger it again) and with the last one the sensor requested (its cursor).

Evals land in bursts (the eval sensor's requests for a run, a loop's evals), one part file per
eval. A rebuild is requested once no new file came for MILES_SCOREBOARD_QUIET_S (default 120 s),
or once the oldest file the scoreboard has not seen is MILES_SCOREBOARD_MAX_WAIT_S old (default
900 s: a long stream of evals still shows up), with the signature as run_key.
"""

import time
from dataclasses import dataclass

import dagster as dg

from assets.metadata import latest_materialization, metadata_text
from miles_platform.store.scoreboard import evals_part_names, evals_signature, part_time
from resources.storage import StorageRootResource
from sensors.settings import env_int

scoreboard_job = dg.define_asset_job(
    "update_scoreboard",
    selection=["scoreboard"],
    description="Rebuild the scoreboard from the evals table (and evaluate bases not evaluated yet).",
)


@dataclass(frozen=True)
class RebuildPolicy:
    quiet_s: int = 120  # seconds without a new evals file before a rebuild
    max_wait_s: int = 900  # ... or since the oldest file the scoreboard has not seen

    @classmethod
    def from_env(cls) -> "RebuildPolicy":
        d = cls()
        return cls(
            quiet_s=env_int("MILES_SCOREBOARD_QUIET_S", d.quiet_s, 0,
                            "seconds without new evals before the scoreboard is rebuilt"),
            max_wait_s=env_int("MILES_SCOREBOARD_MAX_WAIT_S", d.max_wait_s, 0,
                               "longest wait of new evals for a scoreboard rebuild"),
        )  # fmt: skip


def _now() -> float:
    return time.time()


def plan_rebuild(
    names: list[str], built: str | None, requested: str | None, now: float, policy: RebuildPolicy
) -> tuple[bool, str]:
    """(rebuild now?, why) for the evals part file `names` (oldest first), the signature the
    scoreboard was `built` from and the one last `requested`."""
    signature = evals_signature(names)
    if signature is None:
        return False, "no evals yet"
    if signature == built:
        return False, "the scoreboard is up to date with the evals table"
    if signature == requested:
        return False, "a rebuild for these evals is requested already"
    seen_newest = built.split(":", 1)[1] if built else ""
    new = [n for n in names if n > seen_newest] or names[-1:]
    quiet, waited = now - part_time(names[-1]), now - part_time(new[0])
    if quiet >= policy.quiet_s or waited >= policy.max_wait_s:
        return True, f"{len(new)} new evals file(s), none for {quiet:.0f} s"
    return False, (
        f"{len(new)} new evals file(s), the last {quiet:.0f} s ago: rebuilding after {policy.quiet_s} s "
        f"without new ones (or {policy.max_wait_s} s after the first)"
    )


def built_from(instance: dg.DagsterInstance) -> str | None:
    """The evals signature the latest scoreboard materialization was built from."""
    return metadata_text(latest_materialization(instance, "scoreboard"), "evals_signature")


def build_scoreboard_sensor(policy: RebuildPolicy | None = None) -> dg.SensorDefinition:
    policy = policy or RebuildPolicy.from_env()

    @dg.sensor(
        name="scoreboard_on_new_evals",
        job=scoreboard_job,
        minimum_interval_seconds=60,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Rebuild the scoreboard when new rows land in the evals table (any writer), once "
        f"none came for {policy.quiet_s} s (env MILES_SCOREBOARD_QUIET_S / _MAX_WAIT_S).",
    )
    def _sensor(context: dg.SensorEvaluationContext, storage: StorageRootResource):
        names = evals_part_names(storage.paths)
        rebuild, why = plan_rebuild(names, built_from(context.instance), context.cursor, _now(), policy)
        if not rebuild:
            return dg.SensorResult(skip_reason=why, cursor=context.cursor)
        signature = evals_signature(names)
        request = dg.RunRequest(run_key=f"scoreboard:{signature}", tags={"miles/trigger": "new_evals"})
        context.log.info(why)
        return dg.SensorResult(run_requests=[request], cursor=signature)

    return _sensor


scoreboard_on_new_evals = build_scoreboard_sensor()
