"""The one path from a policy version to Dagster: the events of a `PolicyVersion`.

A version (`PolicyVersion`, store/versions.py) becomes: its dynamic partition `<run>.v<NNNNNN>`;
a `rollout_shards` materialization (and for a LoRA version a `lora_adapters` one) when it is made;
a `policy_versions` materialization with its rollout's training metrics (the asset's Plots) and
the run's eval settings (`eval_config`, what the eval sensor launches `eval_results` with); and,
when a resume abandons it, an observation `status: abandoned`. The same lineage metadata whoever
reports it:

- `DagsterReporter`: the `rl_training` / `diffusion_training` op, as its loop makes versions (the
  quickstart runs that op);
- `CatalogVersions`: versions read back from the catalog (`read_policy_versions`), by the op under
  `launcher: ray_job` (`run_version_reports`, on every poll) and by the `runs_from_catalog` sensor
  (runs trained outside Dagster), with `reported_by` saying who reported them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import dagster as dg

from assets.evals import eval_config_for_run
from miles_platform.run_types import Reporter
from miles_platform.store.paths import DIFFUSION_CONFIG, StoragePaths
from miles_platform.store.run_events import committed_rows
from miles_platform.store.run_health import saved_run_config
from miles_platform.store.tables import read_rows
from miles_platform.store.versions import PolicyVersion, read_policy_versions
from miles_platform.viewer import DEFAULT_PORT, VIEWER_URL_ENV

POLICY_VERSIONS = dg.AssetKey("policy_versions")
DATA_VERSION_TAG = "dagster/data_version"
REPORTED_BY = {"reported_by": "runs_from_catalog"}
PREVIEW_ROWS = 3


# ------------------------------------------------------------------ the events of one version


def made_events(pv: PolicyVersion, extra: dict[str, Any] | None = None) -> list[dg.AssetMaterialization]:
    """What a version is made of, logged as soon as it is: its rollout shard and, for a LoRA
    version, its adapter dir (on the frozen base it names)."""
    events = [rollout_shard_event(pv, extra)]
    if pv.adapter_path and pv.base_checkpoint and os.path.isdir(pv.adapter_path):
        events.append(lora_adapter_event(pv, extra))
    return events + served_quantized_events(pv, extra)


def served_quantized_events(
    pv: PolicyVersion, extra: dict[str, Any] | None = None
) -> list[dg.AssetMaterialization]:
    """A version the run's engines served quantized (a quantized --hf-checkpoint: the fp8 / int4 copy
    beside its HF export, weights/rollout_quant.py) is a `quantized_weights[<version>|<fmt>]`
    materialization, made by the run rather than by the asset (which writes the same path)."""
    from assets.partitions import QUANT_FORMATS
    from miles_platform.store.paths import served_path

    events = []
    for fmt in QUANT_FORMATS if pv.hf_path else ():
        path = served_path(pv.hf_path, fmt)
        weights = os.path.join(path, "model.safetensors")
        if not os.path.exists(weights):
            continue
        events.append(dg.AssetMaterialization(
            asset_key="quantized_weights",
            partition=dg.MultiPartitionKey({"policy_version": pv.partition_key, "format": fmt}),
            metadata={**_lineage(pv), "format": fmt, "path": dg.MetadataValue.path(path),
                      "hf_path": dg.MetadataValue.path(pv.hf_path), "bytes": os.path.getsize(weights),
                      "served_by_run": True, "weight_version": pv.version, **(extra or {})},
        ))  # fmt: skip
    return events


def version_events(
    pv: PolicyVersion,
    metrics: dict[str, float],
    eval_config: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> list[dg.AssetMaterialization]:
    """Every materialization of a version at once (a version read back from the catalog)."""
    return [*made_events(pv, extra), policy_version_event(pv, metrics, eval_config, extra)]


def rollout_shard_event(pv: PolicyVersion, extra: dict[str, Any] | None = None) -> dg.AssetMaterialization:
    return dg.AssetMaterialization(
        asset_key="rollout_shards",
        partition=pv.partition_key,
        metadata={
            **_lineage(pv),
            "path": dg.MetadataValue.path(pv.shard_path),
            "rows": pv.shard_rows,
            "mean_reward": float(pv.mean_reward or 0.0),
            **shard_summary(pv.shard_path, pv.run),
            "viewer": viewer_link(pv, rollout_from=pv.rollout_id, rollout_to=pv.rollout_id),
            **(extra or {}),
        },
    )


def shard_summary(path: str, run: str | None = None) -> dict[str, Any]:
    """What the asset page shows of a shard without a query: reward std, truncation share, response
    lengths, and the first samples (prompt, response, reward, status) as a small table; a
    vision-language run's samples also name their image (content hash) and show it beside."""
    import fsspec
    import pyarrow.parquet as pq

    cols = ["prompt", "response", "reward", "raw_reward", "status", "response_length"]
    try:
        with fsspec.open(path, "rb") as f:
            shard = pq.ParquetFile(f)  # the preview's columns only (a shard holds token lists too)
            images = ["image_hashes"] if "image_hashes" in shard.schema_arrow.names else []
            rows = shard.read(columns=[*cols, *images]).to_pylist()
    except Exception as e:  # a preview must never fail the version's materialization
        return {"preview": dg.MetadataValue.text(f"preview unavailable: {type(e).__name__}: {e}")}
    if not rows:
        return {}
    rewards = [float(r["raw_reward"] if r["raw_reward"] is not None else r["reward"] or 0.0) for r in rows]
    mean = sum(rewards) / len(rewards)
    lens = [int(r["response_length"] or 0) for r in rows]

    def cell(text: Any, n: int = 80) -> str:
        t = str(text).replace("|", "\\|").replace("\n", "\\n")
        return t if len(t) <= n else t[: n - 1] + "…"

    first = rows[:PREVIEW_ROWS]
    hashes = [(r.get("image_hashes") or [None])[0] for r in first]
    images = any(hashes)
    table = ["| prompt | response | reward | status |" + (" image |" if images else ""),
             "| --- | --- | --- | --- |" + (" --- |" if images else "")]  # fmt: skip
    table += [
        f"| {cell(r['prompt'])} | {cell(r['response'])} | {rw:.3g} | {r['status']} |"
        + (f" {(h or '-')[:12]} |" if images else "")
        for r, rw, h in zip(first, rewards, hashes, strict=False)
    ]
    extra = _sample_images(path, run, hashes) if images else {}
    return {
        **extra,
        "reward_std": math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards)),
        "truncated": sum(r["status"] == "truncated" for r in rows) / len(rows),
        "response_len_mean": sum(lens) / len(lens),
        "response_len_max": max(lens),
        "preview": dg.MetadataValue.md("\n".join(table)),
    }


