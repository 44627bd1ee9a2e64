"""The `scoreboard` asset on a real store of two runs and a real Dagster instance: per-run rows with
the base (v0), the best version by the newest eval, the base evaluated once when no one did, and
the sensor that rebuilds it when new evals rows land."""

import json

import dagster as dg
import pytest
from store_builders import add_evals, build_run

from assets.scoreboard import scoreboard
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths
from miles_platform.store.scoreboard import read_scoreboard
from miles_platform.store.tables import read_rows
from resources.storage import StorageRootResource
from sensors.scoreboard import scoreboard_job, scoreboard_on_new_evals


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_hf_checkpoint):
    """`cli`: versions 1-3, evaluated in its loop, v0 included, v2 re-evaluated lower by the asset.
    `dag`: versions 1-2 evaluated by eval_results only (no base row), with its eval settings on
    its policy_versions materializations, as the rl_training op logs them."""
    tmp = tmp_path_factory.mktemp("scoreboard")
    paths = StoragePaths(str(tmp / "root"))
    build_run(paths, "cli", tiny_hf_checkpoint, 3)
    build_run(paths, "dag", tiny_hf_checkpoint, 2)
    add_evals(paths, "cli", [(0, 0.5, "loop"), (1, 0.6, "loop"), (2, 0.9, "loop"), (3, 0.8, "loop")])
    add_evals(paths, "cli", [(2, 0.7, "asset")], start_minute=10)  # newest wins: v3 is cli's best
    add_evals(paths, "dag", [(1, 0.9, "asset"), (2, 0.95, "asset")], start_minute=20)
    data = tmp / "eval.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(3))
    )
    eval_config = {"eval_prompt_data": ["eval", str(data)], "eval_max_response_len": 3, "rm_type": "math"}
    instance = dg.DagsterInstance.ephemeral()
    for v in (1, 2):
        key = f"dag.v{v:06d}"
        instance.add_dynamic_partitions("policy_versions", [key])
        instance.report_runless_asset_event(
            dg.AssetMaterialization(
                "policy_versions", partition=key, metadata={"eval_config": dg.MetadataValue.json(eval_config)}
            )
        )
    return paths, instance


def _materialize(paths, instance):
    res = dg.materialize(
        [scoreboard], instance=instance, resources={"storage": StorageRootResource(root=paths.root)}
    )
    assert res.success
    return res.asset_materializations_for_node("scoreboard")[0].metadata


def test_scoreboard_shows_base_and_best_version_per_run_never_mixing_runs(store):
    paths, instance = store
    md = _materialize(paths, instance)
    runs = {r.data["run"]: r.data for r in md["runs"].value.records}
    assert set(runs) == {"cli", "dag"}
    assert (runs["cli"]["metric"], runs["cli"]["base"], runs["cli"]["best_version"], runs["cli"]["best"]) == (
        "pass@1", 0.5, "cli.v000003", 0.8,
    )  # fmt: skip
    assert runs["cli"]["gain"] == pytest.approx(0.3)
    assert runs["dag"]["best_version"] == "dag.v000002" and runs["dag"]["evaluated_versions"] == 2
    # dag's base was never evaluated: the asset evaluated its base checkpoint with dag's eval settings
    base_rows = [r for r in read_rows(paths, "evals", "dag") if r["version"] == 0]
    assert {(r["metric"], r["source"], r["max_new_tokens"]) for r in base_rows} >= {("pass@1", "asset", 3)}
    assert isinstance(runs["dag"]["base"], float)
    full = md["all_versions"].value
    link = "](/assets/policy_versions?view=partitions&partition="
    cli = full[full.index("**cli**") : full.index("**dag**")]
    assert [line.split("|")[2:4] for line in cli.splitlines() if link in line] == [
        [" 50.0% ", " base "], [" 60.0% ", "  "], [" 70.0% ", "  "], [" 80.0% ", " best "],
    ]  # fmt: skip
    assert full.count(link) == 7  # one line per run and version
    text = md["scoreboard"].value
    assert f"| cli | eval | pass@1 | 50.0% | [v3{link}cli.v000003) 80.0% | +30.0 pts |" in text
    assert json.loads(json.dumps(md["best_versions"].value)) == {"cli": "cli.v000003", "dag": "dag.v000002"}

    # materialized again: the base row is there, nothing is evaluated twice
    n = len(read_rows(paths, "evals", "dag"))
    _materialize(paths, instance)
    assert len(read_rows(paths, "evals", "dag")) == n


