"""Run-health asset checks on `rollout_shards` and `policy_versions` (miles_platform/store/run_health.py).

They look at every run of the storage root, so one red check names the run and the version or
rollout that broke. `check_run_health` (sensors/run_health.py) runs them after each `rl_training`
run ends and after `runs_from_catalog` reports the versions that end a CLI run; the asset pages' **Checks** tab runs them
on demand.
"""

import dagster as dg

from miles_platform.store.run_health import CHECKS, MAX_LINES, Health
from resources.storage import StorageRootResource

DESCRIPTIONS = {
    "contiguous_rollout_ids": "every run's shards are rollouts 0..N-1 with no gap; each version's shard exists",
    "async_staleness": "no sample trained more than --max-weight-staleness versions behind the engine",
    "expected_version_count": "versions 1..N with no gap, one per rollout due a weight update; a finished "
    "run has --num-rollout // --update-weights-interval",
    "hf_export_sanity": "each version's weights hold what its model kind should: an HF export or a diffusers "
    "pipeline the base's key set and parameter count, a PEFT adapter LoRA pairs fitting the base; a run of "
    "no known kind is listed in per_run, not failed",
    "prompt_coverage": "a run that drew a full epoch of --prompt-data trained every prompt (but those the "
    "filters dropped), and none in more epochs than were started",
}


def _result(health: Health) -> dg.AssetCheckResult:
    lines = health.problems[:MAX_LINES]
    more = len(health.problems) - len(lines)
    md = "\n".join(f"- {p}" for p in lines) + (f"\n- ... and {more} more" if more > 0 else "")
    table = ["| run | " + " | ".join(next(iter(health.per_run.values()), {})) + " |"]
    table.append("|" + " --- |" * (1 + len(next(iter(health.per_run.values()), {}))))
    table += [
        f"| {run} | " + " | ".join(str(v) for v in vals.values()) + " |"
        for run, vals in health.per_run.items()
    ]
    return dg.AssetCheckResult(
        passed=health.passed,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={
            "problems": len(health.problems),
            "runs": len(health.per_run),
            "details": dg.MetadataValue.md(md or "no problems"),
            "per_run": dg.MetadataValue.md("\n".join(table) if health.per_run else "no runs"),
        },
    )


def _build(name: str, asset: str, check) -> dg.AssetChecksDefinition:
    @dg.asset_check(asset=asset, name=name, description=DESCRIPTIONS[name])
    def _check(storage: StorageRootResource) -> dg.AssetCheckResult:
        return _result(check(storage.paths))

    return _check


contiguous_rollout_ids, async_staleness, expected_version_count, hf_export_sanity, prompt_coverage = (
    _build(name, asset, fn) for name, (asset, fn) in CHECKS.items()
)