def _sample_images(path: str, run: str | None, hashes: list[str | None]) -> dict[str, Any]:
    """The preview rows' images (from the run's prompt data, as the viewer serves them) as one
    thumbnail strip; nothing when they cannot be read (a remote root, a run without its config)."""
    from assets.metadata import image_markdown
    from miles_platform.data.images import thumbnail_grid
    from miles_platform.store.paths import StoragePaths
    from miles_platform.viewer.prompt_images import PromptImages

    root = path.rpartition("/rollouts/run=")[0]
    try:
        source = _PROMPT_IMAGES.setdefault(root, PromptImages(StoragePaths(root)))
        found = [source.get(run, h)[0] for h in hashes if h]
        png = thumbnail_grid(found)
    except Exception:  # a preview must never fail the version's materialization
        return {}
    return {"images": image_markdown(png, "the images of the samples above, in order")}


_PROMPT_IMAGES: dict[str, Any] = {}  # storage root -> its runs' prompt images (loaded once per run)


def viewer_link(pv: PolicyVersion, **params: Any) -> dg.MetadataValue:
    """The partition's samples in the rollout viewer (miles_platform/viewer): a link under
    $MILES_VIEWER_URL (the base URL of a running viewer, set where Dagster runs), else the command
    that starts one. The link carries no token: the viewer's cookie, set by the URL it printed, does."""
    base = os.environ.get(VIEWER_URL_ENV, "").strip().rstrip("/")
    if base.startswith(("http://", "https://")):
        return dg.MetadataValue.url(f"{base}/samples?{urlencode({'run': pv.run, **params})}")
    root = pv.shard_path.rpartition("/rollouts/run=")[0] or "<storage root>"
    bad = f" ({VIEWER_URL_ENV}={base!r} is not an http(s) URL)" if base else ""
    return dg.MetadataValue.text(
        f"miles-platform viewer --storage-root {root}, then start Dagster with "
        f"{VIEWER_URL_ENV}=http://127.0.0.1:{DEFAULT_PORT} to link here{bad}"
    )


def lora_adapter_event(pv: PolicyVersion, extra: dict[str, Any] | None = None) -> dg.AssetMaterialization:
    return dg.AssetMaterialization(
        asset_key="lora_adapters",
        partition=pv.partition_key,
        metadata={
            **_lineage(pv),
            "path": dg.MetadataValue.path(pv.adapter_path),
            "base_checkpoint": dg.MetadataValue.path(pv.base_checkpoint),
            "shard_path": dg.MetadataValue.path(pv.shard_path),
            "content_hash": pv.content_hash,
            "size_bytes": _dir_bytes(pv.adapter_path),
            **(extra or {}),
        },
        tags={DATA_VERSION_TAG: pv.content_hash},
    )


