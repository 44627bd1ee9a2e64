"""`scoreboard`: every run's versions on one metric (greedy pass@1 for LLM runs, mean reward for
diffusion runs), the base (v0) on it, the best version.

Read from the catalog's `evals` view (the newest value per run, version, dataset and metric,
whichever writer), so versions evaluated in the loop of a `miles-platform train` run count as
much as `eval_results` partitions. Runs never share a line: one summary per (run, dataset) in the
`runs` table, one line per version in `all_versions`; the `scoreboard` markdown shows the best
runs of every kind that fit inline in the UI, each best version linked to its partition. A run whose base was never evaluated (under Dagster the loop
does not evaluate) gets its base checkpoint evaluated here, once, with the run's eval settings,
into the `evals` table as version 0 (`source` asset); later materializations read that row.

The `scoreboard_on_new_evals` sensor (sensors/scoreboard.py) materializes it when new `evals`
rows land; **Materialize** on the asset page does it on demand.
"""

import itertools
import os

import dagster as dg

from assets.evals import EvalConfig, evaluate_and_record, resolve_datasets, run_config_for_version
from assets.metadata import latest_materialization, metadata_text
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
        eval_data_version = metadata_text(latest_materialization(instance, "eval_dataset"), "content_hash")
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


INLINE_MARKDOWN = 1000  # the Dagster UI shows shorter markdown inline, longer behind "[Show Markdown]"


def version_link(key: str, text: str | None = None) -> str:
    """A markdown link to a version's `policy_versions` partition in the Dagster UI."""
    return f"[{text or key}](/assets/policy_versions?view=partitions&partition={key})"


def _value(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1%}" if metric == "pass@1" else f"{value:.3f}"


def _gain(s: RunScore) -> str:
    if s.gain is None:
        return "-"
    return f"{s.gain * 100:+.1f} pts" if s.metric == "pass@1" else f"{s.gain:+.3f}"


def ranked(board: Scoreboard) -> list[RunScore]:
    """Best first within each metric, the metrics taking turns: the top of every run kind leads."""
    by_metric: dict[str, list[RunScore]] = {}
    for s in board.runs:
        by_metric.setdefault(s.metric, []).append(s)
    for scores in by_metric.values():
        scores.sort(key=lambda s: (s.best is None, -(s.best or 0.0), s.run))
    turns = itertools.zip_longest(*by_metric.values())
    return [s for turn in turns for s in turn if s is not None]


def _run_line(s: RunScore) -> str:
    best = (
        "-"
        if s.best_key is None
        else f"{version_link(s.best_key, f'v{s.best_version}')} {_value(s.metric, s.best)}"
    )
    return f"| {s.run} | {s.dataset} | {s.metric} | {_value(s.metric, s.base)} | {best} | {_gain(s)} |"


