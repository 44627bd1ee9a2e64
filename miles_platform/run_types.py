"""What a training run reports and returns: torch-free, so the Dagster layer imports it cheaply.

`PolicyVersion` is the contract with the Dagster reporter (ops/training.py): one record per
new policy version, the same fields the `policy_versions` table row and the lineage edges hold.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class PolicyVersion:
    run: str
    version: int
    partition_key: str
    parent_version: int
    parent_partition_key: str
    rollout_id: int
    checkpoint_path: str | None
    hf_path: str | None  # None for a LoRA version: see adapter_path + base_checkpoint
    content_hash: str
    config_hash: str
    base_data_version: str | None
    dataset_data_version: str | None
    shard_path: str
    shard_rows: int
    mean_reward: float | None
    base_checkpoint: str
    prompt_data: str | None
    eval_interval: int | None
    adapter_path: str | None = None  # a LoRA run's PEFT adapter dir of this version
    # on-policy distillation: [{"teacher": path or URL, "kind", "content_hash"}] (lineage `distilled_from`)
    distilled_from: list[dict[str, Any]] = field(default_factory=list)
    final: bool = False  # the run's last version: no later rollout of its --num-rollout updates weights

    # the `policy_versions` table's columns (store/tables.py)
    ROW: ClassVar[tuple[str, ...]] = ("version", "partition_key", "parent_version", "rollout_id", "checkpoint_path", "hf_path",
           "content_hash", "config_hash", "base_data_version", "dataset_data_version", "shard_path",
           "shard_rows", "mean_reward", "adapter_path")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def row(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.ROW}


class Reporter:
    """Callbacks of a run. The Dagster op overrides them; the CLI prints."""

    def log(self, msg: str) -> None:
        print(msg, flush=True)

    def on_rollout(self, rollout_id: int, metrics: dict[str, float]) -> None:
        pass

    def on_policy_version(self, info: dict[str, Any]) -> None:
        """`info` is `PolicyVersion.to_dict()`."""

    def on_eval(self, partition_key: str, metrics: dict[str, float], images: dict[str, str]) -> None:
        """A run's own eval of a version (diffusion: `images` names each eval set's sample grid PNG)."""

    def on_versions_abandoned(self, partition_keys: list[str], rollout_id: int, version: int) -> None:
        """A resume from the checkpoint of (rollout_id, version) abandoned these versions, made
        after that checkpoint by the run that crashed (store/run_events.py)."""


@dataclass
class RunResult:
    run: str
    start_rollout_id: int
    last_rollout_id: int
    final_version: int
    final_hf_path: str | None
    versions: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)
    ci_checks: dict[str, float] = field(default_factory=dict)
    eval_before_train: dict[str, float] = field(default_factory=dict)  # v0's eval, as in Miles


class CITestFailure(AssertionError):
    """A --ci-test / --check-weight-update-equal invariant does not hold."""
