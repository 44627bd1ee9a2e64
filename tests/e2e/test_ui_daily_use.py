"""Issue 48's acceptance test: a day of use as the README has it, `make ui` running and a CLI run
beside it, shows no eval flood, no red check and one lineage per checkpoint.

The store: `make demo`'s base at .miles/models/base and its eval dataset; `make demo-diffusion`'s
run `dit`; a LoRA run `lora` launched from the Launchpad (paths absolute, as the op records them);
and the README's `miles-platform train --hf-checkpoint .miles/models/base ... --run-name mine`
typed in the clone, without `--eval-interval` (paths as typed), 25 versions. The runs are written
by the store's own writers (tests/store_builders.py), as training leaves them.

`make ui` is the webserver (a subprocess, as in test_ui_browser.py) and the daemon. The daemon's
sensor loop runs here: Dagster's own `execute_sensor_iteration` on the same code location and
instance, one iteration per sensor interval (the 30/60 s waits skipped). The runs it requests are
queued as under `dagster dev`; the health-check and scoreboard runs are dequeued and launched as
the run queue launches them (here in this process, steps in process). The `evaluate_policy` runs
stay queued (each is tens of seconds): what matters is which the sensor asks for; their `evals`
rows are written as each eval would write them, one burst. The code location loads in this process
under its workspace.yaml name, so the webserver shows the daemon's ticks and runs as its own.
"""

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_ui_browser import REPO, _graphql, browser, dagster_webserver, materialize_eval_dataset, new_page

pytestmark = [pytest.mark.browser, pytest.mark.slow]
__all__ = ["browser"]  # the module fixture, shared with test_ui_browser.py

TELEMETRY_OFF = "telemetry:\n  enabled: false\n"
# the webserver launches what the UI launches at once; the daemon's instance queues what sensors
# request (dagster dev's QueuedRunCoordinator) and launches a dequeued run in this process
DAGSTER_YAML = TELEMETRY_OFF + (
    "run_coordinator:\n  module: dagster._core.run_coordinator\n  class: DefaultRunCoordinator\n"
)
DAEMON_YAML = TELEMETRY_OFF + (
    "run_coordinator:\n  module: dagster._core.run_coordinator\n  class: QueuedRunCoordinator\n"
    "run_launcher:\n  module: dagster._core.launcher.sync_in_memory_run_launcher\n"
    "  class: SyncInMemoryRunLauncher\n"
)
CLI_VERSIONS = 25
EVALS_DUE = {"mine.v000010", "mine.v000020", "mine.v000025", "lora.v000002"}  # every 10th + final
HEALTH_CHECKS = [  # assets/run_health.py
    ("rollout_shards", "contiguous_rollout_ids"),
    ("rollout_shards", "async_staleness"),
    ("rollout_shards", "prompt_coverage"),
    ("policy_versions", "expected_version_count"),
    ("policy_versions", "hf_export_sanity"),
]
IN_PROCESS = {"execution": {"config": {"in_process": {}}}}
QUIET_S = 121  # the scoreboard sensor rebuilds after 2 quiet minutes


class Daemon:
    """`make ui`'s sensor daemon and run queue, driven one iteration at a time."""

    def __init__(self, instance, workspace):
        self.instance, self.workspace = instance, workspace
        self.log = logging.getLogger("miles.test.daemon")

    def tick(self) -> None:
        """One sensor-daemon iteration in which every sensor is due."""
        from dagster._daemon.sensor import execute_sensor_iteration

        list(execute_sensor_iteration(self.workspace, self.log, None, None))

    def runs(self, job: str) -> list:
        import dagster as dg

        return list(reversed(self.instance.get_runs(dg.RunsFilter(job_name=job))))  # oldest first

    def launch(self, run) -> None:
        """What the run queue does with a queued run: launch it (here, in this process)."""
        self.instance.launch_run(run.run_id, self.workspace.create_request_context())


