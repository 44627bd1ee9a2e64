"""Stores written by the store's own writers, as a `miles-platform train` run leaves them, without
training: rollout shards (`write_rollout_shard`), policy-version rows and lineage
(`record_policy_version`, the loop's recorder), metrics rows, the run's `run_config.json` and
HF exports copied from a real checkpoint (or, for a LoRA run, PEFT adapter dirs written by
`write_adapter_dir`). Tests break them on purpose afterwards."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

from miles_platform.config import RunConfig, saved_config
from miles_platform.data.sample import Sample
from miles_platform.store.paths import StoragePaths, partition_key
from miles_platform.store.shards import write_rollout_shard
from miles_platform.store.tables import append_rows
from miles_platform.store.versions import PolicyVersion, record_policy_version

T0 = datetime(2026, 1, 1, tzinfo=UTC)
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8}


def build_run(
    paths: StoragePaths,
    run: str,
    base: str,
    num_rollout: int,
    rewards: list[float] | None = None,
    staleness: int = 0,
    **flags,
) -> list[PolicyVersion]:
    """A finished run of `num_rollout` rollouts, one version per rollout (v = rollout id + 1), each
    exported as a copy of `base` (with `lora_rank=r`: an adapter on `base`'s q_proj modules); each
    rollout trains the 4 prompts `i+i=` (one sample each). `staleness`: samples started that many
    versions before the engine's. `storage_root`: the root as the run was given it (default
    `paths.root`). Returns the PolicyVersions, as the loop hands them to its reporter."""
    from miles_platform.models.checkpoint import content_hash

    flags.setdefault("prompt_data", "train.jsonl")
    flags.setdefault("storage_root", paths.root)
    cfg = RunConfig(run_name=run, hf_checkpoint=base, num_rollout=num_rollout, rm_type="math", **flags)
    base_hash = content_hash(base)
    cfg.save = paths.checkpoints(run)
    Path(cfg.save).mkdir(parents=True, exist_ok=True)
    (Path(cfg.save) / "run_config.json").write_text(saved_config(cfg))
    out = []
    for rid in range(num_rollout):
        reward = rewards[rid] if rewards else 0.5
        start = max(0, rid - staleness)
        samples = [
            Sample(run=run, rollout_id=rid, group_index=i, index=i, prompt=f"{i}+{i}=", label=str(2 * i), reward=reward,
                   response_tokens=[1] * (2 + i), weight_version_start=start, weight_version_end=rid)
            for i in range(4)
        ]  # fmt: skip
        shard = write_rollout_shard(paths, run, rid, samples)
        if cfg.lora_rank:
            hf = lora_adapter(paths.lora_adapter(run, rid + 1), base, cfg.lora_rank, seed=rid)
        else:
            hf = paths.hf_export(run, rid + 1)
            shutil.copytree(base, hf)
        pv = record_policy_version(cfg, paths, rid + 1, rid, rid, shard, hf, None, base_hash, "datahash")
        rows = [{"rollout_id": rid, "step": rid, "name": name, "value": value}
                for name, value in (("rollout/raw_reward", reward), ("train/loss", 1.0 - reward))]  # fmt: skip
        append_rows(paths, "metrics", run, rows)
        out.append(pv)
    return out


def lora_adapter(path: str, base: str, rank: int, seed: int = 0) -> str:
    """A PEFT adapter dir on every q_proj of the HF checkpoint `base`, as the LoRA trainer saves it."""
    import torch
    from safetensors import safe_open

    from miles_platform.models.checkpoint import content_hash
    from miles_platform.rollout.lora_serving import PREFIX
    from miles_platform.training.lora import write_adapter_dir

    g = torch.Generator().manual_seed(seed)
    state = {}
    for f in sorted(Path(base).glob("*.safetensors")):
        with safe_open(str(f), framework="np") as st:
            for k in (k for k in st.keys() if k.endswith("q_proj.weight")):  # noqa: SIM118
                out, inp = st.get_slice(k).get_shape()
                module = PREFIX + k.removesuffix(".weight")
                state[f"{module}.lora_A.weight"] = torch.randn(rank, inp, generator=g)
                state[f"{module}.lora_B.weight"] = torch.randn(out, rank, generator=g)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"]}
    return write_adapter_dir(path, state, config, base, content_hash(base))


def save_tiny_pipeline(path: str | Path) -> str:
    """A diffusers-layout DiT pipeline dir with the files `diffusion.model.save_pipeline` writes
    (model_index.json, transformer/, text_encoder/, scheduler/) and small random weights, built
    without importing diffusers (seconds saved per test)."""
    import numpy as np
    from safetensors.numpy import save_file

    from miles_platform.diffusion.model import FAMILY, PIPELINE_CLASS, PIPELINE_FILES

    root = Path(path)
    rng = np.random.default_rng(0)
    weights = {
        "transformer": ("diffusion_pytorch_model.safetensors", {"pos_embed.proj.weight": (32, 3, 2, 2),
                                                               "proj_out.weight": (12, 32)}),
        "text_encoder": ("model.safetensors", {"table": (13, 32)}),
    }  # fmt: skip
    for component, (name, shapes) in weights.items():
        (root / component).mkdir(parents=True)
        (root / component / "config.json").write_text(json.dumps({"component": component}))
        tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        save_file(tensors, str(root / component / name), metadata={"format": "pt"})
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps({"shift": 1.0}))
    index = {"_class_name": PIPELINE_CLASS, "family": FAMILY, "task": "t2i",
             "transformer": ["diffusers", "SD3Transformer2DModel"],
             "text_encoder": ["miles_platform.diffusion.model", "PromptEncoder"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}  # fmt: skip
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    assert all((root / f).is_file() for f in PIPELINE_FILES), "save_pipeline writes more: add it here"
    return str(root)


def eval_rows(run: str, version: int, pass1: float, source: str, minutes: int) -> list[dict]:
    """The rows one eval of a version writes (pass@1, pass@1(T=1), mean_reward@1(T=1) on dataset `eval`)."""
    return [
        {"version": version, "partition_key": partition_key(run, version), "dataset": "eval", "metric": m,
         "value": v, "n_samples": 1, "source": source, "created_at": T0 + timedelta(minutes=minutes), **SAMPLING}
        for m, v in (("pass@1", pass1), ("pass@1(T=1)", pass1), ("mean_reward@1(T=1)", pass1 / 2))
    ]  # fmt: skip


def add_evals(
    paths: StoragePaths, run: str, scores: list[tuple[int, float, str]], start_minute: int = 0
) -> None:
    """One eval per (version, pass@1, source), each newer than the one before."""
    for i, (version, pass1, source) in enumerate(scores):
        append_rows(paths, "evals", run, eval_rows(run, version, pass1, source, start_minute + i))


def apply_sensor_tick(sensor, instance, root: str, cursor: str | None = None):
    """One evaluation of `sensor`, applied to `instance` as the sensor daemon applies it
    (dagster/_daemon/sensor.py: asset events reported, then dynamic partitions added)."""
    import dagster as dg

    from resources.storage import StorageRootResource

    ctx = dg.build_sensor_context(
        instance=instance, cursor=cursor, resources={"storage": StorageRootResource(root=str(root))}
    )
    data = sensor.evaluate_tick(ctx)
    for event in data.asset_events:
        instance.report_runless_asset_event(event)
    for request in data.dynamic_partitions_requests:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return data


def point_s3_at(monkeypatch, env: dict) -> None:
    """Set the AWS env of an S3 server for this test and drop s3fs's cached instances: fsspec keys
    its instance cache on arguments, not on the env, so an instance an earlier module made for
    another (now stopped) server would be handed back with that server's endpoint."""
    import s3fs

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()
