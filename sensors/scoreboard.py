"""Rebuild the `scoreboard` when new `evals` rows land (`scoreboard_on_new_evals` -> `update_scoreboard`).

It watches the `evals` table's part files, not Dagster events, so evals written by the loop of a
`miles-platform train` run count as well as `eval_results` materializations. The cursor is the
number of part files and the newest name (`part-<time_ns>-...`); any new file changes it and asks
for one run, with that signature as run_key (a repeated signature launches nothing). Rows land in
bursts (one file per eval), so the 60 s interval folds a burst into one run.
"""

import dagster as dg
import fsspec

from resources.storage import StorageRootResource

scoreboard_job = dg.define_asset_job(
    "update_scoreboard",
    selection=["scoreboard"],
    description="Rebuild the scoreboard from the evals table (and evaluate bases not evaluated yet).",
)


def evals_signature(storage: StorageRootResource) -> str | None:
    """`<files>:<newest part name>` of the evals table, None while it has no rows."""
    fs, root = fsspec.core.url_to_fs(storage.paths.table_dir("evals"))
    if not fs.exists(root):
        return None
    names = [p.rsplit("/", 1)[-1] for p in fs.glob(f"{root}/run=*/part-*.parquet")]
    return f"{len(names)}:{max(names)}" if names else None


@dg.sensor(
    name="scoreboard_on_new_evals",
    job=scoreboard_job,
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Rebuild the scoreboard whenever new rows land in the evals table (any writer).",
)
def scoreboard_on_new_evals(context: dg.SensorEvaluationContext, storage: StorageRootResource):
    signature = evals_signature(storage)
    if signature is None:
        return dg.SensorResult(skip_reason="no evals yet", cursor=context.cursor)
    if signature == context.cursor:
        return dg.SensorResult(skip_reason="no new evals", cursor=context.cursor)
    request = dg.RunRequest(run_key=f"scoreboard:{signature}", tags={"miles/trigger": "new_evals"})
    return dg.SensorResult(run_requests=[request], cursor=signature)