def _in_process(job, run, instance):
    """The launched run's steps in this process, not one subprocess each (~20 s apiece here)."""
    from dagster._core.execution.api import execute_run

    return execute_run(job, run._replace(run_config={**run.run_config, **IN_PROCESS}), instance)


@contextlib.contextmanager
def make_ui_daemon(root: Path):
    import dagster as dg
    from dagster._core.remote_origin import InProcessCodeLocationOrigin
    from dagster._core.test_utils import create_test_daemon_workspace_context
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
    from dagster._core.workspace.load_target import InProcessWorkspaceLoadTarget

    target = LoadableTargetOrigin(
        executable_path=sys.executable, python_file=str(REPO / "definitions.py"), working_directory=str(REPO)
    )
    origin = InProcessCodeLocationOrigin(target, location_name="miles_platform")  # workspace.yaml's name
    with (
        pytest.MonkeyPatch.context() as mp,
        dg.DagsterInstance.from_config(str(root / "dagster"), config_filename="daemon.yaml") as instance,
    ):
        mp.setenv("MILES_STORAGE_ROOT", str(root))  # as `make ui` sets it for the code location
        # definitions.py binds the storage root when it loads: load it afresh, not another test's
        mp.delitem(sys.modules, "definitions", raising=False)
        mp.setattr("dagster._daemon.sensor.is_under_min_interval", lambda *_: False)
        mp.setattr("dagster._core.launcher.sync_in_memory_run_launcher.execute_run", _in_process)
        with create_test_daemon_workspace_context(InProcessWorkspaceLoadTarget(origin), instance) as ws:
            yield Daemon(instance, ws), mp


def _write_runs(clone: Path, tiny_hf_checkpoint: str) -> None:
    from store_builders import build_run, save_tiny_pipeline

    from miles_platform.store.paths import StoragePaths

    root = clone / ".miles"
    paths = StoragePaths(str(root))
    shutil.copytree(tiny_hf_checkpoint, paths.model("base"))  # make demo's SFT base
    prompts = clone.parent / "task" / "train.jsonl"  # the README's /tmp/task/train.jsonl
    prompts.parent.mkdir()
    prompts.write_text(
        "".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(4))
    )
    batch = dict(prompt_data=str(prompts), rollout_batch_size=4, n_samples_per_prompt=1, global_batch_size=4)
    # make demo-diffusion: a diffusers pipeline run whose loop evaluates it
    dit_base = save_tiny_pipeline(root / "models" / "dit_base")
    build_run(paths, "dit", dit_base, 2, **batch)
    Path(paths.run_dir("dit"), "diffusion_config.json").write_text(
        json.dumps({"run_name": "dit", "hf_checkpoint": dit_base, "storage_root": str(root)})
    )
    build_run(paths, "lora", paths.model("base"), 2, lora_rank=2, **batch)  # from the Launchpad
    with contextlib.chdir(clone):  # typed in the clone, paths relative
        build_run(paths, "mine", ".miles/models/base", CLI_VERSIONS, storage_root=".miles", **batch)


def _eval_burst(daemon: Daemon, mp: pytest.MonkeyPatch) -> None:
    """The queued evals finish one after another, each writing its rows, the sensors ticking in
    between; two quiet minutes later the scoreboard's rebuild runs and the sensors tick again."""
    from store_builders import add_evals

    import sensors.scoreboard
    from miles_platform.store.paths import StoragePaths, parse_partition_key

    paths = StoragePaths(os.environ["MILES_STORAGE_ROOT"])
    for i, run in enumerate(daemon.runs("evaluate_policy")):
        name, version = parse_partition_key(run.tags["dagster/partition"])
        add_evals(paths, name, [(version, 0.6 + version / 100, "asset")], start_minute=i)
        daemon.tick()
    mp.setattr(sensors.scoreboard, "_now", lambda: time.time() + QUIET_S, raising=False)
    daemon.tick()
    rebuilds = daemon.runs("update_scoreboard")
    if rebuilds:
        daemon.launch(rebuilds[-1])  # evaluates the bases (v0) of mine and lora
        daemon.tick()


