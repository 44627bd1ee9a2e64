"""The `rl_training` job: one op that runs the Ray-hosted loop and reports materializations.

Its run config is RunConfig (every Miles flag, snake_case, each with its `--help` text as the
Launchpad description) except `storage_root`: every op, asset and sensor writes and reads under
the `storage` resource's root (env MILES_STORAGE_ROOT). Unset `prompt_data` / `hf_checkpoint`
default to the latest `prompt_dataset` / `base_checkpoint` materializations, so the Launchpad
needs no paths at all. `rollout_batch_size` and `rm_type` are required in the schema, so the
Launchpad lists them as missing config (`rm_type: none` when custom_rm_path, per-sample
metadata.rm_type or use_opd gives the reward). The whole pre-start validation
(`validate_before_start`) runs before Ray starts: a bad config fails in about a second, naming
the Launchpad keys (`rm_type`, not `--rm-type`). Presets are jobs of their own (ops/presets.py).

Each policy version adds a dynamic partition `<run>.v<NNNNNN>` and logs materializations of
`rollout_shards` and `policy_versions` with lineage metadata and the rollout's training metrics;
sensors react to those. The loop does not evaluate here: each `policy_versions` materialization
carries the run's eval settings (`eval_config`: its eval and reward flags, `eval_prompt_data`
when set, else the latest `eval_dataset` at eval time) and the `eval_on_new_policy` sensor
launches `eval_results` with them, the one evaluator of record.
"""

import dataclasses
import os
import re
from typing import Any, Optional  # noqa: UP035 - pydantic field types built at runtime

import dagster as dg
from dagster._core.errors import DagsterExecutionInterruptedError
from pydantic import Field, create_model

from assets.evals import eval_config_for_run
from assets.metadata import latest_path
from miles_platform.cluster.k8s import TRAINING_OP_K8S_TAGS
from miles_platform.config import MODEL_ARGS, ConfigError, RunConfig, function_flag_values
from miles_platform.errors import MilesError, retryable
from miles_platform.launch.ray_jobs import (
    FINAL_EXIT_CODES,
    job_client,
    parse_runtime_env,
    resolve_job_address,
    stop_job,
    submit_or_attach,
    wait_for_job,
)
from miles_platform.run_types import CITestFailure, RunResult
from miles_platform.store.paths import StoragePaths
from miles_platform.store.tables import read_rows
from ops.presets import RUN_ID, Preset, presets, run_name_for
from ops.version_events import DagsterReporter, run_version_reports
from resources.storage import StorageRootResource

# dict fields are set from the CLI / YAML, not the Launchpad; storage_root is the `storage` resource's;
# the model flags of a Miles launch script describe the checkpoint, which the Launchpad picks as an asset;
# a wandb key typed there would be stored as typed (the Launchpad's run reads WANDB_API_KEY instead)
SKIP = {"sglang_args", "custom_function_args", "compat_flags", "storage_root", "wandb_key", *MODEL_ARGS}
# ... except a generate/rollout function's own flags, which the Launchpad takes as CLI tokens
FUNCTION_FLAGS = "custom_function_flags"
# ... and where the run runs (not RunConfig: not part of what is trained)
LAUNCHER, RAY_JOB_ADDRESS, RAY_JOB_RUNTIME_ENV = "launcher", "ray_job_address", "ray_job_runtime_env_json"
LAUNCHERS = ("in_process", "ray_job")
# what a run cannot do without: required in the Launchpad's schema (missing config until set)
NO_REWARD = "none"
REQUIRED = {
    "rollout_batch_size": (int, "required"),
    "rm_type": (str, f"required: `{NO_REWARD}` when custom_rm_path, per-sample metadata.rm_type or use_opd "
                     "gives the reward"),
}  # fmt: skip
RUN_NAME_NOTE = (
    f"; in the Launchpad `{RUN_ID}` becomes the Dagster run's id (8 characters, its first attempt's)"
)


