"""`base_checkpoint`: the starting policy of RL, as an HF checkpoint at `<root>/models/base`.

mode "sft":      train the demo's SFT base (`default_sft_recipe()`) on the built-in task's SFT
                 split, written under the storage root. The task seed must be the one the
                 dataset assets use, so the eval split stays held out from SFT.
mode "existing": register an existing HF directory (local path or fsspec URI); it is validated
                 (config, weights, supported architecture, tokenizer) and copied into place.

The data version is the content hash of weights + config, so a re-run that produces the same
weights (same seed, same recipe) does not make downstream assets stale.
"""

import dataclasses
import os
import tempfile
import time

import dagster as dg
import fsspec

from miles_platform.errors import CheckpointError
from miles_platform.models.checkpoint import (
    checkpoint_bytes,
    content_hash,
    load_hf_checkpoint,
    save_hf_checkpoint,
    validate_hf_dir,
)
from resources.storage import StorageRootResource


class BaseCheckpointConfig(dg.Config):
    mode: str = "sft"  # "sft" (train the demo base) or "existing" (register `path`)
    path: str | None = None  # mode "existing": HF dir, local or fsspec URI
    seed: int | None = None  # SFT seed (default: the recipe's)
    train_iters: int | None = None  # SFT steps (default: the recipe's)
    task_seed: int = 0  # seed of the built-in task splits (= the dataset assets' seed)
    carry_error_rate: float | None = None  # SFT split's dropped-carry fraction (default: the task's)
    eval_prompts: int = 500  # held-out prompts for the greedy accuracy in metadata (0 = skip)


PLATEAU_LOSS = 0.5  # docs/sft_base.md: the SFT loss sits at ~0.78 until the model learns to add


def _task_dir(storage: StorageRootResource) -> str:
    return os.path.dirname(storage.paths.dataset("sft_task"))


def _train_sft(config: BaseCheckpointConfig, storage: StorageRootResource, dest: str, log) -> dict:
    from miles_platform.data.tasks import DEFAULT_CARRY_ERROR_RATE, write_task_datasets
    from miles_platform.training.sft import default_sft_recipe, run_sft

    rate = DEFAULT_CARRY_ERROR_RATE if config.carry_error_rate is None else config.carry_error_rate
    task = write_task_datasets(_task_dir(storage), seed=config.task_seed, carry_error_rate=rate)
    recipe = default_sft_recipe()
    if config.seed is not None:
        recipe = dataclasses.replace(recipe, seed=config.seed)
    if config.train_iters is not None:
        recipe = dataclasses.replace(recipe, train_iters=config.train_iters)
    log.info(f"SFT base: {recipe.train_iters} iters on {task['sft']} (seed {recipe.seed})")
    m = run_sft(task["sft"], dest, recipe=recipe, progress=False)
    exit_step = next((int(step) for step, loss in m["loss_curve"] if loss < PLATEAU_LOSS), None)
    if exit_step is None:
        log.warning(
            f"SFT base: the loss never fell below {PLATEAU_LOSS} in {recipe.train_iters} iterations (final "
            f"{m['final_loss']:.3f}): the base is still on the plateau where it has not learned addition; "
            "train longer (config train_iters, `quickstart --sft-iters`) or take another seed (`--sft-seed`)"
        )
    return {
        "model": m["model"],
        "tokenizer": m["tokenizer"],
        "eval_path": task["eval"],
        "metadata": {
            "source": "sft",
            "sft_seconds": round(m["sft_seconds"], 2),
            "sft_cpu_seconds": round(m["sft_cpu_seconds"], 2),
            "sft_final_loss": round(m["final_loss"], 5),
            "sft_train_iters": m["train_iters"],
            # the first logged step below the loss plateau (None: never left it; the base cannot add)
            "sft_plateau_exit_step": dg.MetadataValue.text(str(exit_step)),
            "sft_seed": recipe.seed,
            "sft_data": dg.MetadataValue.path(task["sft"]),
            "sft_recipe": dg.MetadataValue.json(recipe.to_dict()),
            "sft_loss_curve": _loss_table(m["loss_curve"]),
        },
    }


def _loss_table(curve: list[tuple[int, float]]) -> dg.TableMetadataValue:
    """The SFT loss per logged step as a table (the asset page renders it as one, not JSON)."""
    return dg.MetadataValue.table(
        records=[dg.TableRecord({"step": int(s), "loss": round(float(v), 5)}) for s, v in curve],
        schema=dg.TableSchema(columns=[dg.TableColumn("step", "int"), dg.TableColumn("loss", "float")]),
    )


def _register_existing(config: BaseCheckpointConfig, storage: StorageRootResource, dest: str) -> dict:
    if not config.path:
        raise CheckpointError('base_checkpoint mode "existing" needs config.path (an HF directory or URI)')
    src = config.path
    with tempfile.TemporaryDirectory(prefix="miles-base-") as tmp:
        local = src
        if "://" in src:  # fetch remote dirs first, then validate like a local one
            fs, root = fsspec.core.url_to_fs(src)
            if not fs.isdir(root):
                raise CheckpointError(f"HF checkpoint {src}: not a directory")
            fs.get(root.rstrip("/") + "/", tmp, recursive=True)
            local = tmp
        validate_hf_dir(local)
        model, tokenizer = load_hf_checkpoint(local)
        save_hf_checkpoint(model, tokenizer, dest)
    eval_path = os.path.join(_task_dir(storage), "eval.jsonl")
    return {
        "model": model,
        "tokenizer": tokenizer,
        "eval_path": eval_path if os.path.exists(eval_path) else None,
        "metadata": {"source": dg.MetadataValue.text(src)},
    }


@dg.asset(group_name="checkpoints", kinds={"pytorch", "safetensors"})
def base_checkpoint(
    context: dg.AssetExecutionContext, config: BaseCheckpointConfig, storage: StorageRootResource
) -> dg.MaterializeResult:
    """Starting policy of RL (HF dir): the demo SFT base, or a registered existing checkpoint."""
    from miles_platform.models.qwen3 import num_parameters  # transformers: when the asset runs

    dest = storage.paths.model("base")
    if "://" in dest:
        raise CheckpointError(f"base_checkpoint needs a local storage root to train/copy into, got {dest}")
    if config.mode not in ("sft", "existing"):
        raise CheckpointError(f'base_checkpoint mode {config.mode!r}: choose "sft" or "existing"')
    t0 = time.perf_counter()
    if config.mode == "sft":
        built = _train_sft(config, storage, dest, context.log)
    else:
        built = _register_existing(config, storage, dest)
    validate_hf_dir(dest)
    digest = content_hash(dest)
    md = {
        "path": dg.MetadataValue.path(dest),
        "mode": config.mode,
        "num_parameters": num_parameters(built["model"]),
        "bytes": checkpoint_bytes(dest),
        "content_hash": digest,
        "architecture": type(built["model"]).__name__,
        "seconds": round(time.perf_counter() - t0, 2),
        **built["metadata"],
    }
    if config.eval_prompts and built["eval_path"]:
        from miles_platform.rollout.evaluate import evaluate

        res = evaluate(
            str(dest),  # the checkpoint as written, served by the embedded engine
            [("eval", built["eval_path"])],
            max_new_tokens=8,
            rm_type="math",
            max_prompts=config.eval_prompts,
        )["eval"]
        for key, value in res.items():
            if key.startswith(("pass@1", "mean_reward")):
                md[f"eval/{key}"] = float(value)
    return dg.MaterializeResult(metadata=md, data_version=dg.DataVersion(digest))
