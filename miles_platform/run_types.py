"""What a training run reports and returns: torch-free, so the Dagster layer imports it cheaply.

`Reporter` is the contract with the Dagster reporter (ops/version_events.py): one
`PolicyVersion` (store/versions.py: the same fields the `policy_versions` row and the lineage
edges hold) per new policy version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles_platform.store.versions import PolicyVersion

__all__ = ["CITestFailure", "PolicyVersion", "Reporter", "RunResult"]


class Reporter:
    """Callbacks of a run. The Dagster op overrides them; the CLI prints."""

    def log(self, msg: str) -> None:
        print(msg, flush=True)

    def on_rollout(self, rollout_id: int, metrics: dict[str, float]) -> None:
        pass

    def on_policy_version(self, pv: PolicyVersion) -> None:
        """A new policy version, recorded in the store (its row and lineage edges) just before."""

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
    versions: list[dict[str, Any]] = field(default_factory=list)  # PolicyVersion.to_dict() of each
    metrics: list[dict[str, float]] = field(default_factory=list)
    ci_checks: dict[str, float] = field(default_factory=dict)
    eval_before_train: dict[str, float] = field(default_factory=dict)  # v0's eval, as in Miles


class CITestFailure(AssertionError):
    """A --ci-test / --check-weight-update-equal invariant does not hold."""