def _description(f: dataclasses.Field) -> str:
    """The flag's `--help` text (and its allowed values), shown beside the field in the Launchpad."""
    text = f"--{f.name.replace('_', '-')}: {f.metadata.get('help') or ''}".rstrip(": ")
    choices = f.metadata.get("choices")
    return f"{text} (one of: {', '.join(map(str, choices))})" if choices else text


def _pydantic_fields(
    config_cls: type = RunConfig, skip: frozenset | set = SKIP, launch: bool = True
) -> dict[str, Any]:
    """Op config fields of a run-config dataclass: one per flag, its `--help` as the description;
    `launch`: plus the function-flag and launcher fields of `rl_training`."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config_cls):
        if f.name in skip or not f.init:
            continue
        t = {"int": int, "float": float, "str": str, "bool": bool}.get(str(f.type).split(" ")[0], None)
        tstr = str(f.type)
        if tstr.startswith("list[int]"):
            typ: Any = list[int]
        elif tstr.startswith("list["):
            typ = list[str]
        elif "None" in tstr:
            base = {"int": int, "float": float, "str": str, "bool": bool}[tstr.split(" ")[0]]
            typ = Optional[base]  # noqa: UP045
        else:
            typ = t
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out[f.name] = (typ, Field(default=default, description=_description(f)))
    if not launch:
        return out
    for name, (typ, why) in REQUIRED.items():
        out[name] = (typ, Field(description=f"{out[name][1].description} ({why})"))
    out["run_name"][1].description += RUN_NAME_NOTE
    out[FUNCTION_FLAGS] = (
        list[str],
        Field(
            default=[],
            description="the flags a --custom-generate-function-path / --rollout-function-path registers "
            "with its add_arguments, as on the command line: ['--my-flag', 'value', ...]",
        ),
    )
    out[LAUNCHER] = (
        str,
        Field(
            default="in_process",
            description="where the loop runs (one of: in_process, ray_job): in this Dagster run's process, "
            "or submitted to a Ray cluster as a Ray job (`train --submit`) that outlives this run; "
            "relaunching the run attaches to its live job, cancelling this run stops it",
        ),
    )
    out[RAY_JOB_ADDRESS] = (
        str,
        Field(
            default="",
            description="launcher ray_job: the Ray Jobs (dashboard) address, http://<head>:8265; "
            "empty = $RAY_API_SERVER_ADDRESS, then $RAY_ADDRESS",
        ),
    )
    out[RAY_JOB_RUNTIME_ENV] = (
        str,
        Field(default="", description="launcher ray_job: Ray runtime-env fields for the job, as JSON"),
    )
    return out


RLTrainingConfig = create_model("RLTrainingConfig", __base__=dg.Config, **_pydantic_fields())
RLTrainingConfig.__doc__ = "RunConfig: Miles flag names (snake_case) and defaults."


def run_config_from(
    config: dg.Config, instance: dg.DagsterInstance, storage_root: str, run: dg.DagsterRun | None = None
) -> tuple[RunConfig, dict[str, Any]]:
    """The run's RunConfig (op config + the storage resource's root + paths of the latest assets,
    `{run_id}` in run_name filled from `run`, validated as `train` would before anything starts; a
    user mistake is a dg.Failure naming the Launchpad key) and the `eval_results` config that
    evaluates its versions. The loop itself does not evaluate under Dagster: eval_results,
    requested by the sensor, is the evaluator of record."""
    from miles_platform.loop import validate_before_start  # torch: when a run starts, not at load

    data = config.model_dump()
    flags = data.pop(FUNCTION_FLAGS, [])
    for key in (LAUNCHER, RAY_JOB_ADDRESS, RAY_JOB_RUNTIME_ENV):
        data.pop(key, None)
    if data.get("rm_type") in (NO_REWARD, ""):  # required in the Launchpad; `none`: no built-in reward
        data["rm_type"] = None
    if run is not None:
        data["run_name"] = run_name_for(data["run_name"], run)
    if data.get("api_key"):  # the run config is stored, and shown, as typed
        raise dg.Failure(
            description="rl_training config: api_key typed in the Launchpad is stored in plain text with the "
            "run's config (Dagster's run storage, shown to anyone who can open the run): give api_key_file "
            "(a 0600 file the run worker reads) or set $MILES_API_KEY in the code location's environment",
            allow_retries=False,
        )
    try:
        data["custom_function_args"] = function_flag_values(data, flags)
        cfg = RunConfig.from_dict(data)
    except ConfigError as e:
        raise launchpad_failure(e, data) from None
    cfg.storage_root = StoragePaths(storage_root).root  # absolute: Ray workers have other working dirs
    if (
        cfg.uses_global_dataset
    ):  # a --data-source-path class or --disable-rollout-global-dataset: no default data
        cfg.prompt_data = cfg.prompt_data or latest_path(instance, "prompt_dataset")
    cfg.hf_checkpoint = cfg.hf_checkpoint or latest_path(instance, "base_checkpoint")
    if cfg.prompt_data and cfg.prompt_data.endswith(".parquet") and cfg.input_key == "input":
        cfg.input_key, cfg.label_key = "prompt", cfg.label_key or "label"  # normalized dataset columns
    try:
        validate_before_start(cfg)
    except MilesError as e:
        raise launchpad_failure(e, data) from None
    in_loop = [f for f, on in (("--eval-function-path", cfg.eval_function_path),
                               ("--ci-metric-checker-key", cfg.ci_metric_checker_key)) if on]  # fmt: skip
    if in_loop:  # the sensor's eval is the built-in one, outside the run: neither would see an eval
        raise launchpad_failure(
            ConfigError(
                f"{', '.join(in_loop)}: act on the run's own evals; under Dagster the eval_on_new_policy sensor "
                "evaluates each version (built-in eval) and the run evaluates nothing: use `miles-platform train`"
            ),
            data,
        )
    eval_config = eval_config_for_run(cfg)
    cfg.eval_prompt_data = []  # no in-loop eval (and no v0 eval): one evaluator, one row per metric
    return cfg, eval_config


def launchpad_failure(error: Exception, keys) -> dg.Failure:
    """A config error in the Launchpad's words: each `--flag` that is a config key becomes the key
    (`--rm-type` -> `rm_type`); a function's own flags (custom_function_flags) stay flags."""

    def key(m: re.Match) -> str:
        name = m[1].replace("-", "_")
        return name if name in keys else m[0]

    message = re.sub(r"(?<![\w-])--([a-z][a-z0-9-]*)", key, str(error))
    return dg.Failure(description=f"rl_training config: {message}", allow_retries=False)


