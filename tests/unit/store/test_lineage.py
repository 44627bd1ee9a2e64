"""`miles-platform lineage`: trees up (parents, shards, data, checkpoints) and down (evals, publications)."""

import json
import shutil
from pathlib import Path

import pytest
from store_builders import build_run

from miles_platform.config import RunConfig, saved_config
from miles_platform.data.sample import Sample
from miles_platform.models.checkpoint import content_hash
from miles_platform.store.lineage import LineageGraph, cli_main, format_compact, trace
from miles_platform.store.lineage_identity import Edge, write_edges
from miles_platform.store.paths import StoragePaths, partition_key
from miles_platform.store.shards import write_rollout_shard
from miles_platform.store.tables import append_rows, read_rows

DATA_V1, DATA_V2, BASE_V = "d" * 64, "e" * 64, "b" * 64
REWARDS = {0: [1.0, 0.0, 0.0, 0.0], 1: [1.0, 1.0, 0.0, 1.0], 2: [0.0, 0.0]}


def _record_version(paths, run, version, rollout_id, base, prompt, data_v):
    """What store.recorder.VersionRecorder.record writes: a policy_versions row and four lineage edges."""
    key = partition_key(run, version)
    shard = write_rollout_shard(
        paths,
        run,
        rollout_id,
        [
            Sample(run=run, rollout_id=rollout_id, index=i, reward=r)
            for i, r in enumerate(REWARDS[rollout_id])
        ],
    )
    append_rows(
        paths,
        "policy_versions",
        run,
        [
            {
                "version": version,
                "partition_key": key,
                "parent_version": version - 1,
                "rollout_id": rollout_id,
                "hf_path": paths.hf_export(run, version),
                "content_hash": f"c{version}",
                "dataset_data_version": data_v,
                "base_data_version": BASE_V,
                "shard_path": shard.path,
                "shard_rows": shard.rows,
                "mean_reward": shard.mean_reward,
            }
        ],
    )
    parent = (
        (partition_key(run, version - 1), "policy_version", None)
        if version > 1
        else (base, "checkpoint", BASE_V)
    )
    edges = [
        (*parent[:2], "trained_from", parent[2]),
        (shard.path, "rollout_shard", "trained_on", None),
        (prompt, "dataset", "prompt_data", data_v),
        (base, "checkpoint", "base_checkpoint", BASE_V),
    ]
    append_rows(
        paths,
        "lineage",
        run,
        [
            {
                "child": key,
                "child_kind": "policy_version",
                "parent": p,
                "parent_kind": k,
                "relation": rel,
                "data_version": dv,
            }
            for p, k, rel, dv in edges
        ],
    )
    return shard


@pytest.fixture
def store(tmp_path):
    paths = StoragePaths(str(tmp_path / "root"))
    base, prompt = paths.model("base"), paths.dataset("prompt_dataset")
    shards = [_record_version(paths, "demo", v, v - 1, base, prompt, DATA_V1) for v in (1, 2)]
    _record_version(paths, "other", 1, 2, base, prompt, DATA_V2)
    append_rows(
        paths,
        "lineage",
        "demo",
        [
            {
                "child": "eval:demo.v000001",
                "child_kind": "eval",
                "parent": "demo.v000001",
                "relation": "evaluates",
            },
            {
                "child": "publication:demo.v000001",
                "child_kind": "publication",
                "parent": "demo.v000001",
                "relation": "published",
            },
            {
                "child": "quantized:demo.v000001:fp8",
                "child_kind": "quantized",
                "parent": "demo.v000001",
                "relation": "quantized_from",
            },
        ],
    )
    append_rows(
        paths,
        "evals",
        "demo",
        [
            {
                "version": 1,
                "partition_key": "demo.v000001",
                "dataset": "eval",
                "metric": "pass@1",
                "value": 0.25,
                "n_samples": 1,
            }
        ],
    )
    # a later re-evaluation of the same version: the newest number wins
    append_rows(
        paths,
        "evals",
        "demo",
        [
            {
                "version": 1,
                "partition_key": "demo.v000001",
                "dataset": "eval",
                "metric": "pass@1",
                "value": 0.5,
                "n_samples": 1,
            }
        ],
    )
    return paths, base, prompt, shards


def _find(node, node_id):
    return next(n for n in node["nodes"] if n["id"] == node_id)


def test_upstream_walks_parents_shards_data_and_checkpoint(store):
    paths, base, prompt, shards = store
    res = trace(paths, "demo.v000002")
    up = res["upstream"]
    assert res["kind"] == "policy_version" and up["info"]["mean_reward"] == pytest.approx(0.75)
    shard2 = _find(up, shards[1].path)
    assert shard2["relations"] == ["trained_on"] and shard2["info"]["rows"] == 4
    assert shard2["info"]["mean_reward"] == pytest.approx(0.75)
    assert _find(up, prompt)["data_version"] == DATA_V1
    v1 = _find(up, "demo.v000001")
    assert v1["relations"] == ["trained_from"] and v1["info"]["content_hash"] == "c1"
    assert _find(v1, shards[0].path)["info"]["mean_reward"] == pytest.approx(0.25)
    base_node = _find(v1, base)
    assert sorted(base_node["relations"]) == ["base_checkpoint", "trained_from"]
    assert base_node["kind"] == "checkpoint" and base_node["data_version"] == BASE_V


