"""The record of a new policy version, both ways: `PolicyVersion` (what the loop hands its reporter),
its `policy_versions` row and its lineage edges (previous version or base checkpoint, rollout shard,
prompt data, base checkpoint, and with on-policy distillation the teacher: `distilled_from`, by
content hash). `record_policy_version` writes them; `read_policy_versions` reads a run's rows back
into the same records (what the Dagster layer reports for runs trained outside it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

from miles_platform.store.code_version import CodeVersion, code_version
from miles_platform.store.paths import StoragePaths, absolute, partition_key

if TYPE_CHECKING:
    from miles_platform.config import RunConfig


@dataclass(frozen=True)
class PolicyVersion:
    """One new policy version: the `policy_versions` row's fields plus what its lineage edges and
    the run's config say. The contract between the loop and its reporter (run_types.Reporter)."""

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
    base_checkpoint: str | None  # None only when read back from a run whose lineage lacks it
    prompt_data: str | None
    eval_interval: int | None
    adapter_path: str | None = None  # a LoRA run's PEFT adapter dir of this version
    # on-policy distillation: [{"teacher": path or URL, "kind", "content_hash"}] (lineage `distilled_from`)
    distilled_from: list[dict[str, Any]] = field(default_factory=list)
    final: bool = False  # the run's last version: no later rollout of its --num-rollout updates weights
    # the code that made it (store/code_version.py; None: unknown, or a row from before they were kept)
    platform_version: str | None = None
    git_commit: str | None = None
    git_dirty: bool | None = None

    # the `policy_versions` table's columns (store/schemas.py)
    ROW: ClassVar[tuple[str, ...]] = ("version", "partition_key", "parent_version", "rollout_id", "checkpoint_path", "hf_path",
           "content_hash", "config_hash", "base_data_version", "dataset_data_version", "shard_path",
           "shard_rows", "mean_reward", "adapter_path", "platform_version", "git_commit", "git_dirty")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def row(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.ROW}

    @classmethod
    def from_row(
        cls,
        run: str,
        row: dict[str, Any],
        *,
        base_checkpoint: str | None,
        prompt_data: str | None = None,
        eval_interval: int | None = None,
        distilled_from: list[dict[str, Any]] | None = None,
        final: bool = False,
    ) -> PolicyVersion:
        """The version a `policy_versions` row records (`row()` read back), with what the row does
        not hold: from the run's lineage edges and its config (`read_policy_versions`)."""
        return cls(
            run=run, **{k: row.get(k) for k in cls.ROW}, parent_partition_key=partition_key(run, row["parent_version"]),
            base_checkpoint=base_checkpoint, prompt_data=prompt_data, eval_interval=eval_interval,
            distilled_from=list(distilled_from or []), final=final,
        )  # fmt: skip


def is_final_version(cfg, rollout_id: int) -> bool:
    """A version trained at `rollout_id` is its run's last: no later rollout of --num-rollout
    updates the weights (every --update-weights-interval-th rollout does). A resume that raises
    --num-rollout makes a later one final too."""
    interval = getattr(cfg, "update_weights_interval", 1) or 1
    return bool(cfg.num_rollout) and rollout_id + interval >= cfg.num_rollout


