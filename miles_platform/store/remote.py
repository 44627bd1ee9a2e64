"""Remote (object-store) paths: `s3://bucket/root/...` or any fsspec URI with a `://`.

Object stores have no rename and no directories, so every writer here stages files in a local
dir and uploads them with the file readers check for written last (S3 makes each object appear
whole or not at all): a crash leaves at most an unnamed, incomplete prefix that no reader trusts.
Readers download to a local staging dir and use the local code path. Credentials and endpoint
come from the standard environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_DEFAULT_REGION for s3fs/botocore); `storage_env` forwards them to the run's Ray actors.

    $MILES_CACHE_DIR (default ~/.cache/miles-platform)
        staging/<pid>-<random>/          uploads being written, downloads being read (removed after)
        remote/<protocol>/<bucket>/...   local state keyed by a remote path (run lock, engine-local dirs)
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator, Sequence

import fsspec

# Another process (a trainer actor, a sensor) writes the same prefixes: a listing cached by this
# process's fsspec instance would hide their new files. Never cache listings of object stores.
for _proto in ("s3", "gcs", "gs", "abfs", "az"):
    fsspec.config.conf.setdefault(_proto, {}).setdefault("use_listings_cache", False)

# what a Ray actor on another node needs to reach the store (only those set in the driver travel)
STORAGE_ENV = (
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE", "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE", "AWS_CA_BUNDLE", "GOOGLE_APPLICATION_CREDENTIALS", "MILES_CACHE_DIR",
)  # fmt: skip


def is_remote(path: str | os.PathLike | None) -> bool:
    return path is not None and "://" in str(path)


def join(base: str, *parts: str) -> str:
    return "/".join([str(base).rstrip("/"), *parts])


def cache_dir() -> str:
    return os.path.abspath(os.environ.get("MILES_CACHE_DIR") or os.path.expanduser("~/.cache/miles-platform"))


def mirror_path(url: str) -> str:
    """The local dir that holds this host's state for a remote path (never a copy to trust)."""
    protocol, _, rest = str(url).partition("://")
    rest = posixpath.normpath("/" + rest).lstrip("/")
    return os.path.join(cache_dir(), "remote", protocol, rest)


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(str(url))


@contextlib.contextmanager
def staging_dir() -> Iterator[str]:
    """A fresh local dir under the cache, removed on exit (a killed process's: remove_dead_staging)."""
    root = os.path.join(cache_dir(), "staging")
    os.makedirs(root, exist_ok=True)
    # <pid>-<host>-: a cache dir shared between hosts never has one host remove another's live dir
    d = tempfile.mkdtemp(prefix=f"{os.getpid()}-{socket.gethostname()}-", dir=root)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def remove_dead_staging(log: Callable[[str], None] = print) -> None:
    """Staging dirs of processes of this host that died mid-upload or mid-download."""
    root = os.path.join(cache_dir(), "staging")
    host = socket.gethostname()
    for name in os.listdir(root) if os.path.isdir(root) else []:
        pid, _, rest = name.partition("-")
        if pid.isdigit() and rest.startswith(f"{host}-") and not _alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            log(f"[startup] removed {os.path.join(root, name)} (left by a writer that died)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------ reads
def exists(path: str) -> bool:
    if not is_remote(path):
        return os.path.exists(path)
    fs, p = filesystem(path)
    return fs.exists(p)


def size(path: str) -> int:
    if not is_remote(path):
        return os.path.getsize(path)
    fs, p = filesystem(path)
    return int(fs.size(p))


def read_bytes(url: str) -> bytes | None:
    """The object's bytes, or None if there is none."""
    fs, p = filesystem(url)
    try:
        return fs.cat_file(p)
    except FileNotFoundError:
        return None


def listdir(url: str) -> list[str]:
    """Names directly under a remote prefix (files and 'dirs'); [] if there is nothing."""
    fs, p = filesystem(url)
    try:
        return sorted(posixpath.basename(e.rstrip("/")) for e in fs.ls(p, detail=False))
    except FileNotFoundError:
        return []


def download_dir(url: str, local: str, want: Callable[[str], bool] = lambda rel: True) -> str:
    """Every object under `url` whose relative path `want`s, into `local`. Returns `local`."""
    fs, root = filesystem(url)
    root = root.rstrip("/")
    files = [f for f in fs.find(root) if want(f[len(root) + 1 :])]
    if not files:
        raise FileNotFoundError(f"{url}: no such directory (nothing stored under it)")
    for f in files:
        dest = os.path.join(local, *f[len(root) + 1 :].split("/"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        fs.get_file(f, dest)
    return local


@contextlib.contextmanager
def local_dir(path: str, want: Callable[[str], bool] = lambda rel: True) -> Iterator[str]:
    """A local dir with the contents of `path`: `path` itself, or a download removed on exit."""
    if not is_remote(path):
        yield path
        return
    with staging_dir() as d:
        yield download_dir(path, os.path.join(d, posixpath.basename(str(path).rstrip("/")) or "dir"), want)


# ------------------------------------------------------------------ writes
def write_bytes(url: str, data: bytes | str) -> None:
    """One PUT: the object appears whole or not at all (the pointer files' atomic replace)."""
    fs, p = filesystem(url)
    fs.pipe_file(p, data.encode() if isinstance(data, str) else data)


def upload_dir(
    local: str,
    url: str,
    last: Sequence[str] = (),
    exclude: Sequence[str] = (),
    only: Sequence[str] | None = None,
) -> None:
    """Upload the files below `local` to `url` (relative paths kept): those in `last` after all
    others and in that order (a reader's marker: model.safetensors, index.json), none of
    `exclude`, and with `only`, just those."""
    fs, root = filesystem(url)
    root = root.rstrip("/")
    rels = sorted(
        os.path.relpath(os.path.join(d, f), local).replace(os.sep, "/")
        for d, _, files in os.walk(local)
        for f in files
    )
    rels = [r for r in rels if r not in exclude and (only is None or r in only)]
    missing = [r for r in [*last, *(only or ())] if r not in rels and r not in exclude]
    if missing:  # a marker that is not there must not be "uploaded" as if it were
        raise FileNotFoundError(f"{local}: {', '.join(missing)} missing; nothing uploaded to {url}")
    for rel in [r for r in rels if r not in last] + [r for r in last if r in rels]:
        fs.put_file(os.path.join(local, rel), f"{root}/{rel}")


def remove(url: str) -> None:
    fs, p = filesystem(url)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(p, recursive=True)


# credentials: never in a Ray runtime env (its agent logs every env var, 0644, never cleaned: another
# local user read the S3 secret there); they reach an actor as a constructor argument instead
STORAGE_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def storage_env(*paths: str | None) -> dict[str, str]:
    """The non-secret env vars of STORAGE_ENV set here, when any of `paths` is remote (else {})."""
    if not any(is_remote(p) for p in paths):
        return {}
    return {k: os.environ[k] for k in STORAGE_ENV if k in os.environ and k not in STORAGE_SECRETS}


def storage_secrets(*paths: str | None) -> dict[str, str]:
    """The credentials of STORAGE_SECRETS set here, when any of `paths` is remote (else {})."""
    if not any(is_remote(p) for p in paths):
        return {}
    return {k: os.environ[k] for k in STORAGE_SECRETS if k in os.environ}


def apply_secret_env(env: dict[str, str] | None) -> None:
    """In an actor's process, before anything reads the store: the driver's credentials."""
    os.environ.update(env or {})