# A failed step is retried in the same run: the loop resumes from the run's last checkpoint, and
# versions made after it keep their keys (new ones continue after the highest), so no partition is
# reported twice. Config errors and --ci-test failures are final (allow_retries=False).
TRAINING_RETRY_POLICY = dg.RetryPolicy(max_retries=2, delay=5)


@dg.op(
    description="Run the Miles-style RL loop on Ray; report rollout_shards / policy_versions per version.",
    tags={"kind": "ray"},
    retry_policy=TRAINING_RETRY_POLICY,
)
def rl_training_op(
    context: dg.OpExecutionContext,
    config: RLTrainingConfig,  # type: ignore[valid-type]
    storage: StorageRootResource,
) -> dg.Output:
    from miles_platform.loop import train  # torch: when a run starts, not at load

    ray_job = ray_job_options(config)
    cfg, eval_config = run_config_from(config, context.instance, storage.root, context.dagster_run)
    if ray_job is not None:
        return train_as_ray_job(context, cfg, eval_config, storage.paths, *ray_job, api_key=config.api_key)
    if context.retry_number:
        context.log.info(f"retry {context.retry_number}: run {cfg.run_name} resumes from its last checkpoint")
    # image prompts: eval datasets read text only (docs/vlm.md), so the eval sensor must not evaluate
    # the versions on the text eval_dataset; the VLM quickstart evaluates them itself
    vlm = {"task": "vlm", "evaluated_in_loop": "true"} if cfg.multimodal_keys else None
    reporter = DagsterReporter(context, eval_config, vlm)
    try:
        result: RunResult = train(cfg, reporter)
    except CITestFailure as e:  # deterministic: a retry would fail the same way
        raise dg.Failure(description=f"--ci-test: {e}", allow_retries=False) from e
    except MilesError as e:  # a missing dataset, a reward function that raised, ...: said once, not retried
        if retryable(e):
            raise
        raise dg.Failure(description=f"run {cfg.run_name}: {e}", allow_retries=False) from e
    except (DagsterExecutionInterruptedError, KeyboardInterrupt):
        raise _cancelled(f"run {cfg.run_name} stopped; its last checkpoint resumes it") from None
    finally:
        reporter.flush()
    paths = storage.paths
    return dg.Output(
        {"run": result.run, "final_version": result.final_version, "final_hf_path": result.final_hf_path},
        metadata={
            "run": result.run,
            "versions": len(result.versions),
            "final_version": result.final_version,
            "final_hf_path": result.final_hf_path or "",
            "checkpoints": paths.checkpoints(cfg.run_name),
        },
    )


