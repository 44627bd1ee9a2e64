"""Launching runs as Ray jobs, the parts that need no cluster: launcher flags, addresses, the
submitted config, and how fast and how clearly a bad launch fails (before anything is submitted).
The submit / attach / cancel path against a real cluster is in tests/e2e/test_cluster_ray.py."""

import time

import dagster as dg
import pytest
from loop_helpers import small_run_kwargs

from miles_platform.cli import main as cli
from miles_platform.config import ConfigError, RunConfig
from miles_platform.launch.ray_jobs import (
    CONFIG_ENV,
    resolve_job_address,
    split_launch_flags,
    submittable_config,
)
from ops.training import rl_training
from resources.storage import StorageRootResource


def test_launch_flags_are_split_from_the_run_flags():
    opts, rest = split_launch_flags(["--submit", "--num-rollout", "3", "--no-wait"])
    assert (opts.submit, opts.no_wait, rest) == ("auto", True, ["--num-rollout", "3"])
    opts, rest = split_launch_flags(
        ["--submit", "http://h:8265", "--submit-runtime-env-json", '{"env_vars": {}}']
    )
    assert opts.submit == "http://h:8265" and opts.runtime_env == {"env_vars": {}} and rest == []
    assert split_launch_flags(["--save", "x"])[0].submit is None  # no abbreviation matching
    with pytest.raises(ConfigError, match="only apply with --submit"):
        split_launch_flags(["--no-wait"])
    with pytest.raises(ConfigError, match="--submit-runtime-env-json: not JSON"):
        split_launch_flags(["--submit", "--submit-runtime-env-json", "{nope"])
    with pytest.raises(ConfigError, match="expected a JSON object"):
        split_launch_flags(["--submit", "--submit-runtime-env-json", "[1]"])
    with pytest.raises(ConfigError, match=CONFIG_ENV):
        split_launch_flags(
            ["--submit", "--submit-runtime-env-json", f'{{"env_vars": {{"{CONFIG_ENV}": "x"}}}}']
        )


def test_job_address_from_flag_or_environment(monkeypatch):
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="no Ray Jobs address"):
        resolve_job_address("auto")
    monkeypatch.setenv("RAY_ADDRESS", "http://a:8265/")
    assert resolve_job_address("auto") == "http://a:8265"
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://b:8265")
    assert resolve_job_address(None) == "http://b:8265"
    assert resolve_job_address("https://c") == "https://c"
    for gcs in ("127.0.0.1:6379", "ray://head:10001"):
        with pytest.raises(ConfigError, match="dashboard's HTTP address.*--ray-address"):
            resolve_job_address(gcs)


def test_submitted_config_has_absolute_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig(hf_checkpoint="ckpt", prompt_data="s3://b/p.jsonl", storage_root=".miles", save="out",
                    eval_prompt_data=["heldout", "e.jsonl", "remote", "gs://b/e.jsonl"], run_name="ckpt")  # fmt: skip
    sub = submittable_config(cfg)
    assert sub.hf_checkpoint == str(tmp_path / "ckpt") and sub.save == str(tmp_path / "out")
    assert sub.storage_root == str(tmp_path / ".miles") and sub.prompt_data == "s3://b/p.jsonl"
    assert sub.eval_prompt_data == ["heldout", str(tmp_path / "e.jsonl"), "remote", "gs://b/e.jsonl"]
    assert sub.run_name == "ckpt"  # a name, not a path, even when a file of that name exists