@dataclass
class Day:
    base: str  # the webserver's URL
    clone: Path  # the user's clone: `make` and `miles-platform` run here
    root: Path  # its storage root .miles


@pytest.fixture(scope="module")
def day(tmp_path_factory, tiny_hf_checkpoint):
    clone = tmp_path_factory.mktemp("day") / "clone"
    root = clone / ".miles"
    (root / "dagster").mkdir(parents=True)
    (root / "dagster" / "dagster.yaml").write_text(DAGSTER_YAML)
    (root / "dagster" / "daemon.yaml").write_text(DAEMON_YAML)
    import dagster as dg

    # the instance's SQLite storages (runs, events, schedules) made once, before the webserver and
    # the daemon open them side by side: two first openings raced on alembic's version table
    # ("more than one head present") in a full `make test`
    with dg.DagsterInstance.from_config(str(root / "dagster")) as instance:
        instance.get_runs(limit=1)
        instance.all_instigator_state()
    with dagster_webserver(root) as (base, wait_ready):
        _write_runs(clone, tiny_hf_checkpoint)
        with make_ui_daemon(root) as (daemon, mp):
            materialize_eval_dataset(daemon.instance, root)  # make demo's
            for _ in range(8):  # the CLI run's versions reach Dagster; the sensors react until idle
                before = len(daemon.instance.get_runs())
                daemon.tick()
                if len(daemon.instance.get_runs()) == before and daemon.runs("evaluate_policy"):
                    break
            for run in daemon.runs("check_run_health"):  # one per run that ended
                daemon.launch(run)
            _eval_burst(daemon, mp)
        wait_ready()
        yield Day(base, clone, root)


@pytest.fixture(scope="module")
def page(browser, day):
    pg = new_page(browser)
    yield pg
    pg.close()


RUNS = """{ runsOrError(filter: {pipelineName: "%s"}) { ... on Runs { results { runId status
  tags { key value } } } } }"""
TICKS = """{ sensorOrError(sensorSelector: {repositoryLocationName: "miles_platform",
  repositoryName: "__repository__", sensorName: "%s"}) { ... on Sensor { sensorState { ticks(limit: 100) {
  status runIds } } } } }"""
PARTITIONS = """{ assetNodeOrError(assetKey: {path: ["policy_versions"]}) { ... on AssetNode {
  partitionKeysByDimension { partitionKeys } } } }"""


def _runs(base: str, job: str) -> list[dict]:
    runs = _graphql(base, RUNS % job)["runsOrError"]["results"]
    return [{**r, "tags": {t["key"]: t["value"] for t in r["tags"]}} for r in runs]


def test_a_cli_run_beside_make_ui_is_evaluated_every_10th_and_last_version_not_each(day, page):
    """No flood: the 25 versions of `mine` (no --eval-interval) reach Dagster and get evals of v10,
    v20 and v25, the LoRA run of its final version (the diffusion run evaluates itself), at most 2
    per tick; the burst of their results rebuilds the scoreboard once, and the rebuild's own base
    evals do not trigger another."""
    from playwright.sync_api import expect

    (dim,) = _graphql(day.base, PARTITIONS)["assetNodeOrError"]["partitionKeysByDimension"]
    assert {f"mine.v{v:06d}" for v in range(1, CLI_VERSIONS + 1)} <= set(dim["partitionKeys"])
    evals = _runs(day.base, "evaluate_policy")
    requested = sorted(r["tags"]["dagster/partition"] for r in evals)
    assert requested == sorted(EVALS_DUE), f"{len(evals)} eval runs requested: {requested}"
    assert {r["tags"].get("dagster/sensor_name") for r in evals} == {"eval_on_new_policy"}
    ticks = _graphql(day.base, TICKS % "eval_on_new_policy")["sensorOrError"]["sensorState"]["ticks"]
    assert max(len(t["runIds"]) for t in ticks) <= 2, ticks
    rebuilds = _runs(day.base, "update_scoreboard")
    assert len(rebuilds) == 1, f"{len(rebuilds)} scoreboard rebuilds for one burst of evals"
    assert rebuilds[0]["status"] == "SUCCESS", rebuilds

    page.goto(f"{day.base}/runs?q%5B0%5D=job%3Aevaluate_policy")  # Runs, filtered by job
    partitions = page.get_by_text(re.compile(r"^partition: "))
    expect(partitions.first).to_be_visible()
    page.screenshot(path=str(day.root / "ui_eval_runs.png"))
    assert sorted(partitions.all_inner_texts()) == sorted(f"partition: {k}" for k in EVALS_DUE)