def _cancelled(what: str) -> dg.Failure:
    """A cancelled run ends, never retried: Dagster applies the retry policy to an interrupt too,
    which would resume (or resubmit) the run the user just stopped."""
    return dg.Failure(description=f"run cancelled: {what}", allow_retries=False)


def ray_job_options(config: dg.Config) -> tuple[str, dict[str, Any]] | None:
    """(Ray Jobs address, runtime env) for `launcher: ray_job`; None for in_process."""
    launcher = getattr(config, LAUNCHER)
    if launcher not in LAUNCHERS:
        raise dg.Failure(description=f"rl_training config: launcher {launcher!r}: one of {', '.join(LAUNCHERS)}",
                         allow_retries=False)  # fmt: skip
    if launcher == "in_process":
        return None
    try:
        address = resolve_job_address(getattr(config, RAY_JOB_ADDRESS) or None, flag=RAY_JOB_ADDRESS)
        env = parse_runtime_env(getattr(config, RAY_JOB_RUNTIME_ENV), flag=RAY_JOB_RUNTIME_ENV)
    except ConfigError as e:
        raise dg.Failure(description=f"rl_training config: {e}", allow_retries=False) from None
    return address, env


def train_as_ray_job(
    context: dg.OpExecutionContext,
    cfg: RunConfig,
    eval_config: dict[str, Any],
    paths: StoragePaths,
    address: str,
    runtime_env: dict[str, Any],
    api_key: str | None = None,
) -> dg.Output:
    """`launcher: ray_job`: submit the run as a Ray job (or attach to its live one) with Dagster
    Pipes: dagster-ray's PipesRayJobMessageReader tails the job's log into this run's log, and on
    every poll the run's new versions are reconciled from the catalog into `policy_versions` /
    `rollout_shards` materializations (Pipes cannot report partitioned ones). Killing this process
    leaves the job running; cancelling the run stops it."""
    from dagster_ray.core.pipes import PipesRayJobMessageReader

    client = job_client(address)
    reader = PipesRayJobMessageReader()
    with dg.open_pipes_session(context=context, message_reader=reader,
                               context_injector=dg.PipesEnvContextInjector()) as session:  # fmt: skip
        launched = submit_or_attach(
            client, cfg, runtime_env=runtime_env, env_vars=session.get_bootstrap_env_vars(),
            metadata={"dagster_run_id": context.run_id, "dagster_job": context.job_name}, api_key=api_key,
        )  # fmt: skip
        job_id = launched.job_id
        extra = {"reported_by": "rl_training", "ray_job_id": job_id}

        def reconcile(complete: bool) -> None:
            events, keys = run_version_reports(context.instance, paths, cfg.run_name, eval_config=eval_config,
                                               extra=extra, complete=complete)  # fmt: skip
            if keys:
                context.instance.add_dynamic_partitions("policy_versions", keys)
                for e in events:
                    context.log_event(e)

        try:  # from here on a cancel stops the job, whatever else fails while stopping
            verb = "attached to the running" if launched.attached else "submitted"
            context.log.info(f"{verb} Ray job {job_id} at {address} (run {cfg.run_name})")
            session.report_launched({"extras": {"ray_job_id": job_id, "ray_address": client.get_address()}})
            status = wait_for_job(client, job_id, poll_s=2.0, on_poll=lambda: reconcile(False))
        except (DagsterExecutionInterruptedError, KeyboardInterrupt):
            stopped = "stop requested"
            try:
                context.log.warning(f"run cancelled: stopping Ray job {job_id}")
                stopped = stop_job(client, job_id)
                try:
                    reconcile(True)
                except Exception as e:  # said, not hidden by the cancel raised below
                    context.log.error(f"reporting the versions of Ray job {job_id}: {type(e).__name__}: {e}")
            finally:
                raise _cancelled(f"Ray job {job_id} {stopped}") from None  # noqa: B012 - final, always
        reconcile(True)
    info = client.get_job_info(job_id)
    if status != "SUCCEEDED":
        code = info.driver_exit_code
        raise dg.Failure(
            description=f"Ray job {job_id} {status} (driver exit code {code}): {info.message or ''}",
            metadata={"ray_job_id": job_id, "ray_address": address},
            # a retry resubmits and resumes from the last checkpoint; not after a config error or
            # a --ci-test failure (they would fail the same way) nor after a stop
            allow_retries=status == "FAILED" and code not in FINAL_EXIT_CODES,
        )
    versions = {r["partition_key"]: r for r in read_rows(paths, "policy_versions", cfg.run_name)}
    final = max(versions.values(), key=lambda r: r["version"], default=None)
    final_hf = (final or {}).get("hf_path") or ""
    return dg.Output(
        {"run": cfg.run_name, "final_version": final["version"] if final else 0, "final_hf_path": final_hf},
        metadata={
            "run": cfg.run_name,
            "versions": len(versions),
            "final_version": final["version"] if final else 0,
            "final_hf_path": final_hf,
            "checkpoints": paths.checkpoints(cfg.run_name),
            "ray_job_id": job_id,
            "ray_job_attached": launched.attached,
        },
    )