def test_downstream_lists_evals_publications_quantized_and_children(store):
    paths, *_ = store
    down = trace(paths, "demo.v000001")["downstream"]
    ids = {n["id"]: n for n in down["nodes"]}
    assert {
        "eval:demo.v000001",
        "publication:demo.v000001",
        "quantized:demo.v000001:fp8",
        "demo.v000002",
    } <= set(ids)
    assert ids["eval:demo.v000001"]["info"] == {"eval/pass@1": 0.5}
    assert ids["demo.v000002"]["relations"] == ["trained_from"]


def test_checkpoint_path_downstream_reaches_every_version_trained_from_it(store):
    paths, base, *_ = store
    res = trace(paths, base + "/")  # trailing slash tolerated
    assert res["kind"] == "checkpoint"
    assert {n["id"] for n in res["downstream"]["nodes"]} == {"demo.v000001", "demo.v000002", "other.v000001"}


def test_what_was_trained_on_this_dataset_version(store):
    paths, _, prompt, _ = store
    graph = LineageGraph(paths)
    assert [r["partition_key"] for r in graph.trained_on_dataset(DATA_V1)] == ["demo.v000001", "demo.v000002"]
    assert [r["partition_key"] for r in graph.trained_on_dataset(DATA_V2[:12])] == ["other.v000001"]
    assert graph.trained_on_dataset("f" * 64) == []
    assert graph.trained_on_dataset(DATA_V1)[0]["dataset"] == prompt


