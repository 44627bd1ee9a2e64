"""Where trainer checkpoints live (Miles' layout), torch-free: `<save>/iter_<rollout_id:07d>/`
and `<save>/latest_checkpointed_iteration.txt` naming the newest complete one (`<save>` may be an
object-store URI: the pointer is then one object, uploaded after the whole iter dir)."""

from __future__ import annotations

import os
from pathlib import Path

from miles_platform.store import remote

LATEST = "latest_checkpointed_iteration.txt"


def iter_dir(save: str, rollout_id: int) -> str:
    return os.path.join(save, f"iter_{rollout_id:07d}")  # "/"-joined: a URI stays one too


def read_latest(save: str | None) -> int | None:
    if not save:
        return None
    if remote.is_remote(save):
        p, raw = remote.join(save, LATEST), remote.read_bytes(remote.join(save, LATEST))
        if raw is None:
            return None
        text = raw.decode(errors="replace").strip()
    else:
        p = Path(save) / LATEST
        if not p.exists():
            return None
        text = p.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{p}: expected an iteration number, got {text!r}")
    return int(text)
