"""Lineage: trace a policy version (or checkpoint, dataset, eval ...) up- and downstream.

    miles-platform lineage demo.v000003            # compact: the version chain as a range, data and base once
    miles-platform lineage demo.v000003 --full     # node by node, --depth levels: parents, shards, data, checkpoints; evals, ...
    miles-platform lineage /path/to/base/ckpt      # what was trained from / converted from it
    miles-platform lineage --dataset-version HASH  # which policy versions trained on that data
    miles-platform lineage demo.v000003 --json     # the same, for machines

Everything is read from the DuckDB catalog views `lineage`, `policy_versions`, `rollouts` and
`evals`. The `lineage` table is generic: rows (child, child_kind, parent, parent_kind,
relation, data_version). The loop writes policy_version -> (previous version | base
checkpoint, rollout shard, prompt data, base checkpoint); eval / publication / quantization
assets write `eval:<key>`, `publication:<key>`, `quantized:<key>:<fmt>` children of a
partition key; conversion writes checkpoint -> checkpoint. Any new relation shows up here
without code changes.

Rows are written by `write_edges` (store/lineage_identity.py), the one writer; one identity per
node: paths absolute, old rows' relative paths resolved or matched by content hash.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from miles_platform.metric_names import metric_name
from miles_platform.store.catalog import Catalog, CatalogError
from miles_platform.store.lineage_identity import Edge, RecordedPaths, fold_by_content
from miles_platform.store.paths import StoragePaths, absolute
from miles_platform.store.remote import is_remote

_SHARD_RE = re.compile(r"run=([^/]+)/rollout_id=(\d+)")
_KEY_RE = re.compile(r"([^:]+)\.v\d{6}")  # the run of a partition key, also inside eval: / quantized: ids
DEFAULT_DEPTH = 8


class LineageError(CatalogError):
    """The node asked for is not in the lineage table."""


@dataclass
class Node:
    id: str
    kind: str
    relations: list[str] = field(default_factory=list)  # how it relates to the node above it
    data_version: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)  # parents (upstream) or children (downstream)
    shown_above: bool = False  # already expanded elsewhere in this tree
    truncated: bool = False  # has more nodes beyond --depth

    def to_dict(self) -> dict[str, Any]:
        out = {
            "id": self.id,
            "kind": self.kind,
            "relations": self.relations,
            "data_version": self.data_version,
        }
        out |= {"info": self.info, "nodes": [n.to_dict() for n in self.nodes]}
        return out | {"shown_above": self.shown_above, "truncated": self.truncated}


class LineageGraph:
    """The lineage edges plus the per-node facts the tree shows, loaded once from the catalog."""

    def __init__(self, paths: StoragePaths):
        self.catalog = Catalog(paths)
        recorded = RecordedPaths(paths)
        rows = self._rows(
            "SELECT run, child, child_kind, parent, parent_kind, relation, data_version FROM lineage "
            "WHERE child IS NOT NULL AND parent IS NOT NULL ORDER BY created_at"
        )
        edges, self.by_hash = fold_by_content([Edge(**recorded.edge(r.pop("run"), r)) for r in rows])
        latest: dict[tuple[str, str, str], Edge] = {}
        for edge in edges:
            latest[(edge.child, edge.parent, edge.relation)] = edge  # a re-run's row replaces the old one
        self.edges = list(latest.values())
        self.versions = {
            r["partition_key"]: r for r in self._rows("SELECT * FROM policy_versions ORDER BY created_at")
        }
        self.kinds: dict[str, str] = {k: "policy_version" for k in self.versions}
        for e in self.edges:
            self.kinds.setdefault(e.child, e.child_kind or "unknown")
            self.kinds.setdefault(e.parent, e.parent_kind or "unknown")
        self._shards: dict[tuple[str, int], dict[str, Any]] | None = None
        self._evals: dict[str, dict[str, float]] | None = None

    def _rows(self, sql: str) -> list[dict[str, Any]]:
        columns, rows = self.catalog.query(sql)
        return [dict(zip(columns, r, strict=True)) for r in rows]

    # ------------------------------------------------------------- lookup
    def resolve(self, target: str) -> str | None:
        """The node id for a partition key, an `eval:...` id, or a path: absolute, as written, or
        (a local checkpoint dir no row names) by its content hash."""
        candidates = [absolute(target), target, target.rstrip("/")]
        found = next((c for c in candidates if c in self.kinds), None)
        return found or self.by_hash.get(self._content_hash(target))

    @staticmethod
    def _content_hash(target: str) -> str | None:
        from miles_platform.models.checkpoint import content_hash

        if is_remote(target) or not os.path.isdir(target):
            return None
        try:
            return content_hash(target)
        except OSError:  # not a checkpoint dir (no config.json): no hash to match
            return None

    def parents(self, node: str) -> list[Edge]:
        return [e for e in self.edges if e.child == node]

    def children(self, node: str) -> list[Edge]:
        return [e for e in self.edges if e.parent == node]

    def info(self, node: str, kind: str) -> dict[str, Any]:
        if node in self.versions:
            v = self.versions[node]
            keys = (
                "run",
                "version",
                "rollout_id",
                "hf_path",
                "checkpoint_path",
                "content_hash",
                "config_hash",
            )
            keys += ("dataset_data_version", "base_data_version", "shard_rows", "mean_reward", "created_at")
            # the code that made it (rows written before it was kept have none)
            keys += ("platform_version", "git_commit", "git_dirty")
            return {k: v.get(k) for k in keys if v.get(k) not in (None, "")}
        if kind == "rollout_shard":
            return self._shard_info(node)
        if kind == "eval" and node.startswith("eval:"):
            return self._eval_info(node.removeprefix("eval:"))
        return {}

    def _shard_info(self, path: str) -> dict[str, Any]:
        m = _SHARD_RE.search(path)
        if not m:
            return {}
        run, rollout_id = m.group(1), int(m.group(2))
        if self._shards is None:
            self._shards = {
                (r["run"], r["rollout_id"]): r
                for r in self._rows(
                    "SELECT run, rollout_id, count(*) AS rows, avg(reward) AS mean_reward FROM rollouts "
                    "GROUP BY run, rollout_id"
                )
            }
        found = self._shards.get((run, rollout_id))
        info: dict[str, Any] = {"run": run, "rollout_id": rollout_id}
        if found:
            return info | {"rows": found["rows"], "mean_reward": found["mean_reward"]}
        # the shard file is gone (or the catalog cannot see it): fall back to what the loop recorded
        for v in self.versions.values():
            if v.get("shard_path") == path:
                return info | {
                    "rows": v.get("shard_rows"),
                    "mean_reward": v.get("mean_reward"),
                    "missing": True,
                }
        return info | {"missing": True}

    def _eval_info(self, key: str) -> dict[str, Any]:
        if self._evals is None:
            self._evals = {}
            for r in self._rows(
                "SELECT partition_key, dataset, metric, arg_max(value, created_at) AS value, "
                "arg_max(n_samples, created_at) AS n, arg_max(temperature, created_at) AS t FROM evals "
                "GROUP BY partition_key, dataset, metric ORDER BY dataset, metric"
            ):  # older rows' `pass@k` / `mean_reward` read with their sampling, as new rows name it
                name = metric_name(r["metric"], r["n"], r["t"])
                self._evals.setdefault(r["partition_key"], {})[f"{r['dataset']}/{name}"] = r["value"]
        return dict(self._evals.get(key, {}))

    # ------------------------------------------------------------- trees
    def tree(self, root: str, direction: str, depth: int = DEFAULT_DEPTH) -> Node:
        """Upstream ("up": parents) or downstream ("down": children) tree; each node expanded once."""
        seen: set[str] = set()

        def build(node_id: str, relations: list[str], data_version: str | None, left: int) -> Node:
            kind = self.kinds.get(node_id, "unknown")
            node = Node(node_id, kind, relations, data_version, self.info(node_id, kind))
            edges = self.parents(node_id) if direction == "up" else self.children(node_id)
            if node_id in seen:
                node.shown_above = bool(edges)
                return node
            seen.add(node_id)
            if left <= 0:
                node.truncated = bool(edges)
                return node
            grouped: dict[str, list[Edge]] = {}
            for e in edges:
                grouped.setdefault(e.parent if direction == "up" else e.child, []).append(e)
            for other, es in grouped.items():
                dv = next((e.data_version for e in es if e.data_version), None)
                node.nodes.append(build(other, [e.relation for e in es], dv, left - 1))
            return node

        return build(root, [], None, depth)

    def trained_on_dataset(self, data_version: str) -> list[dict[str, Any]]:
        """Policy versions whose prompt data had this data version (a unique prefix is enough)."""
        keys = {
            k
            for k, v in self.versions.items()
            if (v.get("dataset_data_version") or "").startswith(data_version)
        }
        keys |= {
            e.child
            for e in self.edges
            if e.relation == "prompt_data" and (e.data_version or "").startswith(data_version)
        }
        out = []
        for key in sorted(keys):
            v = self.versions.get(key, {})
            dataset = next((e.parent for e in self.parents(key) if e.relation == "prompt_data"), None)
            out.append(
                {
                    "partition_key": key,
                    "run": v.get("run"),
                    "version": v.get("version"),
                    "dataset": dataset,
                    "dataset_data_version": v.get("dataset_data_version")
                    or next((e.data_version for e in self.parents(key) if e.relation == "prompt_data"), None),
                    "mean_reward": v.get("mean_reward"),
                    "hf_path": v.get("hf_path"),
                }
            )
        return out


def trace(paths: StoragePaths, target: str, depth: int = DEFAULT_DEPTH) -> dict[str, Any]:
    """{"target", "kind", "info", "upstream": Node dict, "downstream": Node dict} for one node."""
    graph = LineageGraph(paths)
    node = graph.resolve(target)
    if node is None:
        raise LineageError(
            f"{target!r} is not in the lineage of {paths.root}: expected a policy-version partition key "
            "(<run>.v<NNNNNN>), a checkpoint / dataset / shard path, or an eval:/publication: id. "
            "List keys with: miles-platform query 'SELECT partition_key FROM policy_versions'"
        )
    up, down = graph.tree(node, "up", depth), graph.tree(node, "down", depth)
    return {
        "target": node,
        "kind": up.kind,
        "info": up.info,
        "upstream": up.to_dict(),
        "downstream": down.to_dict(),
    }


# ----------------------------------------------------------------- text
def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v):
        return v[:12]  # content hashes: a prefix is enough to read and to pass to --dataset-version
    if isinstance(v, str) and len(v) == 40 and all(c in "0123456789abcdef" for c in v):
        return v[:12]  # a git commit, as git log --oneline abbreviates it
    return str(v)


def _label(node: dict[str, Any]) -> str:
    parts = [
        f"{'/'.join(node['relations'])}: " if node["relations"] else "",
        node["id"],
        f"  [{node['kind']}]",
    ]
    shown = {
        k: v for k, v in node["info"].items() if k not in ("run", "created_at", "hf_path", "checkpoint_path")
    }
    if node["data_version"]:
        shown = {"data_version": node["data_version"], **shown}
    if shown:
        parts.append("  " + " ".join(f"{k}={_fmt(v)}" for k, v in shown.items()))
    if node["shown_above"]:
        parts.append("  (shown above)")
    if node["truncated"]:
        parts.append("  (... more: raise --depth)")
    return "".join(parts)


def _render(node: dict[str, Any], prefix: str = "") -> list[str]:
    lines = []
    for i, child in enumerate(node["nodes"]):
        last = i == len(node["nodes"]) - 1
        lines.append(prefix + ("└── " if last else "├── ") + _label(child))
        lines += _render(child, prefix + ("    " if last else "│   "))
    return lines


def format_trace(result: dict[str, Any]) -> str:
    up, down = result["upstream"], result["downstream"]
    lines = [_label(up)]
    for k in ("hf_path", "checkpoint_path"):
        if k in up["info"]:
            lines.append(f"  {k}: {up['info'][k]}")
    lines += ["", "upstream (what it came from):"] + (_render(up) or ["  (none)"])
    lines += ["", "downstream (what came from it):"] + (_render(down) or ["  (none)"])
    return "\n".join(lines)


def _range(ids: list[str]) -> str:
    return ids[0] if len(ids) == 1 else f"{ids[0]} .. {ids[-1]}"


def format_compact(paths: StoragePaths, target: str) -> str:
    """The default view: the node, its own inputs, the chain of versions it was trained from as one
    range, every dataset / checkpoint that chain used once (with how many versions used it), the
    shards as a count, and what came from the node and from its chain downstream, by kind, one
    range per run."""
    g = LineageGraph(paths)
    node = g.resolve(target)
    if node is None:
        trace(paths, target)  # raises the LineageError with the hint
    kind = g.kinds.get(node, "unknown")
    head = _label({"id": node, "kind": kind, "relations": [], "data_version": None, "info": g.info(node, kind),
                   "shown_above": False, "truncated": False})  # fmt: skip
    lines = [head]
    info = g.info(node, kind)
    lines += [f"  {k}: {info[k]}" for k in ("hf_path", "checkpoint_path") if k in info]

    chain, inputs, shards, cur = [], {}, 0, node  # walk trained_from to the first version
    while True:
        prev = None
        for e in g.parents(cur):
            if e.relation == "trained_from" and g.kinds.get(e.parent) == "policy_version":
                prev = e.parent
            elif g.kinds.get(e.parent) == "rollout_shard":
                shards += 1
            else:
                slot = inputs.setdefault(
                    (e.relation, e.parent), {"kind": g.kinds.get(e.parent), "dv": None, "n": 0}
                )
                slot["n"] += 1
                slot["dv"] = slot["dv"] or e.data_version
        if prev is None or prev in chain:
            break
        chain.append(prev)
        cur = prev
    lines += ["", "upstream (what it came from):"]
    if chain:
        lines.append(
            f"  trained from: {_range(chain)}  ({len(chain)} earlier version{'s' * (len(chain) > 1)})"
        )
    for (relation, parent), slot in sorted(inputs.items()):
        dv = f"  data_version={_fmt(slot['dv'])}" if slot["dv"] else ""
        used = f"  (used by {slot['n']} versions)" if slot["n"] > 1 else ""
        lines.append(f"  {relation}: {parent}  [{slot['kind']}]{dv}{used}")
    if shards:
        lines.append(f"  rollout shards: {shards} (one per version; `--full` lists them)")
    if not (chain or inputs or shards):
        lines.append("  (none)")

    below: dict[tuple[str, str], set[str]] = {}  # (kind, run) -> ids: one range per run
    for n in [node, *chain]:
        for e in g.children(n):
            if e.relation == "trained_from" and g.kinds.get(e.child) == "policy_version" and n != node:
                continue  # the chain itself
            run = m.group(1) if (m := _KEY_RE.search(e.child)) else ""
            below.setdefault((g.kinds.get(e.child) or "unknown", run), set()).add(e.child)
    lines += ["", "downstream (what came from it and its chain):"]
    for (k, _), ids in sorted(below.items()):
        ids = sorted(ids)
        shown = ", ".join(ids) if len(ids) <= 3 else f"{ids[0]} .. {ids[-1]} ({len(ids)})"
        lines.append(f"  {k}: {shown}")
    if not below:
        lines.append("  (none)")
    lines.append("\n(the full tree: --full; machine-readable: --json)")
    return "\n".join(lines)


def format_dataset_versions(data_version: str, rows: list[dict[str, Any]]) -> str:
    if not rows:
        return f"no policy version was trained on dataset version {data_version}"
    lines = [f"policy versions trained on dataset version {data_version}:"]
    lines += [
        f"  {r['partition_key']}  mean_reward={_fmt(r['mean_reward'])}  dataset={r['dataset']}  "
        f"data_version={_fmt(r['dataset_data_version'])}"
        for r in rows
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------- CLI
def cli_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="miles-platform lineage",
        description="trace a policy version or checkpoint up- and downstream, or list what trained on a dataset version",
    )
    ap.add_argument("target", nargs="?", help="policy-version partition key <run>.v<NNNNNN>, or a path / id")
    ap.add_argument("--storage-root", default=os.environ.get("MILES_STORAGE_ROOT", ".miles"))
    ap.add_argument("--json", action="store_true", help="machine-readable output (the full tree)")
    ap.add_argument(
        "--full",
        action="store_true",
        help="the tree node by node, --depth levels up and down (default: a compact view: "
        "the version chain as a range, each dataset and base once, downstream by kind and run)",
    )
    ap.add_argument(
        "--dataset-version", metavar="HASH", help="list policy versions trained on this data version"
    )
    ap.add_argument(
        "--depth",
        type=int,
        default=DEFAULT_DEPTH,
        help=f"levels up and down of --full / --json (default {DEFAULT_DEPTH})",
    )
    args = ap.parse_args(argv)
    if not args.target and not args.dataset_version:
        ap.error("give a target (partition key or path) or --dataset-version HASH")
    paths = StoragePaths(args.storage_root)
    error = paths.missing_root_error("miles-platform lineage")
    if error:
        print(error, file=sys.stderr)
        return 2
    try:
        if args.dataset_version:
            rows = LineageGraph(paths).trained_on_dataset(args.dataset_version)
            out = {"dataset_version": args.dataset_version, "policy_versions": rows}
            text = format_dataset_versions(args.dataset_version, rows)
            if args.target:
                out["trace"] = trace(paths, args.target, args.depth)
                text = format_trace(out["trace"]) + "\n\n" + text
        else:
            out = trace(paths, args.target, args.depth)
            text = format_trace(out) if args.full else format_compact(paths, args.target)
    except CatalogError as e:
        print(f"miles-platform lineage: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, default=str, indent=1) if args.json else text)
    return 0
