"""The `rl_training` job: one op that runs the Ray-hosted loop and reports materializations.

Its run config is RunConfig (every Miles flag, snake_case, each with its `--help` text as the
Launchpad description) except `storage_root`: every op, asset and sensor writes and reads under
the `storage` resource's root (env MILES_STORAGE_ROOT). Unset `prompt_data` / `hf_checkpoint`
default to the latest `prompt_dataset` / `base_checkpoint` materializations, so the Launchpad
needs no paths at all. The whole pre-start validation (`validate_before_start`) runs before Ray
starts: a bad config fails in about a second with the flag named.

Each policy version adds a dynamic partition `<run>.v<NNNNNN>` and logs materializations of
`rollout_shards` and `policy_versions` with lineage metadata and the rollout's training metrics;
sensors react to those. The loop does not evaluate here: each `policy_versions` materialization
carries the run's eval settings (`eval_config`: its eval and reward flags, `eval_prompt_data`
when set, else the latest `eval_dataset` at eval time) and the `eval_on_new_policy` sensor
launches `eval_results` with them, the one evaluator of record.
"""

import dataclasses
from typing import Any, Optional  # noqa: UP035 - pydantic field types built at runtime

import dagster as dg
from pydantic import Field, create_model

from assets.rollouts import lora_adapter_event, policy_version_event, rollout_shard_event
from miles_platform.config import RunConfig
from miles_platform.errors import MilesError
from miles_platform.loop import Reporter, RunResult
from miles_platform.store.paths import StoragePaths
from resources.storage import StorageRootResource

# dict fields are set from the CLI / YAML, not the Launchpad; storage_root is the `storage` resource's
SKIP = {"sglang_args", "custom_function_args", "storage_root"}
# ... except a generate/rollout function's own flags, which the Launchpad takes as CLI tokens
FUNCTION_FLAGS = "custom_function_flags"


def _description(f: dataclasses.Field) -> str:
    """The flag's `--help` text (and its allowed values), shown beside the field in the Launchpad."""
    text = f"--{f.name.replace('_', '-')}: {f.metadata.get('help') or ''}".rstrip(": ")
    choices = f.metadata.get("choices")
    return f"{text} (one of: {', '.join(map(str, choices))})" if choices else text


def _pydantic_fields() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(RunConfig):
        if f.name in SKIP:
            continue
        t = {"int": int, "float": float, "str": str, "bool": bool}.get(str(f.type).split(" ")[0], None)
        tstr = str(f.type)
        if tstr.startswith("list[int]"):
            typ: Any = list[int]
        elif tstr.startswith("list["):
            typ = list[str]
        elif "None" in tstr:
            base = {"int": int, "float": float, "str": str}[tstr.split(" ")[0]]
            typ = Optional[base]  # noqa: UP045
        else:
            typ = t
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out[f.name] = (typ, Field(default=default, description=_description(f)))
    out[FUNCTION_FLAGS] = (
        list[str],
        Field(
            default=[],
            description="the flags a --custom-generate-function-path / --rollout-function-path registers "
            "with its add_arguments, as on the command line: ['--my-flag', 'value', ...]",
        ),
    )
    return out


RLTrainingConfig = create_model("RLTrainingConfig", __base__=dg.Config, **_pydantic_fields())
RLTrainingConfig.__doc__ = "RunConfig: Miles flag names (snake_case) and defaults."


def _latest_path(instance: dg.DagsterInstance, key: str) -> str | None:
    ev = instance.get_latest_materialization_event(dg.AssetKey(key))
    if ev is None or ev.asset_materialization is None:
        return None
    md = ev.asset_materialization.metadata.get("path")
    return None if md is None else str(md.value)


class DagsterReporter(Reporter):
    """Each policy version -> a dynamic partition plus `rollout_shards` and `policy_versions`
    materializations. The loop reports a version just before that rollout's metrics, so the
    `policy_versions` event waits for them (or for `flush`) to carry them as plottable floats."""

    def __init__(self, context: dg.OpExecutionContext, eval_config: dict[str, Any] | None = None):
        self.context = context
        self.eval_config = eval_config or {}
        self._pending: dict[str, Any] | None = None

    def log(self, msg: str) -> None:
        self.context.log.info(msg)

    def on_policy_version(self, info: dict[str, Any]) -> None:
        self.flush()
        ctx, key = self.context, info["partition_key"]
        ctx.instance.add_dynamic_partitions("policy_versions", [key])
        ctx.log_event(rollout_shard_event(info))
        if info.get("adapter_path"):  # a LoRA version: the adapter + the frozen base, no HF export
            ctx.log_event(lora_adapter_event(info))
        self._pending = info

    def on_rollout(self, rollout_id: int, metrics: dict[str, float]) -> None:
        if self._pending is not None and self._pending["rollout_id"] == rollout_id:
            self.context.log_event(policy_version_event(self._pending, metrics, self.eval_config))
            self._pending = None

    def flush(self) -> None:
        """Log a version whose rollout metrics never came (the run failed in between)."""
        if self._pending is not None:
            self.context.log_event(policy_version_event(self._pending, {}, self.eval_config))
            self._pending = None