def test_a_base_that_is_gone_is_said_not_guessed(tmp_path, tiny_hf_checkpoint):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_hf_checkpoint, base)
    paths = StoragePaths(str(tmp_path / "root"))
    build_run(paths, "gone", str(base), 1)
    add_evals(paths, "gone", [(1, 0.4, "asset")])
    shutil.rmtree(base)
    md = _materialize(paths, dg.DagsterInstance.ephemeral())
    (row,) = [r.data for r in md["runs"].value.records]
    assert (row["run"], row["base"], row["best_version"]) == ("gone", None, "gone.v000001")
    assert f"gone: base not evaluated: base checkpoint {base} not found" in md["scoreboard"].value
    assert read_scoreboard(Catalog(paths)).score("gone").gain is None


def _tick(instance, root, cursor):
    defs = dg.Definitions(
        assets=[scoreboard], jobs=[scoreboard_job], sensors=[scoreboard_on_new_evals],
        resources={"storage": StorageRootResource(root=root)},
    )  # fmt: skip
    storage = {"storage": StorageRootResource(root=root)}
    ctx = dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs, resources=storage)
    data = scoreboard_on_new_evals.evaluate_tick(ctx)
    return data.run_requests, data.cursor


def test_sensor_asks_for_one_rebuild_per_batch_of_new_evals(tmp_path, tiny_hf_checkpoint, monkeypatch):
    paths = StoragePaths(str(tmp_path / "root"))
    instance = dg.DagsterInstance.ephemeral()
    _at(monkeypatch, 3600)  # each batch has settled
    assert _tick(instance, paths.root, None)[0] == []  # no evals yet
    build_run(paths, "r", tiny_hf_checkpoint, 2)
    add_evals(paths, "r", [(1, 0.5, "loop")])
    requests, cursor = _tick(instance, paths.root, None)
    assert len(requests) == 1 and requests[0].job_name in (None, "update_scoreboard")
    assert _tick(instance, paths.root, cursor)[0] == []  # nothing new
    add_evals(paths, "r", [(2, 0.6, "loop")], start_minute=5)
    again, cursor2 = _tick(instance, paths.root, cursor)
    assert len(again) == 1 and again[0].run_key != requests[0].run_key and cursor2 != cursor


# ---------------------------------------------------------------- one rebuild per burst (issue 48)
def _unevaluated_base(tmp_path, tiny_hf_checkpoint):
    """A run `r` with v1 evaluated by eval_results and no base row: the scoreboard evaluates its base."""
    paths = StoragePaths(str(tmp_path / "root"))
    build_run(paths, "r", tiny_hf_checkpoint, 1)
    add_evals(paths, "r", [(1, 0.5, "asset")])
    data = tmp_path / "eval.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(2))
    )
    config = {"eval_prompt_data": ["eval", str(data)], "eval_max_response_len": 2, "rm_type": "math"}
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("policy_versions", ["r.v000001"])
    instance.report_runless_asset_event(
        dg.AssetMaterialization("policy_versions", partition="r.v000001",
                                metadata={"eval_config": dg.MetadataValue.json(config)})
    )  # fmt: skip
    return paths, instance


def _at(monkeypatch, seconds_after_now: float) -> None:
    """The sensor's clock, `seconds_after_now` from the real one."""
    import time

    t = time.time() + seconds_after_now
    monkeypatch.setattr("sensors.scoreboard._now", lambda: t, raising=False)


def test_the_scoreboards_own_base_eval_does_not_trigger_it_again(tmp_path, tiny_hf_checkpoint, monkeypatch):
    paths, instance = _unevaluated_base(tmp_path, tiny_hf_checkpoint)
    _at(monkeypatch, 3600)
    requests, cursor = _tick(instance, paths.root, None)
    assert len(requests) == 1
    n = len(read_rows(paths, "evals", "r"))
    _materialize(paths, instance)  # the run the sensor asked for: evaluates r's base into `evals`
    assert len(read_rows(paths, "evals", "r")) > n
    assert _tick(instance, paths.root, cursor)[0] == []  # its own rows ask for no second run


def test_a_burst_of_evals_is_one_rebuild_once_it_settles(tmp_path, tiny_hf_checkpoint, monkeypatch):
    """Evals land one per tick (a sensor eval burst): no rebuild while they come, one after a quiet
    period, none after that until new rows land."""
    paths = StoragePaths(str(tmp_path / "root"))
    build_run(paths, "r", tiny_hf_checkpoint, 3)
    instance = dg.DagsterInstance.ephemeral()
    cursor, asked = None, []
    for v in (1, 2, 3):
        add_evals(paths, "r", [(v, 0.5, "asset")], start_minute=v)
        _at(monkeypatch, 1)  # the next tick comes right after the row
        requests, cursor = _tick(instance, paths.root, cursor)
        asked += requests
    assert asked == []
    _at(monkeypatch, 600)  # quiet for 10 minutes
    requests, cursor = _tick(instance, paths.root, cursor)
    assert len(requests) == 1
    assert _tick(instance, paths.root, cursor)[0] == []  # requested already: nothing twice