def test_submit_validates_before_contacting_the_cluster(tiny_hf_checkpoint, tmp_path, capsys):
    kw = small_run_kwargs(tiny_hf_checkpoint, tmp_path)
    kw.pop("rm_type")
    argv = ["train", "--submit", "http://127.0.0.1:9"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    t0 = time.monotonic()
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert "--rm-type" in err and "submitted" not in err
    assert time.monotonic() - t0 < 10
    assert not (tmp_path / "root").exists()  # nothing written, nothing submitted

    assert cli([*argv, "--rm-type", "math"]) == 2  # valid config, no dashboard on that port
    assert "cannot reach the dashboard" in capsys.readouterr().err


def test_train_help_lists_the_launcher_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        cli(["train", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--submit [ADDRESS]" in out and "--no-wait" in out and "--submit-runtime-env-json" in out
    assert "--num-rollout" in out


def _execute(kw: dict, root, **launch):
    return rl_training.execute_in_process(
        run_config={"ops": {"rl_training_op": {"config": {**kw, **launch}}}},
        instance=dg.DagsterInstance.ephemeral(),
        resources={"storage": StorageRootResource(root=str(root))},
        raise_on_error=False,
    )


def _failure(result) -> str:
    failure = result.failure_data_for_node("rl_training_op")
    return failure.user_failure_data.description if failure.user_failure_data else failure.error.message


@pytest.mark.parametrize(
    "launch, message",
    [
        ({"launcher": "slurm"}, "launcher 'slurm': one of in_process, ray_job"),
        ({"launcher": "ray_job", "ray_job_address": "127.0.0.1:6379"}, "ray_job_address 127.0.0.1:6379"),
        ({"launcher": "ray_job", "ray_job_address": "http://h:1", "ray_job_runtime_env_json": "[]"},
         "ray_job_runtime_env_json: expected a JSON object"),
    ],
)  # fmt: skip
def test_bad_launcher_config_fails_fast_and_is_not_retried(tiny_hf_checkpoint, tmp_path, launch, message):
    kw = small_run_kwargs(tiny_hf_checkpoint, tmp_path)
    kw.pop("storage_root")
    t0 = time.monotonic()
    result = _execute(kw, tmp_path / "root", **launch)
    assert not result.success and message in _failure(result)
    assert time.monotonic() - t0 < 10
    assert not any(e.event_type_value == "STEP_UP_FOR_RETRY" for e in result.all_events)


def test_a_cancelled_in_process_run_is_not_retried(tiny_hf_checkpoint, tmp_path, monkeypatch):
    """Dagster applies the retry policy to an interrupt (its cancel) too: the op turns it into a
    final failure, or a cancelled run would resume at once."""
    import miles_platform.loop

    def interrupted(cfg, reporter=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(miles_platform.loop, "train", interrupted)
    kw = small_run_kwargs(tiny_hf_checkpoint, tmp_path)
    kw.pop("storage_root")
    result = _execute(kw, tmp_path / "root")
    assert not result.success and "run cancelled" in _failure(result)
    assert not any(e.event_type_value == "STEP_UP_FOR_RETRY" for e in result.all_events)


class _RecordingJobs:
    """Stands in for the Jobs API's two calls, to see what a submission sends."""

    def __init__(self):
        self.submitted: dict = {}

    def list_jobs(self):
        return []

    def submit_job(self, **kw):
        self.submitted = kw
        return kw["submission_id"]


def test_a_resolved_api_key_never_travels_in_the_job(tiny_hf_checkpoint, tmp_path, monkeypatch):
    """Validation resolves the run's key (file, $MILES_API_KEY, or generated); the job's runtime
    env (readable by whoever lists jobs) carries only a key the user gave as --api-key."""
    import json

    from miles_platform.launch.ray_jobs import submit_or_attach
    from miles_platform.preflight import validate_before_start

    key_file = tmp_path / "key"
    key_file.write_text("s3cret-from-file\n")
    monkeypatch.setenv("MILES_API_KEY", "s3cret-from-env")
    for given in ({"api_key_file": str(key_file)}, {}, {"api_key": "given-on-cli"}):
        cfg = RunConfig(**small_run_kwargs(tiny_hf_checkpoint, tmp_path, **given))
        user_key = cfg.api_key
        validate_before_start(cfg)
        assert cfg.api_key  # resolved
        jobs = _RecordingJobs()
        assert submit_or_attach(jobs, cfg, api_key=user_key).job_id == "miles-t-1"
        sent = json.loads(jobs.submitted["runtime_env"]["env_vars"][CONFIG_ENV])
        assert sent["api_key"] == given.get("api_key")
        assert "s3cret" not in json.dumps(jobs.submitted)
        RunConfig.from_dict(sent).validate()  # the driver's own validation accepts it


def test_the_job_driver_runs_as_a_fork_of_the_server_its_node_passed_on(tmp_path):
    """A Ray job's entrypoint on a machine with an inherited fork server (a one-machine cluster started
    beside one) runs as a fork of it, torch & co. imported; without one, as itself. Here without a run
    config: the driver's own error and exit status either way."""
    import os
    import subprocess
    import sys

    from miles_platform.cluster import forkserver, ray_cluster
    from miles_platform.launch.job_driver import WARM

    ray_cluster.start_fork_server(*forkserver.EXTRAS)
    srv = forkserver.current()
    if srv is None:
        pytest.skip("fork server disabled (MILES_FORK_WORKERS=0)")
    deadline = time.monotonic() + 120
    while not os.path.exists(srv.socket_path):  # a server this test just started is still importing
        assert srv.alive() and time.monotonic() < deadline, "fork server did not come up"
        time.sleep(0.1)
    env = {k: v for k, v in os.environ.items() if k not in (CONFIG_ENV, WARM, forkserver.INHERITED)}
    run = lambda extra: subprocess.run([sys.executable, "-m", "miles_platform.launch.job_driver"],  # noqa: E731
                                       env={**env, **extra}, capture_output=True, text=True, timeout=120)  # fmt: skip
    warm, cold = run({forkserver.INHERITED: srv.dir}), run({})
    for r in (warm, cold):
        assert r.returncode == 2 and f"{CONFIG_ENV} is not set" in r.stderr, r.stderr
    assert f"a fork of the fork server in {srv.dir}" in warm.stderr
    assert "a fork of the fork server" not in cold.stderr