def record_policy_version(
    cfg: RunConfig, paths: StoragePaths, version: int, parent_version: int, rollout_id: int,
    shard, hf_dir: str, ckpt: str | None, base_version: str | None, data_version: str | None,
    teachers: list[tuple[str, str, str | None]] = (), config_changed_from: str | None = None,
    code: CodeVersion | None = None, config_hash: str | None = None, append=None,
) -> PolicyVersion:  # fmt: skip
    """`config_changed_from`: the config hash of the checkpoint this version's run resumed from
    under --allow-config-change (an edge `config_changed_from`; the flags are in run_events).
    `code`: the code that trained it (default: this process's, `code_version()`); `config_hash`:
    `cfg.config_hash()`, when the caller has it; `append(table, run, rows)`: where the rows go (a
    recorder's BufferedParts; default: a part file each, now)."""
    from miles_platform.models.checkpoint import content_hash
    from miles_platform.store.lineage_identity import Edge, write_edges
    from miles_platform.store.tables import append_rows

    run = cfg.run_name
    # a LoRA version is its adapter dir + the frozen base (by content hash), never a merged copy
    lora = cfg.uses_lora
    adapter_dir, hf_dir = (hf_dir, None) if lora else (None, hf_dir)
    # one spelling per path (store/lineage_identity.py): absolute, whatever the flags were typed as
    base, data = absolute(cfg.hf_checkpoint), absolute(cfg.prompt_data)
    ckpt, hf_dir, adapter_dir = absolute(ckpt), absolute(hf_dir), absolute(adapter_dir)
    pv = PolicyVersion(
        run=run, version=version, partition_key=partition_key(run, version), parent_version=parent_version,
        parent_partition_key=partition_key(run, parent_version), rollout_id=rollout_id, checkpoint_path=ckpt,
        hf_path=hf_dir, content_hash=content_hash(adapter_dir or hf_dir), config_hash=config_hash or cfg.config_hash(),
        base_data_version=base_version, dataset_data_version=data_version, shard_path=absolute(shard.path),
        shard_rows=shard.rows, mean_reward=shard.mean_reward, base_checkpoint=base,
        prompt_data=data, eval_interval=cfg.eval_interval, adapter_path=adapter_dir,
        distilled_from=[{"teacher": t, "kind": k, "content_hash": h} for t, k, h in teachers],
        final=is_final_version(cfg, rollout_id), **(code or code_version()).row(),
    )  # fmt: skip
    append = append or partial(append_rows, paths)
    append("policy_versions", run, [pv.row()])

    def edge(parent: str | None, parent_kind: str, relation: str, data_version: str | None) -> Edge:
        return Edge(pv.partition_key, "policy_version", parent, parent_kind, relation, data_version)

    first = parent_version == 0
    write_edges(paths, run, append=append, edges=[
        edge(base, "checkpoint", "trained_from", base_version) if first
        else edge(pv.parent_partition_key, "policy_version", "trained_from", None),
        edge(pv.shard_path, "rollout_shard", "trained_on", None),
        edge(data, "dataset", "prompt_data", data_version),
        edge(base, "checkpoint", "base_checkpoint", base_version),
        *([edge(adapter_dir, "lora_adapter", "adapter", pv.content_hash)] if lora else []),
        *(edge(t, kind, "distilled_from", h) for t, kind, h in teachers),
        *([edge(f"config:{config_changed_from}", "run_config", "config_changed_from", config_changed_from)]
          if config_changed_from else []),
        *served_quantized_edges(pv),
    ])  # fmt: skip
    return pv


def served_quantized_edges(pv: PolicyVersion) -> list:
    """A version the engines served quantized (its fp8 / int4 copy beside the export, written by the
    run: weights/rollout_quant.py) has the `quantized:<version>:<fmt>` child the asset would write."""
    from miles_platform.store.lineage_identity import Edge
    from miles_platform.store.paths import SERVED_FORMATS, served_path
    from miles_platform.store.remote import exists

    if not pv.hf_path:
        return []
    return [
        Edge(f"quantized:{pv.partition_key}:{fmt}", "quantized_weights", pv.partition_key, "policy_version",
             "quantized_as", fmt)
        for fmt in SERVED_FORMATS
        if exists(f"{served_path(pv.hf_path, fmt)}/model.safetensors")
    ]  # fmt: skip


def read_policy_versions(
    paths: StoragePaths, run: str, rows: list[dict[str, Any]], cfg: RunConfig | None
) -> list[PolicyVersion]:
    """The PolicyVersions of `rows` (`run`'s `policy_versions` rows), as the loop handed them to
    its reporter: base checkpoint, prompt data and teachers from the run's lineage edges; eval
    interval and `final` from `cfg`, its saved config (None: unknown, never final)."""
    from miles_platform.store.lineage_identity import read_edges

    edges = read_edges(paths, run)
    base = next((e.parent for e in edges if e.relation == "base_checkpoint"), None)
    prompt_data = {e.child: e.parent for e in edges if e.relation == "prompt_data"}
    teachers: dict[str, list[dict[str, Any]]] = {}
    for e in edges:
        if e.relation == "distilled_from":
            teachers.setdefault(e.child, []).append(
                {"teacher": e.parent, "kind": e.parent_kind, "content_hash": e.data_version}
            )
    return [
        PolicyVersion.from_row(
            run,
            row,
            base_checkpoint=base,
            prompt_data=prompt_data.get(row["partition_key"]),
            eval_interval=cfg.eval_interval if cfg else None,
            distilled_from=teachers.get(row["partition_key"]),
            final=cfg is not None and is_final_version(cfg, row["rollout_id"]),
        )
        for row in rows
    ]
