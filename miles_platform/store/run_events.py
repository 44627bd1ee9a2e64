"""Committed and abandoned rows: what a resume leaves behind.

A run that crashes after its last checkpoint has already recorded versions (and metrics) that the
resumed run will not build on: it restarts from the checkpoint, numbers its next version past
every number any store knows, and branches from the checkpoint's version. Tables are append-only,
so nothing is rewritten; the resume appends one `run_events` row instead:

    event 'resume', rollout_id = the checkpoint's rollout, version = the checkpoint's version

and a row made before that event is *abandoned* when it lies past the checkpoint:

    policy_versions   version    > event.version    and created_at < event.created_at
    metrics / evals   rollout_id > event.rollout_id and created_at < event.created_at  (metrics)
                      version    > event.version    and created_at < event.created_at  (evals)
    train_samples     rollout_id > event.rollout_id and created_at < event.created_at

Everything else is committed. The DuckDB views carry this as a `status` column ('committed' |
'abandoned', catalog.py builds the same rule in SQL); Python readers use `committed_rows`.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from miles_platform.store.paths import StoragePaths
from miles_platform.store.schemas import KEYED_BY


def resume_events(paths: StoragePaths, run: str) -> list[dict[str, Any]]:
    from miles_platform.store.tables import read_rows

    return [e for e in read_rows(paths, "run_events", run) if e["event"] == "resume"]


def abandoned_numbers(events: list[dict[str, Any]]) -> set[int]:
    """Every version number the resumes abandoned, recorded or not (an export whose row never came)."""
    return {v for e in events for v in json.loads(e["detail"] or "{}").get("abandoned_versions", [])}


def is_abandoned(table: str, row: dict[str, Any], events: list[dict[str, Any]]) -> bool:
    key = KEYED_BY[table]
    return any(
        row[key] is not None
        and row[key] > e[key]
        and row["created_at"] is not None
        and row["created_at"] < e["created_at"]
        for e in events
    )


def committed_rows(paths: StoragePaths, table: str, run: str, rows: list[dict] | None = None) -> list[dict]:
    """The run's rows of `table` that no resume abandoned (all of them for a run never resumed)."""
    from miles_platform.store.tables import read_rows

    rows = read_rows(paths, table, run) if rows is None else rows
    events = resume_events(paths, run)
    return [r for r in rows if not is_abandoned(table, r, events)] if events else rows


def record_resume(
    paths: StoragePaths, run: str, rollout_id: int, version: int, highest: int, changes: list[str]
) -> list[int]:
    """Append the resume event of a run restarting from the checkpoint of (rollout_id, version).
    Returns the version numbers it abandons: every number past the checkpoint's up to `highest`
    (the highest any store knows, recorded or only exported / published), less those an earlier
    resume already abandoned."""
    from miles_platform.store.tables import append_rows, read_rows

    rows = read_rows(paths, "policy_versions", run)
    events = resume_events(paths, run)
    earlier = {r["version"] for r in rows if is_abandoned("policy_versions", r, events)}
    abandoned = [v for v in range(version + 1, highest + 1) if v not in earlier | abandoned_numbers(events)]
    detail = {"abandoned_versions": abandoned, "config_changes": changes, "pid": os.getpid(),
              "host": socket.gethostname()}  # fmt: skip
    append_rows(paths, "run_events", run, [{"event": "resume", "rollout_id": rollout_id, "version": version,
                                            "detail": json.dumps(detail)}])  # fmt: skip
    return abandoned
