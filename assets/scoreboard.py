"""`scoreboard`: greedy pass@1 per policy version of every run, the base (v0) on it, the best version.

Read from the catalog's `evals` view (the newest value per run, version, dataset and metric,
whichever writer), so versions evaluated in the loop of a `miles-platform train` run count as
much as `eval_results` partitions. Runs never share a line: one row per (run, dataset, version)
and one summary per (run, dataset). A run whose base was never evaluated (under Dagster the loop
does not evaluate) gets its base checkpoint evaluated here, once, with the run's eval settings,
into the `evals` table as version 0 (`source` asset); later materializations read that row.

The `scoreboard_on_new_evals` sensor (sensors/scoreboard.py) materializes it when new `evals`
rows land; **Materialize** on the asset page does it on demand.
"""

import os

import dagster as dg

from assets.evals import (
    EvalConfig,
    _latest_materialization,
    _md,
    evaluate_and_record,
    resolve_datasets,
    run_config_for_version,
)
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths, partition_key
from miles_platform.store.scoreboard import (
    RunScore,
    Scoreboard,
    base_checkpoint_of,
    evals_part_names,
    evals_signature,
    read_scoreboard,
    runs_without_base,
)
from resources.storage import StorageRootResource


class ScoreboardConfig(dg.Config):
    evaluate_base: bool = True  # evaluate version 0 of runs whose base has no pass@1 yet (once per run)


def _base_eval_config(instance: dg.DagsterInstance, catalog: Catalog, run: str) -> EvalConfig:
    """The run's eval settings: those its newest evaluated version was launched with."""
    lit = run.replace("'", "''")
    _, rows = catalog.query(f"SELECT max(version) FROM evals WHERE run = '{lit}' AND version > 0")
    newest = rows[0][0] if rows and rows[0][0] is not None else None
    cfg = run_config_for_version(instance, partition_key(run, newest)) if newest is not None else {}
    return EvalConfig(**cfg.get("ops", {}).get("eval_results", {}).get("config", {}))


def evaluate_bases(
    instance: dg.DagsterInstance, paths: StoragePaths, log
) -> dict[str, str]:  # run -> why its base was not evaluated
    catalog, skipped = Catalog(paths), {}
    for run in runs_without_base(catalog):
        base = base_checkpoint_of(catalog, run)
        if not base or "://" in base or not os.path.isfile(os.path.join(base, "config.json")):
            skipped[run] = f"base checkpoint {base or '(no lineage edge)'} not found"
            continue
        config = _base_eval_config(instance, catalog, run)
        datasets = resolve_datasets(instance, config)
        log.info(f"evaluating the base of run {run} ({base}) on {', '.join(n for n, _ in datasets)}")
        eval_data_version = _md(_latest_materialization(instance, "eval_dataset"), "content_hash")
        evaluate_and_record(
            paths,
            partition_key(run, 0),
            base,
            datasets,
            config,
            (base, "checkpoint", None),
            eval_data_version,
        )
    return skipped


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _runs_table(board: Scoreboard) -> dg.TableMetadataValue:
    cols = [
        ("run", "string"), ("dataset", "string"), ("base_pass@1", "float"), ("best_version", "string"),
        ("best_pass@1", "float"), ("gain", "float"), ("latest_version", "string"), ("latest_pass@1", "float"),
        ("evaluated_versions", "int"),
    ]  # fmt: skip

    def record(s: RunScore) -> dg.TableRecord:
        latest = None if s.latest_version is None else partition_key(s.run, s.latest_version)
        values = [
            s.run,
            s.dataset,
            s.base,
            s.best_key,
            s.best,
            s.gain,
            latest,
            s.latest,
            s.evaluated_versions,
        ]
        values = [round(v, 4) if isinstance(v, float) else v for v in values]
        return dg.TableRecord(dict(zip([c for c, _ in cols], values, strict=True)))

    return dg.MetadataValue.table(
        records=[record(s) for s in board.runs],
        schema=dg.TableSchema(columns=[dg.TableColumn(name, kind) for name, kind in cols]),
    )


def _versions_table(board: Scoreboard) -> dg.TableMetadataValue:
    best = {(s.run, s.dataset): s.best_version for s in board.runs}
    records = [
        dg.TableRecord(
            {
                "run": r["run"],
                "dataset": r["dataset"],
                "version": r["partition_key"] if r["version"] else f"{r['partition_key']} (base)",
                "pass@1": round(r["pass_at_1"], 4),
                "source": r["source"],
                "best": r["version"] == best[(r["run"], r["dataset"])],
            }
        )
        for r in board.rows
    ]
    cols = [("run", "string"), ("dataset", "string"), ("version", "string"), ("pass@1", "float"),
            ("source", "string"), ("best", "bool")]  # fmt: skip
    return dg.MetadataValue.table(
        records=records, schema=dg.TableSchema(columns=[dg.TableColumn(n, k) for n, k in cols])
    )


def scoreboard_markdown(board: Scoreboard, skipped: dict[str, str]) -> str:
    if not board.runs:
        return (
            "No evals yet: materialize `eval_results` for a policy version (or train with --eval-interval)."
        )
    out = ["| run | dataset | base (v0) | best version | best pass@1 | gain | latest | versions |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for s in board.runs:
        gain = "-" if s.gain is None else f"{s.gain * 100:+.1f} pts"
        latest = "-" if s.latest_version is None else f"v{s.latest_version}: {_pct(s.latest)}"
        out.append(
            f"| {s.run} | {s.dataset} | {_pct(s.base)} | {s.best_key or '-'} | {_pct(s.best)} | {gain} "
            f"| {latest} | {s.evaluated_versions} |"
        )
    for s in board.runs:
        mine = [r for r in board.rows if (r["run"], r["dataset"]) == (s.run, s.dataset)]
        out += ["", f"**{s.run}** on `{s.dataset}` (greedy pass@1, newest eval of each version)", "",
                "| version | pass@1 | |", "| --- | --- | --- |"]  # fmt: skip
        for r in mine:
            mark = "base" if r["version"] == 0 else ("best" if r["version"] == s.best_version else "")
            out.append(f"| v{r['version']} | {_pct(r['pass_at_1'])} | {mark} |")
    out += [f"\n_{run}: base not evaluated: {why}_" for run, why in sorted(skipped.items())]
    return "\n".join(out)


@dg.asset(
    deps=["eval_results"],
    group_name="evals",
    kinds={"duckdb"},
    description="Per run: greedy pass@1 of each policy version with the base (v0) on it, and the best "
    "version, from the catalog's evals (newest value per run, version, dataset). Runs never share a line.",
)
def scoreboard(
    context: dg.AssetExecutionContext, config: ScoreboardConfig, storage: StorageRootResource
) -> dg.MaterializeResult:
    paths = storage.paths
    skipped = evaluate_bases(context.instance, paths, context.log) if config.evaluate_base else {}
    signature = evals_signature(evals_part_names(paths))  # after its own base evals: no self-trigger
    board = read_scoreboard(Catalog(paths))
    metadata: dict = {
        "evals_signature": signature or "",
        "scoreboard": dg.MetadataValue.md(scoreboard_markdown(board, skipped)),
        "runs": _runs_table(board),
        "versions": _versions_table(board),
        "num_runs": len({s.run for s in board.runs}),
    }
    best = {s.run: s.best_key for s in board.runs if s.dataset == "eval" and s.best_key}
    if best:  # the version to serve per run, for a glance at the Overview
        metadata["best_versions"] = dg.MetadataValue.json(best)
    return dg.MaterializeResult(metadata=metadata)
