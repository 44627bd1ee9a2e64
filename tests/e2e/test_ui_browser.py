"""The Dagster UI, driven by a real headless Chromium against `dagster-webserver` on our code location.

A user opens the asset graph and sees the lineage prompt_dataset / base_checkpoint ->
rollout_shards -> policy_versions -> eval_results, finds a policy version on the Partitions
page, and materializes eval_results for it from the UI (the run executes in a subprocess via
the default run launcher). Screenshots land in docs/ui_*.png with MILES_UI_SCREENSHOTS=1.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from browser import chromium

from miles_platform.cluster.ports import free_port

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
# screenshots: docs/ when MILES_UI_SCREENSHOTS=1 (to refresh the README images), else a temp dir
DOCS = (
    REPO / "docs"
    if os.environ.get("MILES_UI_SCREENSHOTS") == "1"
    else Path(tempfile.mkdtemp(prefix="miles-ui-shots-"))
)
KEY = "demo.v000001"
CLI_RUN = "cli"  # trained outside Dagster
PIPELINE = (
    "prompt_dataset",
    "base_checkpoint",
    "rollout_shards",
    "policy_versions",
    "eval_dataset",
    "eval_results",
)
# webserver only (no daemon), so runs must launch at once instead of waiting in the daemon's queue
DAGSTER_YAML = """telemetry:
  enabled: false
run_coordinator:
  module: dagster._core.run_coordinator
  class: DefaultRunCoordinator
"""


@pytest.fixture(scope="module")
def browser():
    with chromium(1400, 900) as ctx:
        yield ctx


def _prepare_root(root: Path, tiny_hf_checkpoint: str) -> None:
    """A storage root + Dagster instance with one policy version and a 4-row eval dataset."""
    import dagster as dg

    from miles_platform.store.paths import StoragePaths

    paths = StoragePaths(str(root))
    (root / "dagster").mkdir(parents=True)
    (root / "dagster" / "dagster.yaml").write_text(DAGSTER_YAML)
    hf = paths.hf_export("demo", 1)
    shutil.copytree(tiny_hf_checkpoint, hf)
    with dg.DagsterInstance.from_config(str(root / "dagster")) as instance:
        materialize_eval_dataset(instance, root)
        instance.add_dynamic_partitions("policy_versions", [KEY])
        instance.report_runless_asset_event(
            dg.AssetMaterialization(
                "policy_versions", partition=KEY, metadata={"hf_path": dg.MetadataValue.path(hf)}
            )
        )
        _cli_runs(paths, instance, tiny_hf_checkpoint)


def materialize_eval_dataset(instance, root: Path) -> None:
    """The `eval_dataset` asset from a 4-row `root`/eval.jsonl (sums of two digits)."""
    import dagster as dg

    from assets.datasets import eval_dataset
    from resources.storage import StorageRootResource

    data = root / "eval.jsonl"
    rows = [{"prompt": f"What is {a}+{b}?", "label": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = dg.materialize(
        [eval_dataset],
        instance=instance,
        resources={"storage": StorageRootResource(root=str(root))},
        run_config={
            "ops": {
                "eval_dataset": {"config": {"path": str(data), "input_key": "prompt", "label_key": "label"}}
            }
        },
    )
    assert res.success


def _cli_runs(paths, instance, tiny_hf_checkpoint: str) -> None:
    """Two runs trained with `miles-platform train` (store writers only, no Dagster events), their
    loop's evals with the base (v0), reported by `runs_from_catalog` as the daemon would, and the
    scoreboard built from them."""
    import dagster as dg
    from store_builders import add_evals, apply_sensor_tick, build_run

    from assets.scoreboard import scoreboard
    from resources.storage import StorageRootResource
    from sensors.catalog_runs import runs_from_catalog

    build_run(paths, CLI_RUN, tiny_hf_checkpoint, 3, rewards=[0.4, 0.6, 0.7])
    build_run(paths, "sweep", tiny_hf_checkpoint, 2, rewards=[0.5, 0.5])
    add_evals(paths, CLI_RUN, [(0, 0.602, "loop"), (1, 0.75, "loop"), (2, 0.898, "loop"), (3, 0.86, "loop")])
    add_evals(paths, "sweep", [(0, 0.602, "loop"), (1, 0.7, "loop"), (2, 0.65, "loop")], start_minute=10)
    assert apply_sensor_tick(runs_from_catalog, instance, paths.root).asset_events
    res = dg.materialize(
        [scoreboard], instance=instance, resources={"storage": StorageRootResource(root=paths.root)}
    )
    assert res.success


def _idle_while_it_runs(page, run: dict | None) -> None:
    """Once the launched run exists, leave the live run page for a blank one while the test polls
    its status over GraphQL: the page re-renders every streamed event (~10 CPU-seconds of Chromium
    and webserver per minute on this 2-core machine, taken from the run itself)."""
    if run is not None and page.url != "about:blank":
        page.goto("about:blank")


def _graphql(base: str, query: str) -> dict:
    req = urllib.request.Request(
        f"{base}/graphql",
        data=json.dumps({"query": query}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)["data"]


ASSET_EDGES = "{ assetNodes { assetKey { path } dependencyKeys { path } } }"


@contextlib.contextmanager
def dagster_webserver(root: Path):
    """`make ui`'s webserver on the storage root `root` (DAGSTER_HOME `root`/dagster): started at
    once, yields (base URL, wait_ready); wait_ready() returns once the code location has loaded."""
    port = free_port()
    env = {
        **os.environ,
        "DAGSTER_HOME": str(root / "dagster"),
        "MILES_STORAGE_ROOT": str(root),
        "OMP_NUM_THREADS": "1",
    }
    log_path = root / "webserver.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    cmd = [
        sys.executable,
        "-m",
        "dagster_webserver",
        "-w",
        "workspace.yaml",
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
    ]
    # own session (setsid): the webserver ignores SIGINT, so SIGTERM goes to the whole group
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"

    def wait_ready(timeout_s: float = 90) -> None:
        deadline = time.time() + timeout_s
        while True:
            assert proc.poll() is None, f"webserver exited: {log_path.read_text()[-3000:]}"
            try:
                nodes = _graphql(base, ASSET_EDGES)["assetNodes"]
                if any(n["assetKey"]["path"] == ["eval_results"] for n in nodes):
                    return
            except OSError:
                pass
            assert time.time() < deadline, f"webserver not ready: {log_path.read_text()[-3000:]}"
            time.sleep(0.5)

    try:
        yield base, wait_ready
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="module")
def webserver(tmp_path_factory, tiny_hf_checkpoint):
    root = tmp_path_factory.mktemp("ui") / "root"
    _prepare_root(root, tiny_hf_checkpoint)
    with dagster_webserver(root) as (base, wait_ready):
        wait_ready()
        yield base, root


def new_page(browser):
    """A page whose waits fit a loaded CI machine, with Dagster's first-visit dialog dismissed."""
    from playwright.sync_api import expect

    pg = browser.new_page()
    pg.set_default_timeout(30_000)
    expect.set_options(timeout=30_000)  # a loaded CI machine renders the graph slowly
    # first visit of an instance shows a newsletter dialog over everything: dismiss it whenever it shows
    # (a DOM click event: when it opens over the partition picker, the picker's portal takes pointer clicks)
    pg.add_locator_handler(
        pg.get_by_text("Join the Dagster community"),
        lambda: pg.get_by_role("button", name="Skip").dispatch_event("click"),
    )
    return pg


