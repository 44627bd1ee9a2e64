"""The campaign's scoreboard: every evaluated version of every run, with the base, on one metric
per run and eval dataset: greedy `pass@1` (LLM runs), else `mean_reward` (diffusion runs, whose
evals score images).

Read from the catalog's `evals` view the way the README queries read it: the newest value per
(run, version, dataset, metric), whichever writer (`loop` or `asset`) wrote it. Version 0 is the
run's base checkpoint (the loop's eval before training, or the `scoreboard` asset's own eval of
the base). Runs never mix: every row and every summary is per (run, dataset).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths, partition_key

# the metric a (run, dataset) is scored on: the first it has. pass@1 is greedy, so comparable
# across versions whatever the sampling settings were; diffusion evals have mean_reward only
METRICS = ("pass@1", "mean_reward")
METRIC = METRICS[0]

NEWEST = f"""
SELECT run, dataset, metric, version, arg_max(value, created_at) AS value,
       arg_max(source, created_at) AS source, max(created_at) AS evaluated_at
FROM evals WHERE metric IN {METRICS}
GROUP BY run, dataset, metric, version ORDER BY run, dataset, metric, version
"""


@dataclass
class RunScore:
    """One run on one eval dataset, scored on `metric`: its base, its best trained version, its latest."""

    run: str
    dataset: str
    metric: str
    base: float | None  # version 0 (None: the base was not evaluated)
    best_version: int | None  # the trained version (>= 1) with the highest value; ties: the earliest
    best: float | None
    latest_version: int | None
    latest: float | None
    evaluated_versions: int  # trained versions with a value

    @property
    def best_key(self) -> str | None:
        return None if self.best_version is None else partition_key(self.run, self.best_version)

    @property
    def gain(self) -> float | None:
        return None if self.best is None or self.base is None else self.best - self.base


@dataclass
class Scoreboard:
    rows: list[dict] = field(
        default_factory=list
    )  # run, dataset, metric, version, partition_key, value, source
    runs: list[RunScore] = field(default_factory=list)

    def score(self, run: str, dataset: str = "eval") -> RunScore | None:
        return next((s for s in self.runs if (s.run, s.dataset) == (run, dataset)), None)


def _run_score(run: str, dataset: str, metric: str, mine: list[dict]) -> RunScore:
    base = next((r["value"] for r in mine if r["version"] == 0), None)
    trained = [r for r in mine if r["version"] > 0]
    best = max(trained, key=lambda r: (r["value"], -r["version"]), default=None)
    latest = trained[-1] if trained else None
    return RunScore(
        run=run,
        dataset=dataset,
        metric=metric,
        base=base,
        best_version=best and best["version"],
        best=best and best["value"],
        latest_version=latest and latest["version"],
        latest=latest and latest["value"],
        evaluated_versions=len(trained),
    )


def read_scoreboard(catalog: Catalog) -> Scoreboard:
    cols, raw = catalog.query(NEWEST)
    found = [dict(zip(cols, r)) for r in raw]
    board = Scoreboard()
    for run, dataset in dict.fromkeys((r["run"], r["dataset"]) for r in found):
        ours = [r for r in found if (r["run"], r["dataset"]) == (run, dataset)]
        metric = next(m for m in METRICS if any(r["metric"] == m for r in ours))
        mine = [
            r | {"partition_key": partition_key(run, r["version"])} for r in ours if r["metric"] == metric
        ]
        board.rows += mine
        board.runs.append(_run_score(run, dataset, metric, mine))
    return board


def runs_without_base(catalog: Catalog) -> list[str]:
    """Runs with evaluated trained versions but no version-0 pass@1."""
    _, rows = catalog.query(
        f"SELECT run FROM evals WHERE metric = '{METRIC}' GROUP BY run "
        "HAVING count(*) FILTER (WHERE version = 0) = 0 ORDER BY run"
    )
    return [r[0] for r in rows]


def base_checkpoint_of(catalog: Catalog, run: str) -> str | None:
    """The base checkpoint a run trained from (its `base_checkpoint` lineage edge)."""
    lit = run.replace("'", "''")
    _, rows = catalog.query(
        f"SELECT parent FROM lineage WHERE run = '{lit}' AND relation = 'base_checkpoint' "
        "AND parent IS NOT NULL ORDER BY created_at DESC LIMIT 1"
    )
    return rows[0][0] if rows else None


# ---------------------------------------------------------------- what the scoreboard was built from
def evals_part_names(paths: StoragePaths) -> list[str]:
    """The `evals` table's part names, oldest first (`part-<time_ns>-<uuid>.parquet`), the same
    before and after a compaction merged them (store/tables.py `part_names`)."""
    from miles_platform.store.tables import part_names

    return part_names(paths, "evals")


def evals_signature(names: list[str]) -> str | None:
    """`<files>:<newest part name>`: changes with every row appended (None while there are none)."""
    return f"{len(names)}:{names[-1]}" if names else None


def part_time(name: str) -> float:
    """When a part file was written (seconds since the epoch), from its name."""
    return int(name.split("-")[1]) / 1e9