def run_config_from(
    config: dg.Config, instance: dg.DagsterInstance, storage_root: str
) -> tuple[RunConfig, dict[str, Any]]:
    """The run's RunConfig (op config + the storage resource's root + paths of the latest assets,
    validated as `train` would before anything starts; a user mistake is a dg.Failure naming the
    flag) and the `eval_results` config that evaluates its versions. The loop itself does not
    evaluate under Dagster: eval_results, requested by the sensor, is the evaluator of record."""
    from assets.evals import eval_config_for_run
    from miles_platform.config import ConfigError, function_flag_values
    from miles_platform.loop import validate_before_start

    data = config.model_dump()
    flags = data.pop(FUNCTION_FLAGS, [])
    try:
        data["custom_function_args"] = function_flag_values(data, flags)
        cfg = RunConfig.from_dict(data)
    except ConfigError as e:
        raise dg.Failure(description=f"rl_training config: {e}", allow_retries=False) from None
    cfg.storage_root = StoragePaths(storage_root).root  # absolute: Ray workers have other working dirs
    cfg.prompt_data = cfg.prompt_data or _latest_path(instance, "prompt_dataset")
    cfg.hf_checkpoint = cfg.hf_checkpoint or _latest_path(instance, "base_checkpoint")
    if cfg.prompt_data and cfg.prompt_data.endswith(".parquet") and cfg.input_key == "input":
        cfg.input_key, cfg.label_key = "prompt", cfg.label_key or "label"  # normalized dataset columns
    try:
        validate_before_start(cfg)
    except MilesError as e:
        raise dg.Failure(description=f"rl_training config: {e}", allow_retries=False) from None
    eval_config = eval_config_for_run(cfg)
    cfg.eval_prompt_data = []  # no in-loop eval (and no v0 eval): one evaluator, one row per metric
    return cfg, eval_config


# Launchpad presets (the partition picker of the job: "demo", "smoke"). Paths are left to the latest
# prompt_dataset / base_checkpoint; each load of a preset names a fresh run (`demo-<time>`), while a
# re-execution keeps its run's config and name, so it resumes from that run's checkpoint.
SMOKE_RL = dict(
    rm_type="math", input_key="prompt", label_key="label", rollout_batch_size=2, n_samples_per_prompt=2,
    num_rollout=2, rollout_max_response_len=4, lr=1e-4, save_interval=2,
)  # fmt: skip


def preset_run_configs() -> dict[str, dict[str, Any]]:
    """The op config of each preset: the quickstart's demo recipe (100 rollouts, eval every 10th
    version) and a two-rollout smoke run (seconds, once Ray is up)."""
    from miles_platform.quickstart import DEMO_RL

    return {"demo": dict(DEMO_RL, num_rollout=100), "smoke": SMOKE_RL}


PRESETS = tuple(preset_run_configs())


@dg.static_partitioned_config(partition_keys=list(PRESETS))
def rl_training_presets(preset: str) -> dict[str, Any]:
    import time

    config = dict(preset_run_configs()[preset], run_name=f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    return {"ops": {"rl_training_op": {"config": config}}}


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
    from miles_platform.loop import CITestFailure, train

    cfg, eval_config = run_config_from(config, context.instance, storage.root)
    if context.retry_number:
        context.log.info(f"retry {context.retry_number}: run {cfg.run_name} resumes from its last checkpoint")
    reporter = DagsterReporter(context, eval_config)
    try:
        result: RunResult = train(cfg, reporter)
    except CITestFailure as e:  # deterministic: a retry would fail the same way
        raise dg.Failure(description=f"--ci-test: {e}", allow_retries=False) from e
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


def _k8s_tags() -> dict[str, str]:
    try:
        from miles_platform.cluster.k8s import TRAINING_OP_K8S_TAGS
    except ImportError:
        return {}
    return dict(TRAINING_OP_K8S_TAGS)


@dg.job(
    description="Miles-style RL post-training (GRPO and friends) on Ray. Presets: pick `demo` or `smoke` "
    "in the Launchpad's partition picker.",
    tags=_k8s_tags(),
    config=rl_training_presets,
)
def rl_training():
    rl_training_op()
