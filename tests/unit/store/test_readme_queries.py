"""Every SQL query the README and the store docs show, run against a store of two runs.

The store is the case that breaks careless queries: two runs with the same version numbers and
rollout ids, a version evaluated by both writers (`source` loop and asset), a re-evaluation.
Each query must run; any result with a version or rollout id must keep runs apart; aggregated
results must give one row per key (no double counting).
"""

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from miles_platform.data.sample import Sample, make_turn
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths, partition_key
from miles_platform.store.shards import write_rollout_shard
from miles_platform.store.tables import append_rows

REPO = Path(__file__).resolve().parents[3]
DOCS = ("README.md", "docs/evals_lineage.md", "docs/data_and_store.md", "docs/rollout.md")
KEY_COLUMNS = {"run", "version", "rollout_id", "partition_key", "dataset", "metric", "source"}
KEY_COLUMNS |= {"temperature", "top_p", "top_k", "max_new_tokens", "n_samples"}
T0 = datetime(2026, 1, 1, tzinfo=UTC)
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8}


def doc_queries(name: str) -> list[str]:
    """The ```sql blocks (split at `;`) and the quoted SQL of `miles-platform query` / `duckdb` lines."""
    text = (REPO / name).read_text()
    out = []
    for block in re.findall(r"```sql\n(.*?)```", text, re.S):
        body = "\n".join(line for line in block.splitlines() if not line.strip().startswith("--"))
        out += [q.strip() for q in body.split(";") if q.strip()]
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        out += [
            q for q in re.findall(r'(?:query|catalog\.duckdb) "([^"]+)"', block, re.S) if "<sql>" not in q
        ]
    return out


ALL = [(name, q) for name in DOCS for q in doc_queries(name)]


