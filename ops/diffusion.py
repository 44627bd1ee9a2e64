"""The `diffusion_training` job: Flow-GRPO / DiffusionNFT on Ray, reported like `rl_training`.

Its op config is DiffusionRunConfig (Miles-diffusion flag names, snake_case) less `storage_root`
(the `storage` resource's). Unset `prompt_data` / `hf_checkpoint` / `eval_prompt_data` default to
the latest `diffusion_prompt_dataset` / `diffusion_base_checkpoint` / `diffusion_eval_dataset`;
unset `save` is `<root>/runs/<run>/checkpoints` (a retry resumes there).

Each policy version adds its `<run>.v<NNNNNN>` partition and logs `rollout_shards` and
`policy_versions` materializations (the same assets, partitions and lineage as LLM runs, with
`task: diffusion`). The loop evaluates in place (held-out reward, deterministic sampling) and logs
`eval_results` for the evaluated versions with a grid of sample images the UI shows.
"""

from typing import Any

import dagster as dg
from dagster._core.errors import DagsterExecutionInterruptedError
from pydantic import create_model

from assets.metadata import image_markdown, latest_path
from miles_platform.diffusion.config import DiffusionRunConfig
from miles_platform.errors import MilesError
from miles_platform.run_types import CITestFailure
from miles_platform.store.paths import StoragePaths
from ops.training import _cancelled, _pydantic_fields
from ops.version_events import DagsterReporter
from resources.storage import StorageRootResource

DIFFUSION_EXTRA = {"task": "diffusion", "evaluated_in_loop": "true"}

DiffusionTrainingConfig = create_model(
    "DiffusionTrainingConfig", __base__=dg.Config,
    **_pydantic_fields(DiffusionRunConfig, {"storage_root"}, launch=False),
)  # fmt: skip
DiffusionTrainingConfig.__doc__ = "DiffusionRunConfig: Miles-diffusion flag names (snake_case) and defaults."


class DiffusionReporter(DagsterReporter):
    """DagsterReporter with the diffusion marker on every event, plus `eval_results` with images."""

    def __init__(self, context: dg.OpExecutionContext):
        super().__init__(context, {}, DIFFUSION_EXTRA)

    def on_eval(self, partition_key: str, metrics: dict[str, float], grids: dict[str, str]) -> None:
        if partition_key.endswith(".v000000"):  # v0 is the base checkpoint, not a partition of the run
            self.log(f"eval v0 (base): {metrics}")
            return
        md: dict[str, Any] = {k: float(v) for k, v in metrics.items()}
        for name, path in grids.items():
            with open(path, "rb") as f:
                md[f"samples_{name}"] = image_markdown(f.read(), f"{name}: held-out prompts, fixed seeds")
            md[f"grid_{name}"] = dg.MetadataValue.path(path)
        self.context.instance.add_dynamic_partitions("policy_versions", [partition_key])
        self.context.log_event(dg.AssetMaterialization("eval_results", partition=partition_key,
                                                       metadata={**md, **DIFFUSION_EXTRA}))  # fmt: skip


def diffusion_config_from(
    config: dg.Config, instance: dg.DagsterInstance, storage_root: str
) -> DiffusionRunConfig:
    data = config.model_dump()
    data["storage_root"] = StoragePaths(storage_root).root
    data["prompt_data"] = data.get("prompt_data") or latest_path(instance, "diffusion_prompt_dataset")
    data["hf_checkpoint"] = data.get("hf_checkpoint") or latest_path(instance, "diffusion_base_checkpoint")
    # checkpoints under the run by default: a retried or re-executed run resumes from them
    data["save"] = data.get("save") or StoragePaths(storage_root).checkpoints(
        data.get("run_name") or "diffusion"
    )
    if not data.get("eval_prompt_data"):
        eval_path = latest_path(instance, "diffusion_eval_dataset")
        data["eval_prompt_data"] = ["heldout", eval_path] if eval_path else []
    try:
        return DiffusionRunConfig.from_dict(data).validate()
    except MilesError as e:
        raise dg.Failure(description=f"diffusion_training config: {e}", allow_retries=False) from None


@dg.op(
    description="Diffusion RL (Flow-GRPO / DiffusionNFT) on Ray; reports rollout_shards / policy_versions / "
    "eval_results per version.",
    tags={"kind": "ray"},
    retry_policy=dg.RetryPolicy(max_retries=2, delay=5),
)
def diffusion_training_op(
    context: dg.OpExecutionContext,
    config: DiffusionTrainingConfig,  # type: ignore[valid-type]
    storage: StorageRootResource,
) -> dg.Output:
    from miles_platform.diffusion.loop import train_diffusion

    cfg = diffusion_config_from(config, context.instance, storage.root)
    reporter = DiffusionReporter(context)
    try:
        result = train_diffusion(cfg, reporter)
    except CITestFailure as e:
        raise dg.Failure(description=f"--ci-test: {e}", allow_retries=False) from e
    except MilesError as e:
        raise dg.Failure(description=f"diffusion_training: {e}", allow_retries=False) from None
    except (DagsterExecutionInterruptedError, KeyboardInterrupt):
        raise _cancelled(f"run {cfg.run_name} stopped; its last checkpoint resumes it") from None
    finally:
        reporter.flush()
    out = {"run": result.run, "final_version": result.final_version, "final_hf_path": result.final_hf_path,
           "eval_before_train": result.eval_before_train,
           "evals": [m for m in result.metrics if any(k.startswith("eval/") for k in m)]}  # fmt: skip
    return dg.Output(out, metadata={"run": result.run, "versions": len(result.versions),
                                    "final_version": result.final_version,
                                    "final_hf_path": result.final_hf_path or ""})  # fmt: skip


@dg.job(description="Diffusion RL post-training of a DiT (Flow-GRPO, DiffusionNFT) on Ray.")
def diffusion_training():
    diffusion_training_op()
