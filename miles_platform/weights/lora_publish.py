"""One policy version of a LoRA run: its PEFT adapter dir (the `lora_adapters` asset, pointing at
the frozen base by content hash), the adapter-only engine update, and the checks after it."""

from __future__ import annotations

import ray

from miles_platform.config import RunConfig
from miles_platform.store.paths import StoragePaths
from miles_platform.training.ci_checks import (
    check_lora_weights_equal,
    check_weights_equal,
    lora_check_on,
    weight_check_on,
)


def publish_adapter(
    cfg: RunConfig, paths: StoragePaths, services, version: int, base_hash: str, sync: bool = True
) -> tuple[str, dict[str, float]]:
    """Write the adapter of `version`; with `sync`, load it into every engine (unless
    --lora-train-only) and check it. Returns (adapter dir, update metrics)."""
    from miles_platform.training.lora import write_adapter_dir

    s = services
    state, conf = ray.get([t.get_lora_adapter.remote() for t in s.trainers])[0]
    out = write_adapter_dir(
        paths.lora_adapter(cfg.run_name, version), state, conf, cfg.hf_checkpoint, base_hash
    )
    metrics: dict[str, float] = {}
    if sync and s.session is not None and not cfg.lora_train_only:
        metrics = s.session.update(state, version, out)
        check_synced(cfg, s, state, version)
    return out, metrics


def check_synced(cfg: RunConfig, services, adapter: dict, version: int) -> None:
    """--check-lora-weight-equal: the adapter by SHA-256; --check-weight-update-equal / --ci-test: also
    the engines' frozen base against the trainer's, tensor by tensor."""
    s = services
    if lora_check_on(cfg):
        check_lora_weights_equal(cfg, s.engines, adapter, version)
    if weight_check_on(cfg):
        base = ray.get([t.get_base_weights.remote() for t in s.trainers])[0]
        check_weights_equal(cfg, s.engines, base, version)
