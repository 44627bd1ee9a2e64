"""Run-health checks over a storage root: the silent failures of a run, found in what it left.

Each check reads the store through its writers' layout (shards, `policy_versions` rows, lineage,
the run's `run_config.json`, HF exports) and returns a `Health`: passed, one line per problem
(naming the run, version or rollout and what to look at), and numbers per run. Dagster wraps them
as asset checks (assets/run_health.py); they need no Dagster.

- contiguous_rollout_ids: every run's shards are rollouts 0..N-1 with no gap, and the shard each
  version names exists.
- expected_version_count: versions are numbered 1..N with no gap; every rollout due a weight
  update (`(rollout_id + 1) % --update-weights-interval == 0`) up to the last one recorded trained
  a version; a finished run (`--num-rollout` rollouts recorded) has num_rollout // interval of them.
- async_staleness: with --max-weight-staleness, no sample of a version's rollout started more than
  that many versions before the engine version it was trained at (the version's parent); the
  largest staleness and in-generation span (weight_version_end - weight_version_start) per run.
- hf_export_sanity: each version's weights dir holds what its model kind should (store/model_kinds.py):
  an HF export config.json + safetensors, a diffusers pipeline every component model_index.json
  names, with the key set and parameter count of the run's base; a PEFT adapter lora_A / lora_B
  pairs of its rank fitting the base's modules, with the key set of the run's first adapter. A run
  of no known kind is listed as not checked.
- prompt_coverage: the data source's epochs, seen in the trained groups. Each epoch serves every
  prompt of --prompt-data once, so a run that drew a full epoch (trained + dynamically dropped
  groups, beyond one --over-sampling-batch-size of buffer) trained every prompt but the dropped
  ones, and no prompt was trained in more epochs than were started. A resume that replays an epoch
  or a data-order bug turns it red. Runs whose --rollout-function-path draws prompts its own way,
  or whose prompt data cannot be read here, are listed as not checked.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
import pyarrow.parquet as pq

from miles_platform.config import RunConfig
from miles_platform.metric_names import DROP_METRIC_PREFIX  # groups drawn, not trained
from miles_platform.store.lineage_identity import read_edges
from miles_platform.store.model_kinds import (
    KINDS,
    MARKERS,
    Census,
    ExportError,
    ModelKind,
    kind_of,
    parameters,
)
from miles_platform.store.paths import StoragePaths
from miles_platform.store.run_events import abandoned_numbers, committed_rows, resume_events
from miles_platform.store.shards import list_rollout_shards, shard_path
from miles_platform.store.tables import read_rows

MAX_LINES = 20  # problems listed per check (the count says how many in all)


@dataclass
class Health:
    problems: list[str] = field(default_factory=list)
    per_run: dict[str, dict] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.problems


def _runs(paths: StoragePaths) -> list[str]:
    runs = set()
    for sub in ("rollouts", "tables/policy_versions"):
        fs, root = fsspec.core.url_to_fs(paths.join(*sub.split("/")))
        if fs.exists(root):
            runs |= {p.rsplit("/run=", 1)[1] for p in fs.glob(f"{root}/run=*")}
    return sorted(runs)


def _versions(paths: StoragePaths, run: str) -> list[dict]:
    return sorted(read_rows(paths, "policy_versions", run), key=lambda r: r["version"])


def saved_run_config(paths: StoragePaths, run: str, rows: list[dict]) -> RunConfig | None:
    """The run's `run_config.json` (beside its checkpoints, local or on an object store); None
    when it has none."""
    from miles_platform.store import remote

    dirs = [r["checkpoint_path"].rstrip("/").rpartition("/")[0] for r in rows if r.get("checkpoint_path")]
    for d in [*dirs, paths.checkpoints(run)]:
        f = f"{d}/run_config.json"
        if "://" in f:
            data = remote.read_bytes(f)
        else:
            data = Path(f).read_bytes() if Path(f).is_file() else None
        if data is None:
            continue
        try:
            return RunConfig.from_dict(json.loads(data))
        except Exception:  # noqa: BLE001 - an older or hand-edited file: checks that need it skip
            return None
    return None


def last_rollout_id(paths: StoragePaths, run: str) -> int:
    """The newest rollout the run recorded (metrics or a shard); -1 for none."""
    done = {m["rollout_id"] for m in read_rows(paths, "metrics", run)} | set(list_rollout_shards(paths, run))
    return max(done, default=-1)


def run_finished(paths: StoragePaths, run: str) -> bool:
    """The run recorded its `--num-rollout`th rollout (by its saved run_config.json)."""
    cfg = saved_run_config(paths, run, _versions(paths, run))
    return cfg is not None and bool(cfg.num_rollout) and last_rollout_id(paths, run) + 1 >= cfg.num_rollout


def contiguous_rollout_ids(paths: StoragePaths) -> Health:
    out = Health()
    for run in _runs(paths):
        ids = list_rollout_shards(paths, run)
        gaps = sorted(set(range(max(ids) + 1)) - set(ids)) if ids else []
        if gaps:
            out.problems.append(
                f"run {run}: rollout shards missing for rollout ids {gaps[:10]} (of 0..{max(ids)})"
            )
        for r in _versions(paths, run):
            fs, p = fsspec.core.url_to_fs(r["shard_path"] or "")
            if not r["shard_path"] or not fs.exists(p):
                out.problems.append(f"{r['partition_key']}: its shard {r['shard_path']} is missing")
        out.per_run[run] = {
            "shards": len(ids),
            "max_rollout_id": max(ids) if ids else None,
            "gaps": len(gaps),
        }
    return out


def expected_version_count(paths: StoragePaths) -> Health:
    out = Health()
    for run in _runs(paths):
        rows = _versions(paths, run)
        cfg = saved_run_config(paths, run, rows)
        if cfg is not None and cfg.debug_rollout_only:
            continue  # no trainer: no versions by design
        numbers = [r["version"] for r in rows]
        # numbers a resume abandoned (made after the last checkpoint, some never recorded) are no gap
        gone = abandoned_numbers(resume_events(paths, run))
        missing = sorted(set(range(1, max(numbers, default=0) + 1)) - set(numbers) - gone)
        if missing:
            out.problems.append(
                f"run {run}: versions {missing[:10]} missing (versions run 1..{max(numbers)})"
            )
        if len(set(numbers)) != len(numbers):
            dupes = sorted(n for n, k in Counter(numbers).items() if k > 1)
            out.problems.append(f"run {run}: version numbers recorded twice: {dupes[:10]}")
        interval = cfg.update_weights_interval if cfg else 1
        last = last_rollout_id(paths, run)
        due = {r for r in range(last + 1) if (r + 1) % interval == 0}
        trained = {r["rollout_id"] for r in committed_rows(paths, "policy_versions", run, rows)}
        lost = sorted(due - trained)
        if lost:
            out.problems.append(
                f"run {run}: rollouts {lost[:10]} were due a weight update but trained no version"
            )
        expected = None
        if cfg is not None and cfg.num_rollout and last + 1 >= cfg.num_rollout:
            expected = cfg.num_rollout // interval
            if len(trained & due) != expected:
                out.problems.append(
                    f"run {run}: finished ({cfg.num_rollout} rollouts) with {len(trained & due)} trained "
                    f"versions, expected {expected} (--num-rollout // --update-weights-interval {interval})"
                )
        out.per_run[run] = {"versions": len(rows), "last_rollout_id": last, "expected": expected}
    return out


def async_staleness(paths: StoragePaths) -> Health:
    out = Health()
    for run in _runs(paths):
        rows = _versions(paths, run)
        cfg = saved_run_config(paths, run, rows)
        bound = cfg.max_weight_staleness if cfg is not None else None
        worst = span = 0
        for r in rows:
            fs, p = fsspec.core.url_to_fs(r["shard_path"] or "")
            if not r["shard_path"] or not fs.exists(p):
                continue  # contiguous_rollout_ids reports it
            with fs.open(p, "rb") as f:
                t = pq.read_table(f, columns=["weight_version_start", "weight_version_end"]).to_pylist()
            starts = [s["weight_version_start"] for s in t if s["weight_version_start"] is not None]
            ends = [s["weight_version_end"] for s in t if s["weight_version_end"] is not None]
            stale = r["parent_version"] - min(starts) if starts else 0
            worst = max(worst, stale)
            span = max(span, max((e - s for s, e in zip(starts, ends, strict=False)), default=0))
            if bound is not None and stale > bound:
                out.problems.append(
                    f"{r['partition_key']}: rollout {r['rollout_id']} has samples {stale} versions stale "
                    f"(trained at v{r['parent_version']}, oldest sample from v{min(starts)}) > "
                    f"--max-weight-staleness {bound}"
                )
        out.per_run[run] = {"max_weight_staleness": bound, "max_staleness": worst, "max_span": span}
    return out


def _base_census(kind: ModelKind, base: str | None) -> tuple[Census | None, str]:
    """The census of the run's base checkpoint as `kind`'s base (None when not readable here)."""
    name, base_kind = f"base checkpoint {base}", KINDS[kind.base_kind]
    if kind_of(base) is not base_kind:
        return None, name
    try:
        return base_kind.census(Path(base)), name
    except ExportError:
        return None, name


def _run_kind(rows: list[dict], base: str | None) -> ModelKind | None:
    """A LoRA run's versions are adapters; otherwise the kind of the base, else of the first export
    of a known kind."""
    if any(r.get("adapter_path") for r in rows):
        return KINDS["peft_adapter"]
    return next(filter(None, map(kind_of, [base, *(r.get("hf_path") for r in rows)])), None)


def _check_exports(kind: ModelKind, base: str | None, exports: list[tuple[str, str]], out: Health) -> dict:
    """Each (partition key, dir) as `kind`: readable, the reference's key set and parameter count
    (the base's, else the run's first readable one), and fitting the base (adapters)."""
    base_census, base_name = _base_census(kind, base)
    ref, ref_name = (base_census, base_name) if kind.base_is_reference and base_census else (None, None)
    fit_name = f"the {base_name}" if base_census is not None else "adapter_config.json r"
    for key, d in exports:
        try:
            got = kind.census(Path(d))
        except ExportError as e:
            out.problems.append(f"{key}: {kind.label} {d}: {e}")
            continue
        if ref is None:
            ref, ref_name = got, f"first {kind.noun} {key}"
        if kind.misfits is not None:
            out.problems += [f"{key}: {p}" for p in kind.misfits(Path(d), got, base_census, fit_name)]
        if set(got) != set(ref):
            extra, lost = sorted(set(got) - set(ref)), sorted(set(ref) - set(got))
            out.problems.append(
                f"{key}: key set differs from the {ref_name}: missing {lost[:5]}, extra {extra[:5]}"
            )
        elif parameters(got) != parameters(ref):
            out.problems.append(f"{key}: {parameters(got)} parameters, the {ref_name} has {parameters(ref)}")
    if kind.misfits is not None and ref_name:
        ref_name += f", fitting {base_name if base_census is not None else 'no readable base'}"
    return {"kind": kind.name, "exports_checked": len(exports),
            "parameters": parameters(ref) if ref else 0, "reference": ref_name}  # fmt: skip


def hf_export_sanity(paths: StoragePaths) -> Health:
    """Every version's weights dir checked as what its run trains: an HF export, a diffusers
    pipeline or a PEFT adapter (store/model_kinds.py); a run of no known kind is listed, not failed."""
    out = Health()
    for run in _runs(paths):
        rows = _versions(paths, run)
        exports = [(r["partition_key"], r.get("adapter_path") or r.get("hf_path")) for r in rows]
        exports = [(k, d) for k, d in exports if d and "://" not in d]
        if not exports:
            continue
        edges = read_edges(paths, run)  # an old row's relative base resolved where knowable
        base = next((e.parent for e in edges if e.relation == "base_checkpoint" and e.parent), None)
        kind = _run_kind(rows, base)
        if kind is None:
            out.per_run[run] = {"kind": "unknown", "exports_checked": 0, "parameters": None,
                                "reference": f"not checked: no {MARKERS} in the base or any export"}  # fmt: skip
            continue
        out.per_run[run] = _check_exports(kind, base, exports, out)
    return out


def _prompt_multiplicity(cfg: RunConfig) -> Counter | None:
    """{prompt text: times it is in --prompt-data} (raw, before any chat template), or None
    when the data cannot be read here."""
    from miles_platform.data.dataset import load_prompt_dataset

    try:
        records = load_prompt_dataset(cfg.prompt_data, input_key=cfg.input_key, label_key=cfg.label_key,
                                      metadata_key=cfg.metadata_key, apply_chat_template=False)  # fmt: skip
    except Exception:  # noqa: BLE001 - a relative path, a moved file, messages that need a template
        return None
    return Counter(r.prompt if isinstance(r.prompt, str) else json.dumps(r.prompt) for r in records)


def prompt_coverage(paths: StoragePaths) -> Health:
    out = Health()
    for run in _runs(paths):
        rows = _versions(paths, run)
        cfg = saved_run_config(paths, run, rows)
        why = None
        if cfg is None:
            why = "no run_config.json"
        elif cfg.rollout_function_path:
            why = "--rollout-function-path draws its own prompts"
        data = None if why else _prompt_multiplicity(cfg)
        if why is None and data is None:
            why = f"--prompt-data {cfg.prompt_data} unreadable here"
        if why:
            out.per_run[run] = {"dataset_prompts": None, "trained_prompts": None, "epochs_drawn": None,
                                "most_trained": None, "not_checked": why}  # fmt: skip
            continue
        groups: dict[tuple[int, int], str] = {}  # (rollout, group) -> its prompt
        for rid in list_rollout_shards(paths, run):
            with fsspec.open(shard_path(paths, run, rid), "rb") as fh:
                t = pq.read_table(fh, columns=["group_index", "prompt"]).to_pylist()
            for s in t:
                groups.setdefault((rid, s["group_index"]), s["prompt"])
        dropped = sum(
            int(m["value"])
            for m in committed_rows(paths, "metrics", run)
            if m["name"].startswith(DROP_METRIC_PREFIX)
        )
        n = sum(data.values())
        trained = Counter(groups.values())
        drawn = len(groups) + dropped
        slack = cfg.over_sampling_batch_size or cfg.rollout_batch_size  # generated, still buffered
        epochs = -(-(drawn + slack) // n)  # epochs started, at most
        # a chat template renders the stored prompt: match by count, not by text
        by_text = {k for k in trained if k in data} == set(trained)
        if by_text:
            never = sorted(k for k in data if k not in trained)
            over = sorted((k for k, c in trained.items() if c > epochs * data[k]), key=lambda k: -trained[k])
        else:
            never = [None] * max(0, len(data) - len(trained))
            most = epochs * max(data.values())
            over = sorted((k for k, c in trained.items() if c > most), key=lambda k: -trained[k])
        if drawn >= n + slack and len(never) > dropped:
            shown = [p for p in never if p is not None][:5]
            out.problems.append(
                f"run {run}: {len(never)} of {len(data)} prompts never trained after {drawn} groups drawn "
                f"from {n} prompts ({dropped} dropped by filters){': ' + repr(shown) if shown else ''}"
            )
        for k in over[:5]:
            out.problems.append(
                f"run {run}: prompt {k!r} trained {trained[k]} times, but at most {epochs} epochs of "
                f"the data were started (the data order repeats prompts: a resume that replayed an epoch?)"
            )
        out.per_run[run] = {
            "dataset_prompts": n,
            "trained_prompts": len(trained),
            "epochs_drawn": round(drawn / n, 2),
            "most_trained": max(trained.values(), default=0),
            "not_checked": "",
        }
    return out


CHECKS = {
    "contiguous_rollout_ids": ("rollout_shards", contiguous_rollout_ids),
    "async_staleness": ("rollout_shards", async_staleness),
    "expected_version_count": ("policy_versions", expected_version_count),
    "hf_export_sanity": ("policy_versions", hf_export_sanity),
    "prompt_coverage": ("rollout_shards", prompt_coverage),
}
