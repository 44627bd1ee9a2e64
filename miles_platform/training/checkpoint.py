"""Where trainer checkpoints live (Miles' layout), torch-free: `<save>/iter_<rollout_id:07d>/`
and `<save>/latest_checkpointed_iteration.txt` naming the newest complete one."""

from __future__ import annotations

import os
from pathlib import Path

LATEST = "latest_checkpointed_iteration.txt"


def iter_dir(save: str, rollout_id: int) -> str:
    return os.path.join(save, f"iter_{rollout_id:07d}")


def read_latest(save: str | None) -> int | None:
    if not save:
        return None
    p = Path(save) / LATEST
    if not p.exists():
        return None
    text = p.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{p}: expected an iteration number, got {text!r}")
    return int(text)