CHECK_RUNS = """{ assetCheckExecutions(assetKey: {path: ["%s"]}, checkName: "%s", limit: 10) {
  status runId evaluation { metadataEntries { label ... on MarkdownMetadataEntry { mdStr } } } } }"""


def test_no_check_is_red_on_llm_lora_and_diffusion_versions(day, page):
    """No red check: the run-health checks the catalog sensor asked for when each run's last version
    came in all passed, the LLM, LoRA and diffusion versions each checked as what they are; the
    asset's Checks tab shows them passed."""
    from playwright.sync_api import expect

    health = _runs(day.base, "check_run_health")
    assert {r["tags"].get("miles/run") for r in health} == {"mine", "lora", "dit"}
    assert {r["status"] for r in health} == {"SUCCESS"}, health
    for asset, name in HEALTH_CHECKS:
        execs = _graphql(day.base, CHECK_RUNS % (asset, name))["assetCheckExecutions"]
        assert [e["status"] for e in execs] == ["SUCCEEDED"] * len(health), (name, execs)
    latest = _graphql(day.base, CHECK_RUNS % ("policy_versions", "hf_export_sanity"))["assetCheckExecutions"][
        0
    ]
    per_run = next(e["mdStr"] for e in latest["evaluation"]["metadataEntries"] if e["label"] == "per_run")
    for row in ("| mine | hf_llm | 25 |", "| lora | peft_adapter | 2 |", "| dit | diffusers_pipeline | 2 |"):
        assert row in per_run, per_run

    page.goto(f"{day.base}/assets/policy_versions?view=checks&checkDetail=hf_export_sanity")
    expect(page.get_by_text("Evaluation result")).to_be_visible()
    expect(page.get_by_text("Succeeded")).to_have_count(2)  # expected_version_count, hf_export_sanity
    expect(page.get_by_text("Passed", exact=True)).to_be_visible()
    page.get_by_role("row").filter(has_text="per_run").get_by_text("[Show Markdown]").click()
    expect(page.get_by_role("dialog").get_by_text("diffusers_pipeline")).to_be_visible()
    page.screenshot(path=str(day.root / "ui_checks.png"))
    assert "Failed" not in page.inner_text("body")


def _lineage(day: Day, target: str) -> str:
    """`miles-platform lineage TARGET` typed in the clone (storage root: the default .miles)."""
    env = {k: v for k, v in os.environ.items() if k != "MILES_STORAGE_ROOT"} | {"PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "miles_platform.cli", "lineage", target],
        cwd=day.clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_base_typed_relative_or_absolute_is_one_lineage(day):
    """One lineage: the README's `lineage .miles/models/base` and the absolute path list the same
    versions downstream, one range per run (the CLI run's paths were typed, the Launchpad's absolute)."""
    relative = _lineage(day, ".miles/models/base")
    absolute = _lineage(day, str(day.root / "models" / "base"))
    down = [
        text.split("downstream (what came from it and its chain):\n", 1)[1] for text in (relative, absolute)
    ]
    assert down[0] == down[1], (relative, absolute)
    assert "  policy_version: lora.v000001, lora.v000002\n" in down[0], relative
    assert f"  policy_version: mine.v000001 .. mine.v{CLI_VERSIONS:06d} ({CLI_VERSIONS})\n" in down[0], (
        relative
    )