@pytest.fixture(scope="module")
def page(browser, webserver):
    pg = new_page(browser)
    yield pg
    pg.close()


def _section(text: str, start: str, end: str) -> str:
    return text.split(start, 1)[1].split(end, 1)[0]


def test_asset_graph_shows_pipeline_and_edges(page, webserver):
    from playwright.sync_api import expect

    base, _ = webserver
    page.goto(f"{base}/assets/eval_results?view=lineage&lineageScope=upstream&lineageDepth=5")
    for name in PIPELINE:
        expect(page.get_by_text(name, exact=True).first).to_be_visible()
    page.wait_for_timeout(1000)  # let the edges finish animating for the screenshot
    page.screenshot(path=str(DOCS / "ui_asset_graph.png"))

    # edges as the UI lists them on each asset's overview
    page.goto(f"{base}/assets/policy_versions")
    expect(page.get_by_text("Downstream assets")).to_be_visible()
    expect(page.get_by_role("link", name="eval_results").first).to_be_visible()
    body = page.inner_text("body")
    assert {"rollout_shards", "base_checkpoint"} <= set(
        _section(body, "Upstream assets", "Downstream assets").split()
    )
    assert "eval_results" in _section(body, "Downstream assets", "Definition").split()

    # ... and as the webserver's GraphQL API (what the graph is drawn from) has them
    deps = {
        n["assetKey"]["path"][0]: {d["path"][0] for d in n["dependencyKeys"]}
        for n in _graphql(base, ASSET_EDGES)["assetNodes"]
    }
    assert {"policy_versions", "eval_dataset"} <= deps["eval_results"]
    assert {"rollout_shards", "base_checkpoint"} <= deps["policy_versions"]
    assert {"prompt_dataset", "base_checkpoint"} <= deps["rollout_shards"]