def test_a_steady_stream_of_evals_still_rebuilds_after_the_longest_wait():
    from sensors.scoreboard import RebuildPolicy, plan_rebuild

    def name(t: float) -> str:
        return f"part-{int(t * 1e9):020d}-0000abcd.parquet"

    policy, t0 = RebuildPolicy(quiet_s=120, max_wait_s=900), 1.8e9
    built = f"1:{name(t0)}"  # the board has the first file
    names = [name(t0 + 60 * i) for i in range(20)]  # then one eval a minute
    rebuild = {i: plan_rebuild(names[: i + 1], built, None, t0 + 60 * i + 5, policy)[0] for i in range(1, 20)}
    waited_900_s = [i for i, r in rebuild.items() if r]  # since the oldest file the board lacks (t0 + 60)
    assert waited_900_s == list(range(16, 20))
    assert plan_rebuild(names, f"{len(names)}:{names[-1]}", None, t0 + 9999, policy) == (
        False, "the scoreboard is up to date with the evals table",
    )  # fmt: skip


# ---------------------------------------------------------------- every run kind, any number of runs (issue 48)
def _diffusion_evals(paths, run: str, rewards: list[float]) -> None:
    """What the diffusion loop writes: `mean_reward` per eval set, from v0 on, no pass@1."""
    from store_builders import T0

    from miles_platform.store.tables import append_rows

    rows = [
        {"version": v, "partition_key": f"{run}.v{v:06d}", "dataset": "heldout", "metric": "mean_reward",
         "value": r, "n_samples": 8, "source": "loop", "temperature": None, "top_p": None, "top_k": None,
         "max_new_tokens": None, "created_at": T0}
        for v, r in enumerate(rewards)
    ]  # fmt: skip
    append_rows(paths, "evals", run, rows)


def test_a_diffusion_run_is_listed_by_its_mean_reward(tmp_path, tiny_hf_checkpoint):
    paths = StoragePaths(str(tmp_path / "root"))
    build_run(paths, "llm", tiny_hf_checkpoint, 2)
    add_evals(paths, "llm", [(0, 0.5, "loop"), (2, 0.75, "loop")])
    _diffusion_evals(paths, "dit", [0.2, 0.3, 0.5, 0.4])
    md = _materialize(paths, dg.DagsterInstance.ephemeral())
    runs = {r.data["run"]: r.data for r in md["runs"].value.records}
    assert set(runs) == {"llm", "dit"}
    assert (runs["llm"]["metric"], runs["llm"]["best_version"]) == ("pass@1", "llm.v000002")
    dit = runs["dit"]
    assert (dit["metric"], dit["dataset"], dit["base"], dit["best_version"], dit["best"]) == (
        "mean_reward", "heldout", 0.2, "dit.v000002", 0.5,
    )  # fmt: skip
    assert "| dit | heldout | mean_reward |" in md["scoreboard"].value


def test_the_scoreboard_reads_inline_at_any_number_of_runs_and_links_versions(tmp_path, tiny_hf_checkpoint):
    """The Dagster UI shows markdown under 1000 characters inline (else "[Show Markdown]"): the
    compact board keeps to it with the best runs; the full tables hold every run and version."""
    paths = StoragePaths(str(tmp_path / "root"))
    build_run(paths, "r00", tiny_hf_checkpoint, 1)  # its base checkpoint: lineage for every run below
    for i in range(12):
        add_evals(paths, f"r{i:02d}", [(0, 0.4, "loop"), (5, 0.5 + i / 100, "loop"), (10, 0.45, "loop")])
    md = _materialize(paths, dg.DagsterInstance.ephemeral())
    board = md["scoreboard"].value
    assert len(board) < 1000, len(board)
    link = "(/assets/policy_versions?view=partitions&partition=r11.v000005)"
    assert f"[r11.v000005]{link}" in board or f"[v5]{link}" in board  # the best run first, linked
    assert "more run" in board  # says that the rest are in the full tables
    assert len(md["runs"].value.records) == 12
    full = md["all_versions"].value
    assert full.count("/assets/policy_versions?view=partitions&partition=") == 36  # every version, linked
