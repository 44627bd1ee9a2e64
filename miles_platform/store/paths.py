"""Every path under one storage root. One obvious place: nothing else joins root paths by hand.

Layout (local dir by default, or an object-store URI such as s3://bucket/root: store/remote.py):

    <root>/catalog.duckdb                      DuckDB catalog (views over the Parquet below)
    <root>/datasets/<name>/data.parquet        normalized prompt / eval datasets
    <root>/models/<name>/                      HF checkpoints (base, exported policies)
    <root>/rollouts/run=<run>/rollout_id=<NNNNNN>/part-*.parquet
    <root>/runs/<run>/checkpoints/iter_NNNNNNN/ + latest_checkpointed_iteration.txt
    <root>/runs/<run>/hf/v<NNNNNN>/            HF export of each policy version
    <root>/runs/<run>/lora/v<NNNNNN>/          PEFT adapter of each version of a LoRA run (no base copy)
    <root>/runs/<run>/publications/            disk-delta weight_vNNNNNN/ + LATEST
    <root>/tables/<table>/run=<run>/part-*.parquet   policy_versions, evals, lineage, metrics, run_events,
                                               train_samples rows
    <root>/dagster/                            DAGSTER_HOME of the quickstart instance
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from miles_platform.store.remote import is_remote  # also: object-store listings are never cached

RUN_CONFIG = "run_config.json"  # a checkpoint dir's record of the run's config (run_lifecycle.py)
DIFFUSION_CONFIG = "diffusion_config.json"  # a diffusion run dir's (diffusion/loop.py)
TABLES = ("policy_versions", "evals", "lineage", "metrics", "run_events", "train_samples")


SERVED_FORMATS = ("fp8", "int4")  # what a served copy beside a version's export can be (`served_path`)


def served_path(hf_export: str, fmt: str) -> str:
    """Where a version's served quantized checkpoint lives: beside its HF export (`<export>-<fmt>`),
    the path the run (weights/rollout_quant.py) and the `quantized_weights` asset write."""
    return f"{hf_export.rstrip('/')}-{fmt}"


def absolute(path: str | None) -> str | None:
    """The one spelling of a local path the store records: absolute (against this process's cwd),
    normalized, no trailing slash. An object-store URI stays as it is."""
    if not path or is_remote(path):
        return path
    return os.path.abspath(path)


def partition_key(run: str, version: int) -> str:
    """Policy-version partition key `<run>.v<NNNNNN>`."""
    return f"{run}.v{version:06d}"


def parse_partition_key(key: str) -> tuple[str, int]:
    run, sep, v = key.rpartition(".v")
    if not sep or not run or not v.isdigit():
        raise ValueError(f"bad policy-version partition key {key!r}: expected <run>.v<NNNNNN>")
    return run, int(v)


@dataclass(frozen=True)
class StoragePaths:
    root: str = ".miles"

    def __post_init__(self):
        if not is_remote(self.root):
            object.__setattr__(self, "root", os.path.abspath(self.root))

    def join(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def missing_root_error(self, prog: str) -> str | None:
        """The CLI error for a root that does not exist (an object-store one: nothing under it) or
        that the object store refuses (endpoint, credentials)."""
        if is_remote(self.root):
            from miles_platform.store.remote import exists

            try:
                found = exists(self.root)
            except Exception as e:  # botocore's and aiohttp's errors: one line, the env to check
                return (
                    f"{prog}: error: cannot read storage root {self.root} ({type(e).__name__}: {e}); "
                    "check AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION"
                )
            if found:
                return None
        elif os.path.isdir(self.root):
            return None
        return (
            f"{prog}: error: storage root {self.root} does not exist "
            "(pass --storage-root or set MILES_STORAGE_ROOT)"
        )

    @property
    def catalog(self) -> str:
        return self.join("catalog.duckdb")

    def dataset(self, name: str) -> str:
        return self.join("datasets", name, "data.parquet")

    def model(self, name: str) -> str:
        return self.join("models", name)

    @property
    def rollouts(self) -> str:
        return self.join("rollouts")

    def rollout_shard_dir(self, run: str, rollout_id: int) -> str:
        return self.join("rollouts", f"run={run}", f"rollout_id={rollout_id:06d}")

    def run_dir(self, run: str) -> str:
        return self.join("runs", run)

    def checkpoints(self, run: str) -> str:
        return self.join("runs", run, "checkpoints")

    def hf_export(self, run: str, version: int) -> str:
        return self.join("runs", run, "hf", f"v{version:06d}")

    def lora_adapter(self, run: str, version: int) -> str:
        return self.join("runs", run, "lora", f"v{version:06d}")

    def publications(self, run: str) -> str:
        return self.join("runs", run, "publications")

    def table_dir(self, table: str, run: str | None = None) -> str:
        if table not in TABLES:
            raise ValueError(f"unknown table {table!r}; known: {TABLES}")
        return self.join("tables", table) if run is None else self.join("tables", table, f"run={run}")