def policy_version_event(
    pv: PolicyVersion,
    metrics: dict[str, float],
    eval_config: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> dg.AssetMaterialization:
    """`metrics`: the training metrics of the rollout that made the version (plotted);
    `eval_config`: the `eval_results` config that evaluates it (read by the eval sensor)."""
    return dg.AssetMaterialization(
        asset_key="policy_versions",
        partition=pv.partition_key,
        metadata={
            **_lineage(pv),
            # a LoRA version points at its adapter and the base, not at a merged copy
            "path": dg.MetadataValue.path(pv.hf_path or pv.adapter_path),
            "hf_path": dg.MetadataValue.path(pv.hf_path or ""),
            **_lora_metadata(pv),
            "checkpoint_path": dg.MetadataValue.path(pv.checkpoint_path or ""),
            "content_hash": pv.content_hash,
            "shard_path": dg.MetadataValue.path(pv.shard_path),
            "mean_reward": float(pv.mean_reward or 0.0),
            "eval_config": dg.MetadataValue.json(eval_config),  # eval_results' run config
            "viewer": viewer_link(pv, version=pv.version),
            **_plottable(metrics),
            **(extra or {}),
        },
        tags={DATA_VERSION_TAG: pv.content_hash},
    )


def abandoned_observations(
    partition_keys: list[str], rollout_id: int, version: int
) -> list[dg.AssetObservation]:
    """Versions a crashed attempt made after its last checkpoint, which a resume from (rollout_id,
    version) abandoned: an observation on each `policy_versions` partition says so (the catalog's
    status column says it too)."""
    return [
        dg.AssetObservation(
            asset_key="policy_versions",
            partition=key,
            metadata={
                "status": "abandoned",
                "resumed_from_rollout": rollout_id,
                "resumed_from_version": version,
            },
        )  # fmt: skip
        for key in partition_keys
    ]


def _plottable(metrics: dict[str, Any]) -> dict[str, Any]:
    """A rollout's metrics as float metadata (the asset's Plots tab draws one line per key);
    a non-finite value stays visible as text instead of breaking the plot."""
    out: dict[str, Any] = {}
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[name] = float(value) if math.isfinite(value) else dg.MetadataValue.text(str(value))
    return out


def _lora_metadata(pv: PolicyVersion) -> dict[str, Any]:
    if not pv.adapter_path:
        return {}
    return {"adapter_path": dg.MetadataValue.path(pv.adapter_path),
            "base_checkpoint": dg.MetadataValue.path(pv.base_checkpoint)}  # fmt: skip


def _dir_bytes(path: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())


def _lineage(pv: PolicyVersion) -> dict[str, Any]:
    """Metadata both training assets carry. Identifiers are text: numbers would be plotted."""
    lineage: dict[str, Any] = {
        "run": pv.run,
        "version": dg.MetadataValue.text(str(pv.version)),
        "rollout_id": dg.MetadataValue.text(str(pv.rollout_id)),
        "parent_version": dg.MetadataValue.text(pv.parent_partition_key),
        "config_hash": pv.config_hash,
        # the code that made it (store/code_version.py); "" where unknown or recorded before it was kept
        "platform_version": pv.platform_version or "",
        "git_commit": pv.git_commit or "",
        "git_dirty": dg.MetadataValue.text("" if pv.git_dirty is None else str(pv.git_dirty).lower()),
        "base_data_version": pv.base_data_version or "",
        "dataset_data_version": pv.dataset_data_version or "",
    }
    if pv.distilled_from:  # on-policy distillation: the teacher checkpoint(s), by content hash
        lineage["distilled_from"] = dg.MetadataValue.json(pv.distilled_from)
    if pv.eval_interval:  # read by the eval_on_new_policy sensor
        lineage["eval_interval"] = dg.MetadataValue.text(str(int(pv.eval_interval)))
    if pv.final:  # the run's last version: the eval sensor always evaluates it
        lineage["final"] = dg.MetadataValue.text("true")
    return lineage


# ------------------------------------------------------------------ reported as the loop makes them


class DagsterReporter(Reporter):
    """Each policy version -> a dynamic partition plus `rollout_shards` and `policy_versions`
    materializations. The loop reports a version just before that rollout's metrics, so the
    `policy_versions` event waits for them (or for `flush`) to carry them as plottable floats.
    `extra`: metadata on every event (a diffusion run's `task: diffusion`)."""

    def __init__(
        self,
        context: dg.OpExecutionContext,
        eval_config: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ):
        self.context = context
        self.eval_config = eval_config or {}
        self.extra = extra
        self._pending: PolicyVersion | None = None

    def log(self, msg: str) -> None:
        self.context.log.info(msg)

    def on_policy_version(self, pv: PolicyVersion) -> None:
        self.flush()
        self.context.instance.add_dynamic_partitions("policy_versions", [pv.partition_key])
        for event in made_events(pv, self.extra):
            self.context.log_event(event)
        self._pending = pv

    def on_rollout(self, rollout_id: int, metrics: dict[str, float]) -> None:
        if self._pending is not None and self._pending.rollout_id == rollout_id:
            self.context.log_event(policy_version_event(self._pending, metrics, self.eval_config, self.extra))
            self._pending = None

    def on_versions_abandoned(self, partition_keys: list[str], rollout_id: int, version: int) -> None:
        known = set(self.context.instance.get_dynamic_partitions("policy_versions"))
        for event in abandoned_observations([k for k in partition_keys if k in known], rollout_id, version):
            self.context.log_event(event)

    def flush(self) -> None:
        """Log a version whose rollout metrics never came (the run failed in between)."""
        if self._pending is not None:
            self.context.log_event(policy_version_event(self._pending, {}, self.eval_config, self.extra))
            self._pending = None


# ------------------------------------------------------------------ read back from the catalog


@dataclass
class CatalogVersions:
    """One run's versions as the catalog has them, with what their events carry besides the row:
    the rollout's metrics (`metrics` table), the run's eval settings (from its `run_config.json`
    unless given) and `extra` (`reported_by`; `evaluated_in_loop` for a run that evaluates itself:
    a `miles-platform train` run with --eval-interval and --eval-prompt-data, a diffusion run)."""

    versions: dict[str, PolicyVersion]  # by partition key
    metrics: dict[int, dict[str, float]]  # by rollout id
    eval_config: dict[str, Any]
    extra: dict[str, Any]

    @classmethod
    def read(
        cls,
        paths: StoragePaths,
        run: str,
        rows: list[dict[str, Any]],
        eval_config: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> CatalogVersions:
        cfg = saved_run_config(paths, run, rows)
        metrics: dict[int, dict[str, float]] = {}
        for m in read_rows(paths, "metrics", run):
            metrics.setdefault(m["rollout_id"], {})[m["name"]] = m["value"]
        if eval_config is None:
            eval_config = eval_config_for_run(cfg) if cfg is not None else {}
        extra = dict(REPORTED_BY if extra is None else extra)
        if cfg is not None and cfg.eval_prompt_data and cfg.eval_interval:
            extra["evaluated_in_loop"] = "true"  # the run's own evals are in `evals`: the sensor skips it
        if cfg is not None and cfg.multimodal_keys:  # image prompts: the text eval_dataset does not apply
            extra.update(task="vlm", evaluated_in_loop="true")
        # a diffusion run evaluates itself
        if os.path.isfile(os.path.join(paths.run_dir(run), DIFFUSION_CONFIG)):
            extra.update(task="diffusion", evaluated_in_loop="true")
        versions: dict[str, PolicyVersion] = {}
        for pv in read_policy_versions(paths, run, rows, cfg):
            versions.setdefault(pv.partition_key, pv)  # a key's first row, as the sensor walks them
        return cls(versions, metrics, eval_config, extra)

    def events(self, key: str) -> list[dg.AssetMaterialization]:
        """The materializations of the version with partition key `key`."""
        pv = self.versions[key]
        return version_events(pv, self.metrics.get(pv.rollout_id, {}), self.eval_config, self.extra)


def run_version_reports(
    instance: dg.DagsterInstance,
    paths: StoragePaths,
    run: str,
    *,
    eval_config: dict[str, Any],
    extra: dict[str, str],
    complete: bool,
) -> tuple[list[dg.AssetMaterialization], list[str]]:
    """The events and new partition keys of one run's versions that have no `policy_versions`
    materialization yet: how the `rl_training` op reports a run it launched as a Ray job. Until
    the run is `complete`, a version waits for its rollout's metrics (written just after it)."""
    reported = set(instance.get_materialized_partitions(POLICY_VERSIONS))
    committed = committed_rows(paths, "policy_versions", run)  # a resume abandons versions: never reported
    latest = {r["partition_key"]: r for r in committed}  # a resume's row wins
    rows = [r for k, r in latest.items() if k not in reported]
    if not rows:
        return [], []
    stored = CatalogVersions.read(paths, run, rows, eval_config, extra)
    if not complete:
        rows = [r for r in rows if r["rollout_id"] in stored.metrics]
    rows.sort(key=lambda r: r["version"])
    return [e for r in rows for e in stored.events(r["partition_key"])], [r["partition_key"] for r in rows]