def _eval_rows(version: int, run: str, pass1: float, source: str, minutes: int) -> list[dict]:
    return [
        {"version": version, "partition_key": partition_key(run, version), "dataset": "eval", "metric": m,
         "value": v, "n_samples": 1, "source": source, "created_at": T0 + timedelta(minutes=minutes), **SAMPLING}
        for m, v in (("pass@1", pass1), ("pass@1(T=1)", pass1), ("mean_reward@1(T=1)", pass1 / 2))
    ]  # fmt: skip


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Runs `demo` and `other`, versions 1 and 2 each (trained on rollouts 0 and 1)."""
    paths = StoragePaths(str(tmp_path_factory.mktemp("two_runs")))
    reward = {("demo", 0): 0.25, ("demo", 1): 0.5, ("other", 0): 0.75, ("other", 1): 1.0}
    for (run, rid), r in reward.items():
        samples = [
            Sample(run=run, rollout_id=rid, index=i, prompt=f"{i}+{i}=", label=str(2 * i), reward=r,
                   response_tokens=[1] * (2 + i), weight_version_start=rid, weight_version_end=rid)
            for i in range(8)
        ]  # fmt: skip
        shard = write_rollout_shard(paths, run, rid, samples)
        version = rid + 1
        key = partition_key(run, version)
        append_rows(paths, "policy_versions", run, [
            {"version": version, "partition_key": key, "parent_version": rid, "rollout_id": rid,
             "hf_path": paths.hf_export(run, version), "shard_path": shard.path, "mean_reward": r},
        ])  # fmt: skip
        append_rows(paths, "lineage", run, [
            {"child": key, "child_kind": "policy_version", "parent": "data.parquet", "parent_kind": "dataset",
             "relation": "prompt_data", "data_version": "3f2a9c1b0d4e"},
        ])  # fmt: skip
        append_rows(
            paths, "metrics", run, [{"rollout_id": rid, "step": rid, "name": "train/loss", "value": r}]
        )
        append_rows(paths, "train_samples", run, [
            {"rollout_id": rid, "index": i, "version": version, "step": rid, "micro_batch": 0, "rank": 0,
             "advantage": [r] * (2 + i), "log_probs": [-1.0] * (2 + i), "rollout_log_probs": [-1.0 - i / 10] * (2 + i),
             "ratio": [1.0] * (2 + i), "clipped": [j < i for j in range(2 + i)], "loss_mask": [1] * (2 + i)}
            for i in range(8)
        ])  # fmt: skip
    # run `tools`: multi-turn episodes, one with a failing tool call
    ok = [{"name": "mul", "arguments": {"a": 12, "b": 34}, "result": "408"}]
    bad = [{"name": "mul", "arguments": {"a": 1}, "error": "tool 'mul' raised KeyError: 'b'"}]
    turns = [
        [make_turn("assistant", "<tool_call>..", 0, 3, "stop", ok), make_turn("tool", "408", 3, 5, None, ok),
         make_turn("assistant", "408", 5, 8, "stop")],
        [make_turn("assistant", "<tool_call>..", 0, 3, "stop", bad), make_turn("tool", "", 3, 3, None, bad)],
    ]  # fmt: skip
    write_rollout_shard(paths, "tools", 0, [
        Sample(run="tools", rollout_id=0, index=i, prompt="12*34=", label="408", reward=float(i == 0),
               response_tokens=[1] * t[-1]["end"], turns=t, metadata={"tool_call_count": 1})
        for i, t in enumerate(turns)
    ])  # fmt: skip
    # demo v1: the loop's eval, then the asset's (newer); demo v2: the asset twice, the newer lower
    append_rows(paths, "evals", "demo", _eval_rows(1, "demo", 0.1, "loop", 1))
    append_rows(paths, "evals", "demo", _eval_rows(1, "demo", 0.2, "asset", 2))
    append_rows(paths, "evals", "demo", _eval_rows(2, "demo", 0.5, "asset", 3))
    append_rows(paths, "evals", "demo", _eval_rows(2, "demo", 0.15, "asset", 4))
    append_rows(paths, "evals", "other", _eval_rows(1, "other", 0.6, "asset", 5))
    append_rows(paths, "evals", "other", _eval_rows(2, "other", 0.7, "asset", 6))
    return Catalog(paths)


def test_the_docs_show_queries():
    assert {name for name, _ in ALL} == set(DOCS)
    assert sum("from evals" in q.lower() for _, q in ALL) >= 6


@pytest.mark.parametrize(("doc", "sql"), ALL, ids=[f"{n}:{i}" for i, (n, _) in enumerate(ALL)])
def test_query_runs_keeps_runs_apart_and_counts_once(store, doc, sql):
    cols, rows = store.query(sql)
    lowered = re.sub(r"\s+", " ", sql.lower())
    if {"version", "rollout_id"} & set(cols) and "run = '" not in lowered:
        assert "run" in cols, f"{doc}: a per-version/rollout result without the run mixes runs:\n{sql}"
    keys = [c for c in cols if c in KEY_COLUMNS]
    if keys and "group by" in lowered:
        seen = [tuple(r[cols.index(k)] for k in keys) for r in rows]
        assert len(seen) == len(set(seen)), f"{doc}: more than one row per {keys}:\n{sql}"


def test_readme_reward_per_version_takes_the_newest_eval_of_its_own_run(store):
    (sql,) = [q for q in doc_queries("README.md") if "eval_pass1" in q]
    cols, rows = store.query(sql)
    assert cols == ["run", "version", "train_reward", "eval_pass1"]
    assert rows == [
        ("demo", 1, 0.25, 0.2),
        ("demo", 2, 0.5, 0.15),
        ("other", 1, 0.75, 0.6),
        ("other", 2, 1.0, 0.7),
    ]


def test_the_train_samples_queries_rank_samples_by_their_log_prob_gap(store):
    queries = [q for _, q in ALL if "from train_samples" in q.lower()]
    assert len(queries) == 2
    for sql in queries:
        cols, rows = store.query(sql)
        assert [r[cols.index("index")] for r in rows] == [7, 6, 5, 4, 3, 2, 1, 0]  # the gap grows with index
        assert {r[cols.index("run")] for r in rows} == {"demo"}


def test_the_tool_queries_count_calls_and_failures(store):
    [per_rollout] = [q for _, q in ALL if "with_tool_call" in q]
    assert store.query(per_rollout)[1] == [(0, 1.0, 1.0)]  # one call in each of the two episodes
    [failures] = [q for _, q in ALL if "an_error" in q]
    assert store.query(failures)[1] == [("mul", 2, 1, "tool 'mul' raised KeyError: 'b'")]


def test_learning_curve_has_one_row_per_version_with_the_newest_numbers(store):
    (sql,) = [q for q in doc_queries("docs/evals_lineage.md") if "pass_at_k" in q and "train_reward" in q]
    cols, rows = store.query(sql)
    got = {(r[cols.index("run")], r[cols.index("version")]): r[cols.index("pass_at_1")] for r in rows}
    assert got == {("demo", 1): 0.2, ("demo", 2): 0.15, ("other", 1): 0.6, ("other", 2): 0.7}
    assert len(rows) == 4


def test_best_version_per_run_uses_newest_evals(store):
    (sql,) = [q for q in doc_queries("docs/evals_lineage.md") if "best_version" in q]
    cols, rows = store.query(sql)
    assert [r[: cols.index("pass_at_1") + 1] for r in rows] == [
        ("demo", "demo.v000001", 0.2),
        ("other", "other.v000002", 0.7),
    ]