def test_policy_versions_lists_its_partitions(page, webserver):
    from playwright.sync_api import expect

    base, _ = webserver
    page.goto(f"{base}/assets/policy_versions?view=partitions")
    partition = page.get_by_text(KEY, exact=True).filter(visible=True).first
    expect(partition).to_be_visible()
    partition.click()
    expect(page.get_by_text("hf_path").first).to_be_visible()  # the selected partition's metadata
    page.screenshot(path=str(DOCS / "ui_policy_versions_partitions.png"))


def test_materialize_eval_results_from_the_ui(page, webserver):
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
    from playwright.sync_api import expect

    from miles_platform.store.paths import StoragePaths
    from miles_platform.store.tables import read_rows

    base, root = webserver
    page.goto(f"{base}/assets/eval_results")
    page.get_by_role("button", name="Materialize…").first.click()
    dialog = page.get_by_role("dialog")
    expect(dialog.get_by_text("Launch runs to materialize eval_results")).to_be_visible()
    # the partition's checkbox row; the first-visit newsletter dialog, dismissed by the locator
    # handler, can close the picker while it opens: open it again then
    for attempt in range(3):
        dialog.get_by_text("Select a partition or create one").click()
        try:
            page.get_by_text(KEY, exact=True).filter(visible=True).first.click(timeout=20_000)
            break
        except PlaywrightTimeoutError:
            if attempt == 2:
                raise
    dialog.get_by_text("Launch runs to materialize eval_results").click()  # close the partition picker
    dialog.get_by_role("button", name="Launch 1 run").click()

    runs_query = "{ runsOrError { ... on Runs { results { runId status tags { key value } } } } }"
    deadline, run = time.time() + 300, None  # a run subprocess imports dagster+torch: slow under load
    while time.time() < deadline:
        runs = _graphql(base, runs_query)["runsOrError"]["results"]
        run = next((r for r in runs if {"key": "dagster/partition", "value": KEY} in r["tags"]), None)
        if run and run["status"] in ("SUCCESS", "FAILURE", "CANCELED"):
            break
        _idle_while_it_runs(page, run)
        time.sleep(1)
    assert run is not None, "no run was launched for the partition"
    assert run["status"] == "SUCCESS", f"eval run {run['runId']} ended {run['status']}"

    page.goto(f"{base}/assets/eval_results")
    expect(page.get_by_text("eval/pass@1").first).to_be_visible()
    expect(page.get_by_text(KEY).first).to_be_visible()
    page.screenshot(path=str(DOCS / "ui_eval_materialized.png"))
    rows = read_rows(StoragePaths(str(root)), "evals", "demo")
    assert {(r["partition_key"], r["metric"]) for r in rows} >= {
        (KEY, "pass@1"),
        (KEY, "pass@1(T=1)"),  # one sample at EvalConfig's temperature 1, named so
        (KEY, "mean_reward@1(T=1)"),
    }


def test_scoreboard_shows_base_and_best_version_per_run(page, webserver):
    from playwright.sync_api import expect

    base, _ = webserver
    page.goto(f"{base}/assets/scoreboard?view=events")
    # the latest materialization's metadata: the summary (one line per run, base and best version)
    expect(page.get_by_text("+29.6 pts").first).to_be_visible()
    page.wait_for_timeout(500)
    page.screenshot(path=str(DOCS / "ui_scoreboard.png"))
    body = page.inner_text("body")
    assert "cli.v000002" in body and "60.2%" in body and "89.8%" in body, body[-3000:]
    assert "+9.8 pts" in body and "sweep.v000001" in body  # sweep: v1 70.0% over its base, apart from cli


def test_a_cli_launched_runs_versions_appear_as_partitions(page, webserver):
    from playwright.sync_api import expect

    base, _ = webserver
    page.goto(f"{base}/assets/policy_versions?view=partitions")
    partition = page.get_by_text(f"{CLI_RUN}.v000003", exact=True).filter(visible=True).first
    expect(partition).to_be_visible()
    partition.click()
    expect(page.get_by_text("runs_from_catalog").first).to_be_visible()  # reported_by
    expect(page.get_by_text("cli.v000002").first).to_be_visible()  # its parent_version
    page.screenshot(path=str(DOCS / "ui_cli_run_partitions.png"))