def _compact(lines: list[str], more: int, notes: list[str]) -> str:
    head = [
        "| run | dataset | metric | base (v0) | best version | gain |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    tail = [f"_+{more} more run(s): the `runs` table; every version: `all_versions`_"] if more else []
    return "\n".join([*head, *lines, "", *tail, *notes]).rstrip()


def scoreboard_markdown(board: Scoreboard, skipped: dict[str, str]) -> str:
    """The compact board: the best runs (of every kind) that fit inline in the UI, each best
    version linked to its partition; the `runs` table and `all_versions` hold the rest."""
    if not board.runs:
        return (
            "No evals yet: materialize `eval_results` for a policy version (or train with --eval-interval)."
        )
    lines = [_run_line(s) for s in ranked(board)]
    notes = [f"_{run}: base not evaluated: {why}_" for run, why in sorted(skipped.items())]
    if len(_compact(lines[:1], len(lines) - 1, notes)) >= INLINE_MARKDOWN:
        notes = [f"_{len(notes)} run(s) with no base evaluated: see `all_versions`_"]
    shown = 1
    while (
        shown < len(lines)
        and len(_compact(lines[: shown + 1], len(lines) - shown - 1, notes)) < INLINE_MARKDOWN
    ):
        shown += 1
    return _compact(lines[:shown], len(lines) - shown, notes)


def all_versions_markdown(board: Scoreboard, skipped: dict[str, str]) -> str:
    """Every evaluated version of every run (newest eval of each), linked to its partition."""
    out = []
    for s in board.runs:
        mine = [r for r in board.rows if (r["run"], r["dataset"]) == (s.run, s.dataset)]
        out += ["", f"**{s.run}** on `{s.dataset}` ({s.metric}, newest eval of each version)", "",
                f"| version | {s.metric} | |", "| --- | --- | --- |"]  # fmt: skip
        for r in mine:
            mark = "base" if r["version"] == 0 else ("best" if r["version"] == s.best_version else "")
            out.append(f"| {version_link(r['partition_key'])} | {_value(s.metric, r['value'])} | {mark} |")
    out += [f"\n_{run}: base not evaluated: {why}_" for run, why in sorted(skipped.items())]
    return "\n".join(out).strip()


def _runs_table(board: Scoreboard) -> dg.TableMetadataValue:
    cols = [
        ("run", "string"), ("dataset", "string"), ("metric", "string"), ("base", "float"),
        ("best_version", "string"), ("best", "float"), ("gain", "float"), ("latest_version", "string"),
        ("latest", "float"), ("evaluated_versions", "int"),
    ]  # fmt: skip

    def record(s: RunScore) -> dg.TableRecord:
        latest = None if s.latest_version is None else partition_key(s.run, s.latest_version)
        values = [s.run, s.dataset, s.metric, s.base, s.best_key, s.best, s.gain, latest, s.latest,
                  s.evaluated_versions]  # fmt: skip
        values = [round(v, 4) if isinstance(v, float) else v for v in values]
        return dg.TableRecord(dict(zip([c for c, _ in cols], values, strict=True)))

    return dg.MetadataValue.table(
        records=[record(s) for s in ranked(board)],
        schema=dg.TableSchema(columns=[dg.TableColumn(name, kind) for name, kind in cols]),
    )


def best_versions(board: Scoreboard) -> dict[str, str]:
    """The version to serve per run: its best on `eval` (else on its first eval dataset)."""
    out: dict[str, str] = {}
    for s in sorted(board.runs, key=lambda s: s.dataset != "eval"):
        if s.best_key and s.run not in out:
            out[s.run] = s.best_key
    return dict(sorted(out.items()))


@dg.asset(
    deps=["eval_results"],
    group_name="evals",
    kinds={"duckdb"},
    description="Per run and eval dataset: each policy version on greedy pass@1 (LLM runs) or mean reward "
    "(diffusion runs), with the base (v0) and the best version, from the catalog's evals (newest value per "
    "run, version, dataset). The best runs inline, every run in `runs`, every version in `all_versions`.",
)
def scoreboard(
    context: dg.AssetExecutionContext, config: ScoreboardConfig, storage: StorageRootResource
) -> dg.MaterializeResult:
    paths = storage.paths
    skipped = evaluate_bases(context.instance, paths, context.log) if config.evaluate_base else {}
    signature = evals_signature(evals_part_names(paths))  # after its own base evals: no self-trigger
    board = read_scoreboard(Catalog(paths))
    metadata: dict = {
        "scoreboard": dg.MetadataValue.md(scoreboard_markdown(board, skipped)),
        "runs": _runs_table(board),
        "all_versions": dg.MetadataValue.md(all_versions_markdown(board, skipped)),
        "num_runs": len({s.run for s in board.runs}),
        "evals_signature": signature or "",
    }
    best = best_versions(board)
    if best:  # the version to serve per run, for a glance at the Overview
        metadata["best_versions"] = dg.MetadataValue.json(best)
    return dg.MaterializeResult(metadata=metadata)