def _k8s_tags() -> dict[str, str]:
    """The training pod's `dagster-k8s/config` (GPU requests) when this code location runs in a
    Kubernetes pod (the K8sRunLauncher of deploy/ reads it); none on a local instance, where the tag
    would only clutter every Launchpad run."""
    if not os.environ.get("KUBERNETES_SERVICE_HOST"):  # set in every pod by Kubernetes
        return {}
    return dict(TRAINING_OP_K8S_TAGS)


@dg.job(
    description="Miles-style RL post-training (GRPO and friends) on Ray, from a config you write (the "
    "Launchpad lists the missing fields: rollout_batch_size, rm_type). For a ready config, launch a "
    "preset job: rl_training_smoke (2 rollouts, seconds) or rl_training_demo (the quickstart's recipe).",
    tags=_k8s_tags(),
)
def rl_training():
    rl_training_op()


def preset_job(preset: Preset) -> dg.JobDefinition:
    """`rl_training_<name>`: the rl_training op with the preset as its default config."""

    @dg.job(
        name=preset.job_name,
        description=preset.description,
        tags={**_k8s_tags(), "miles/preset": preset.name},
        config={"ops": {"rl_training_op": {"config": preset.config}}},
    )
    def _job():
        rl_training_op()

    return _job


PRESET_JOBS = {p.job_name: preset_job(p) for p in presets()}