def test_policy_versions_plot_the_training_curves(page, webserver):
    """The asset's Overview > Metadata > Plots: each version's training metrics (from the rollout
    that trained it) are numeric metadata, so Dagster draws them as curves over the partitions."""
    from playwright.sync_api import expect

    base, _ = webserver
    page.goto(f"{base}/assets/policy_versions")  # Overview > Metadata > Plots
    page.get_by_text("Plots", exact=True).first.click()
    for metric in ("train/loss", "rollout/raw_reward", "mean_reward"):
        expect(page.get_by_text(metric, exact=True).first).to_be_visible()
    page.wait_for_timeout(1000)
    page.screenshot(path=str(DOCS / "ui_policy_versions_plots.png"))
    body = page.inner_text("body")
    assert "shard_rows" not in body  # identifiers and counts are not plotted


RUNS_OF_JOB = (
    """{ runsOrError(filter: {pipelineName: "rl_training"}) { ... on Runs { results { runId status } } } }"""
)
RUN_EVENTS = """{ logsForRun(runId: "%s") { ... on EventConnection { events { __typename
  ... on MessageEvent { timestamp }
  ... on ExecutionStepFailureEvent { error { message } failureMetadata { description } } } } } }"""


# its parts in `make test` (tests/dagster/test_ops_training.py): the op's schema marks rm_type required (what
# the Launchpad lists as missing) and `rm_type: none` fails before Ray naming the key; here, through the
# browser and a launched run (~12 s: the run's subprocess), in `make test-extended`
@pytest.mark.extended
def test_the_launchpad_rejects_a_run_without_a_reward_naming_the_key(page, webserver, tiny_hf_checkpoint):
    """A newcomer writes an rl_training config with a model and prompts but no reward: the Launchpad
    lists `rm_type` as missing config and will not launch; with `rm_type: none` (and no
    custom_rm_path) it launches, and the run fails in its first seconds (validation before Ray
    starts), naming the Launchpad key `rm_type`."""
    from playwright.sync_api import expect

    base, root = webserver
    page.goto(f"{base}/locations/miles_platform/jobs/rl_training/playground")
    editor = page.locator(".CodeMirror").first
    expect(editor).to_be_visible()
    yaml = (
        "ops:\n  rl_training_op:\n    config:\n"
        f"      hf_checkpoint: {tiny_hf_checkpoint}\n      prompt_data: {root / 'eval.jsonl'}\n"
        "      run_name: no-reward\n      rollout_batch_size: 2\n      global_batch_size: 2\n"
        "      input_key: prompt\n      label_key: label\n"
    )  # everything a run needs but a reward
    page.evaluate("(text) => document.querySelector('.CodeMirror').CodeMirror.setValue(text)", yaml)
    expect(page.get_by_role("button", name="Scaffold missing config")).to_be_enabled()
    expect(page.get_by_role("button", name="Launch Run").first).to_be_disabled()
    page.evaluate(
        "(text) => document.querySelector('.CodeMirror').CodeMirror.setValue(text)",
        yaml + "      rm_type: none\n",
    )
    expect(page.get_by_text("No missing config")).to_be_visible()
    page.get_by_role("button", name="Launch Run").first.click()  # no partitions: no "launch without one?"

    deadline, run = time.time() + 300, None  # the run's subprocess imports dagster + our code
    while time.time() < deadline:
        runs = _graphql(base, RUNS_OF_JOB)["runsOrError"]["results"]
        run = runs[0] if runs else None
        if run and run["status"] in ("SUCCESS", "FAILURE", "CANCELED"):
            break
        _idle_while_it_runs(page, run)
        time.sleep(1)
    assert run is not None, "the Launchpad launched no rl_training run"
    assert run["status"] == "FAILURE", run
    events = _graphql(base, RUN_EVENTS % run["runId"])["logsForRun"]["events"]
    start = next(int(e["timestamp"]) for e in events if e["__typename"] == "ExecutionStepStartEvent")
    failure = next(e for e in events if e["__typename"] == "ExecutionStepFailureEvent")
    end = next(int(e["timestamp"]) for e in events if e["__typename"] == "ExecutionStepFailureEvent")
    said = (failure.get("failureMetadata") or {}).get("description") or (failure.get("error") or {}).get(
        "message"
    )
    assert "rm_type" in (said or "") and "--rm-type" not in (said or ""), failure
    assert (end - start) / 1000 < 5, f"the step took {(end - start) / 1000:.1f} s to refuse the config"
    assert not (root / "runs" / "no-reward").exists() and not (root / "rollouts" / "run=no-reward").exists()
    page.goto(f"{base}/runs/{run['runId']}")
    expect(page.get_by_text("rm_type").first).to_be_visible()
    page.screenshot(path=str(DOCS / "ui_launchpad_rejects_no_reward.png"))
