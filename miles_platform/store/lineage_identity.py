"""Lineage rows, written and read (store/lineage.py traces them): one identity per node, a path is
one node however it was typed.

`Edge` is a row; `write_edges` is the one writer of lineage rows (the loop's version records, eval,
publication, quantization and conversion assets) and records every local path of a path kind
(checkpoint, dataset, rollout shard, adapter) absolute (`node_id`); object-store URIs and ids stay
as they are. Rows written before
that kept a path as typed (`.miles/models/base`): `RecordedPaths` resolves such a path against the
dir its run wrote from when the run's saved config shows it (a relative `--storage-root` that is
the tail of this root), and `fold_by_content` folds a spelling still relative into the absolute
node with the same content hash (the `data_version` of a trained_from / base_checkpoint /
distilled_from / adapter edge). `LineageGraph.resolve` hashes a path no row names and matches it
the same way. docs/evals_lineage.md says what old rows do.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from miles_platform.store.paths import DIFFUSION_CONFIG, RUN_CONFIG, StoragePaths, absolute
from miles_platform.store.remote import is_remote


@dataclass
class Edge:
    """One lineage row: `child` (of `child_kind`) came from `parent` by `relation`; `data_version`:
    the parent's content hash, data version or format, as the relation says."""

    child: str
    child_kind: str | None
    parent: str | None  # None: no such parent (a run without --prompt-data): write_edges skips it
    parent_kind: str | None
    relation: str
    data_version: str | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Edge:
        return cls(*(row.get(f.name) for f in dataclasses.fields(cls)))


PATH_KINDS = frozenset({"checkpoint", "dataset", "rollout_shard", "lora_adapter"})  # nodes that are paths
# relations whose data_version is the parent's content hash (models/checkpoint.py content_hash)
CONTENT_HASHED = frozenset({"trained_from", "base_checkpoint", "distilled_from", "adapter"})


def node_id(value: str, kind: str | None) -> str:
    """A node's one identity: a local path of a path kind absolute; a URI or an id as it is."""
    return absolute(value) if kind in PATH_KINDS else value


def _is_absolute(node: str) -> bool:
    return is_remote(node) or os.path.isabs(node)


def _writer_cwd(paths: StoragePaths, run: str) -> str | None:
    """The dir `run` wrote its rows from, when its saved config shows it: a relative
    `--storage-root` (as typed) is the tail of this root's absolute path. None when unknowable
    (no saved config, an absolute or `..` root, another root's tail, an object-store root)."""
    if is_remote(paths.root):
        return None
    for f in (
        os.path.join(paths.checkpoints(run), RUN_CONFIG),
        os.path.join(paths.run_dir(run), DIFFUSION_CONFIG),
    ):
        try:
            typed = json.loads(Path(f).read_text()).get("storage_root")
        except (OSError, ValueError, AttributeError):
            continue
        if not isinstance(typed, str) or is_remote(typed) or os.path.isabs(typed):
            return None
        typed = os.path.normpath(typed)
        if typed == ".":
            return paths.root
        if typed.startswith("..") or not paths.root.endswith(os.sep + typed):
            return None
        return paths.root[: -len(typed) - 1] or os.sep
    return None


class RecordedPaths:
    """Paths as rows recorded them, made absolute: a relative one (a row written before the writer
    made paths absolute) against its run's writer dir (`_writer_cwd`), else left as it is."""

    def __init__(self, paths: StoragePaths):
        self.paths = paths
        self._cwd: dict[str, str | None] = {}

    def resolve(self, run: str, value: str | None, kind: str | None) -> str | None:
        if kind not in PATH_KINDS or not value or _is_absolute(value):
            return value
        if run not in self._cwd:
            self._cwd[run] = _writer_cwd(self.paths, run)
        cwd = self._cwd[run]
        return os.path.normpath(os.path.join(cwd, value)) if cwd else value

    def edge(self, run: str, row: dict[str, Any]) -> dict[str, Any]:
        return row | {
            "child": self.resolve(run, row["child"], row["child_kind"]),
            "parent": self.resolve(run, row["parent"], row["parent_kind"]),
        }


def write_edges(paths: StoragePaths, run: str, edges: list[Edge], append=None) -> None:
    """Append `edges` to `run`'s lineage table, each node of a path kind absolute (`node_id`);
    edges without a parent are skipped. The one writer of lineage rows. `append(table, run, rows)`:
    where the rows go (a recorder's BufferedParts; default: a part file now)."""
    from miles_platform.store.tables import append_rows

    rows = [
        {
            "child": node_id(e.child, e.child_kind),
            "child_kind": e.child_kind,
            "parent": node_id(e.parent, e.parent_kind),
            "parent_kind": e.parent_kind,
            "relation": e.relation,
            "data_version": e.data_version,
        }
        for e in edges
        if e.parent is not None
    ]
    (append or partial(append_rows, paths))("lineage", run, rows)


def read_edges(paths: StoragePaths, run: str) -> list[Edge]:
    """`run`'s lineage rows, in append order, with the paths old rows recorded as typed resolved
    where their writer's dir is knowable (`RecordedPaths`)."""
    from miles_platform.store.tables import read_rows

    recorded = RecordedPaths(paths)
    return [Edge.from_row(recorded.edge(run, row)) for row in read_rows(paths, "lineage", run)]


def fold_by_content(edges: list[Edge]) -> tuple[list[Edge], dict[str, str]]:
    """Edges with each path still relative (its writer's dir unknowable) replaced by the absolute
    node of the same content hash, and {content hash: node} (an absolute node where there is one)."""
    hashes: dict[str, str] = {}
    for e in edges:
        if e.relation in CONTENT_HASHED and e.parent_kind in PATH_KINDS and e.data_version:
            hashes.setdefault(e.parent, e.data_version)
    by_hash: dict[str, str] = {}
    for node, h in sorted(hashes.items(), key=lambda nh: not _is_absolute(nh[0])):  # absolute first
        by_hash.setdefault(h, node)
    alias = {n: by_hash[h] for n, h in hashes.items() if by_hash[h] != n and not _is_absolute(n)}
    folded = [
        dataclasses.replace(e, child=alias.get(e.child, e.child), parent=alias.get(e.parent, e.parent))
        for e in edges
    ]
    return folded, by_hash
