"""The code that made a policy version: the platform's release and the git commit of its source tree,
and whether that tree had uncommitted changes to tracked files (`git describe --dirty`'s sense), as
each `policy_versions` row records them (store/versions.py) next to the config hash.

Read once per process (the code a run imported at its start is what trains it, whatever is edited
later). Outside a git checkout (an installed wheel, an image without .git) the commit and the flag
are None: unknown, never guessed."""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout miles_platform/ was imported from


@dataclass(frozen=True)
class CodeVersion:
    platform_version: str | None  # miles-platform's release (pyproject's version)
    git_commit: str | None  # HEAD of the source checkout
    git_dirty: bool | None  # tracked files differ from that commit

    def row(self) -> dict:
        return {"platform_version": self.platform_version, "git_commit": self.git_commit,
                "git_dirty": self.git_dirty}  # fmt: skip


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(SOURCE_ROOT), *args], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):  # no git, not a checkout, or it hung
        return None
    return out.stdout.strip()


@functools.cache
def code_version() -> CodeVersion:
    try:
        release = metadata.version("miles-platform")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        release = None
    commit = _git("rev-parse", "--verify", "HEAD")
    # the checkout must be the one imported from, not a repository the source tree sits inside of
    top = _git("rev-parse", "--show-toplevel") if commit else None
    if not commit or top is None or Path(top).resolve() != SOURCE_ROOT:
        return CodeVersion(release, None, None)
    status = _git("status", "--porcelain", "--untracked-files=no")
    return CodeVersion(release, commit, None if status is None else bool(status))