def test_cli_text_json_and_errors(store, capsys):
    paths, base, *_ = store
    assert cli_main(["demo.v000002", "--storage-root", paths.root]) == 0  # compact by default
    text = capsys.readouterr().out
    assert (
        "upstream (what it came from):" in text and "trained from: demo.v000001  (1 earlier version)" in text
    )
    assert "mean_reward=0.75" in text and "rollout shards: 2 (one per version" in text
    assert " rows=4" not in text  # the shards' details are the full tree's
    assert cli_main(["demo.v000002", "--storage-root", paths.root, "--full"]) == 0
    text = capsys.readouterr().out
    assert "trained_from: demo.v000001" in text and " rows=4" in text and "mean_reward=0.75" in text

    assert cli_main(["demo.v000001", "--storage-root", paths.root, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["target"] == "demo.v000001" and out["downstream"]["nodes"]

    assert cli_main(["--dataset-version", DATA_V2, "--storage-root", paths.root, "--json"]) == 0
    assert [r["partition_key"] for r in json.loads(capsys.readouterr().out)["policy_versions"]] == [
        "other.v000001"
    ]

    assert cli_main(["demo.v000002", "--storage-root", paths.root, "--full", "--depth", "1"]) == 0
    assert "raise --depth" in capsys.readouterr().out

    assert cli_main(["nope.v000009", "--storage-root", paths.root]) == 2
    assert "not in the lineage" in capsys.readouterr().err
    assert cli_main(["demo.v000001", "--storage-root", str(paths.root) + "-missing"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_an_eval_written_before_metric_names_carried_their_sampling_reads_with_them(store):
    """Tables are append-only: an older row's `pass@k` (4 samples at temperature 1) shows as
    `pass@4(T=1)`, the name the same eval gets now."""
    paths, *_ = store
    old = {
        "version": 1,
        "partition_key": "demo.v000001",
        "dataset": "eval",
        "n_samples": 4,
        "temperature": 1.0,
    }
    append_rows(paths, "evals", "demo", [{**old, "metric": "pass@k", "value": 0.75}])
    ids = {n["id"]: n for n in trace(paths, "demo.v000001")["downstream"]["nodes"]}
    assert ids["eval:demo.v000001"]["info"] == {"eval/pass@1": 0.5, "eval/pass@4(T=1)": 0.75}


# ----------------------------------------------------------------- one identity per checkpoint
@pytest.fixture
def cli_and_op(tmp_path, monkeypatch, tiny_hf_checkpoint):
    """The README's flow from the clone: `make demo` put the base at .miles/models/base; a
    `miles-platform train --hf-checkpoint .miles/models/base --storage-root .miles` run (paths as
    typed) and an `rl_training` op run (paths absolute) both trained from it."""
    monkeypatch.chdir(tmp_path)
    paths = StoragePaths(".miles")
    shutil.copytree(tiny_hf_checkpoint, paths.model("base"))
    cli = build_run(paths, "cli", ".miles/models/base", 2, storage_root=".miles",
                    prompt_data=".miles/datasets/p.jsonl")  # fmt: skip
    build_run(paths, "op", paths.model("base"), 4, prompt_data=paths.join("datasets", "p.jsonl"))
    return paths, cli


ALL_FROM_BASE = {"cli.v000001", "cli.v000002", *(f"op.v00000{v}" for v in range(1, 5))}


def test_a_checkpoint_typed_relative_or_absolute_is_one_node(cli_and_op):
    paths, cli = cli_and_op
    for typed in (".miles/models/base", paths.model("base"), "./.miles/models/base/"):
        res = trace(paths, typed)
        assert res["target"] == paths.model("base")
        assert {n["id"] for n in res["downstream"]["nodes"]} == ALL_FROM_BASE, typed
    # what the reporter hands Dagster names the same paths
    assert cli[0].base_checkpoint == paths.model("base")
    assert cli[0].prompt_data == paths.join("datasets", "p.jsonl")


def test_the_compact_view_lists_downstream_versions_one_range_per_run(cli_and_op, capsys):
    paths, _ = cli_and_op
    assert cli_main([".miles/models/base", "--storage-root", ".miles"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"{paths.model('base')}  [checkpoint]")
    assert (
        "downstream (what came from it and its chain):\n"
        "  policy_version: cli.v000001, cli.v000002\n"
        "  policy_version: op.v000001 .. op.v000004 (4)\n"
    ) in text, text


def test_the_writer_records_paths_absolute_and_ids_as_they_are(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = StoragePaths("root")
    parents = [("r.v000001", "policy_version", "evaluates", None), ("data/eval.jsonl", "dataset", "evaluated_on", "h"),
               ("s3://bucket/base", "checkpoint", "trained_from", None), (None, "dataset", "prompt_data", None)]  # fmt: skip
    write_edges(paths, "r", [Edge("eval:r.v000001", "eval", *p) for p in parents])  # no parent: no row
    assert [(r["child"], r["parent"]) for r in read_rows(paths, "lineage", "r")] == [
        ("eval:r.v000001", "r.v000001"),
        ("eval:r.v000001", str(tmp_path / "data" / "eval.jsonl")),
        ("eval:r.v000001", "s3://bucket/base"),
    ]


def test_downstream_versions_of_two_runs_are_two_ranges(tmp_path, tiny_hf_checkpoint):
    paths = StoragePaths(str(tmp_path / "root"))
    for run in ("a", "b"):
        build_run(paths, run, tiny_hf_checkpoint, 4)
    text = format_compact(paths, tiny_hf_checkpoint)
    assert (
        "  policy_version: a.v000001 .. a.v000004 (4)\n  policy_version: b.v000001 .. b.v000004 (4)\n" in text
    )


def _old_record(paths, run: str, base_as_typed: str, base_hash: str) -> None:
    """What record_policy_version wrote before paths were made absolute: the base as typed."""
    key = partition_key(run, 1)
    row = {"version": 1, "partition_key": key, "parent_version": 0, "rollout_id": 0}
    append_rows(paths, "policy_versions", run, [row])
    edges = [
        {"child": key, "child_kind": "policy_version", "parent": base_as_typed, "parent_kind": "checkpoint",
         "relation": rel, "data_version": base_hash}
        for rel in ("trained_from", "base_checkpoint")
    ]  # fmt: skip
    append_rows(paths, "lineage", run, edges)


def test_rows_written_before_paths_were_absolute_are_found_from_anywhere(cli_and_op, tmp_path, monkeypatch):
    """Old rows recorded the base as typed. `old` ran with `--storage-root .miles` (its
    run_config.json says so), so it wrote from the dir holding .miles: its `.miles/models/base`
    resolves there. `lost` left no run_config.json (its cwd is unknowable): its `base` is matched by
    the base's content hash. Asked from another cwd, the absolute path finds both."""
    paths, _ = cli_and_op
    base_hash = content_hash(paths.model("base"))
    _old_record(paths, "old", ".miles/models/base", base_hash)
    cfg = RunConfig(run_name="old", hf_checkpoint=".miles/models/base", storage_root=".miles")
    Path(paths.checkpoints("old")).mkdir(parents=True)
    Path(paths.checkpoints("old"), "run_config.json").write_text(saved_config(cfg))
    _old_record(paths, "lost", "base", base_hash)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    res = trace(paths, paths.model("base"))
    assert {n["id"] for n in res["downstream"]["nodes"]} == ALL_FROM_BASE | {"old.v000001", "lost.v000001"}


def test_an_old_relative_base_is_found_by_the_content_of_the_path_asked(tmp_path, tiny_hf_checkpoint):
    """Only rows with an unresolvable relative base: the path asked is hashed and matched."""
    paths = StoragePaths(str(tmp_path / "root"))
    base = shutil.copytree(tiny_hf_checkpoint, paths.model("base"))
    _old_record(paths, "lost", "base", content_hash(base))
    res = trace(paths, str(base))
    assert res["target"] == "base" and [n["id"] for n in res["downstream"]["nodes"]] == ["lost.v000001"]
