"""Byte-compile, once and on every core, the modules the test suite's collection imports.

On a fresh venv nothing is byte-compiled (Makefile: a module is compiled when a process first
imports it). `make test` then starts its pytest-xdist workers together, and each imports the same
~5,500 modules to collect the tests (torch, transformers, dagster, Ray, ...): both compile every one
of them, at the same time, ~18 CPU-s each, before the first test runs (26 s of wall on 2 cores,
measured 2026-12-06). Compiled here first, in parallel, once: ~7 s of wall, and the workers
collect from the .pyc files.

    python scripts/warm_bytecode.py            # compile what tests/bytecode_modules.txt lists
    python scripts/warm_bytecode.py --record   # rewrite that list from a collection run

The list holds file paths relative to the directory of sys.path they were found in (site-packages,
the repository). A stale list costs only time: a listed file that is gone is skipped, a module not
listed is compiled by the first process that imports it, as without this script. Files whose .pyc is
up to date are not compiled again.
"""

from __future__ import annotations

import compileall
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIST = REPO / "tests" / "bytecode_modules.txt"


def _roots() -> list[Path]:
    """The import roots a listed path is relative to, most specific first (site-packages before the
    repository, which may hold the venv)."""
    import site

    roots = [Path(p) for p in site.getsitepackages()] + [REPO]
    return [r.resolve() for r in roots]


def _relative(path: str, roots: list[Path]) -> str | None:
    p = Path(path).resolve()
    for r in roots:
        if p.is_relative_to(r):
            return p.relative_to(r).as_posix()
    return None


def listed_files(lines: list[str], roots: list[Path]) -> list[str]:
    """The existing files the list names, each found under the first root that has it."""
    out = []
    for rel in lines:
        rel = rel.strip()
        if not rel or rel.startswith("#"):
            continue
        for r in roots:
            f = r / rel
            if f.is_file():
                out.append(str(f))
                break
    return out


def _compile(files: list[str]) -> int:
    ok = 0
    for f in files:
        ok += bool(compileall.compile_file(f, quiet=2))  # skips a file whose .pyc is up to date
    return ok


def warm(files: list[str], jobs: int | None = None) -> None:
    jobs = jobs or os.cpu_count() or 1
    if jobs == 1 or len(files) < 100:
        _compile(files)
        return
    chunks = [files[i::jobs] for i in range(jobs)]  # interleaved: every chunk gets some of each package
    with ProcessPoolExecutor(jobs) as pool:
        list(pool.map(_compile, chunks))


class _Recorder:
    """A pytest plugin: after collection, the .py files of every imported module under the roots."""

    def __init__(self, roots: list[Path]):
        self.roots, self.files = roots, set()

    def pytest_collection_finish(self, session) -> None:
        for m in list(sys.modules.values()):
            f = getattr(m, "__file__", None)
            if f and f.endswith(".py"):
                rel = _relative(f, self.roots)
                if rel is not None and not rel.startswith("tests/"):  # pytest rewrites test modules itself
                    self.files.add(rel)


def record() -> int:
    import pytest

    rec = _Recorder(_roots())
    rc = pytest.main(["--collect-only", "-q", "-m", "not gpu", "-p", "no:cacheprovider"], plugins=[rec])
    if rc != 0:
        return int(rc)
    head = "# written by `python scripts/warm_bytecode.py --record`: the modules `make test`'s collection imports\n"
    tmp = LIST.with_suffix(".tmp")
    tmp.write_text(head + "".join(f"{f}\n" for f in sorted(rec.files)))
    os.replace(tmp, LIST)
    print(f"{len(rec.files)} files -> {LIST.relative_to(REPO)}")
    return 0


def main(argv: list[str]) -> int:
    if argv[1:] == ["--record"]:
        return record()
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    if not LIST.is_file():
        return 0
    warm(listed_files(LIST.read_text().splitlines(), _roots()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
