"""Ray's `setup_worker.py` for the local clusters `start_local_ray` starts, in the standard library only.

The raylet starts every worker as `python <setup_worker> --serialized-runtime-env-context=<json>
--language=PYTHON <worker command>`. Ray's own script imports Ray to read that JSON (~0.45 CPU-s
per actor start on this project's CPU machines, measured 2026-12-05: the largest per-actor cost
once the worker itself is forked warm), then execs the worker through `bash -c`. This one does
what `RuntimeEnvContext.exec_worker` does for a Python worker on Linux (ray 2.60) with nothing
imported but the standard library: set the context's env vars (`${VAR}` expanded, unknown ones
emptied), swap the entrypoint when the context overrides it, and exec `py_executable` with the
passthrough args. When the context needs a shell (a command prefix, e.g. a working dir's `cd`, or
shell syntax in `py_executable`), or the worker is not Python, it runs exactly Ray's code path
(bash, or Ray's own script), so the result is never different, only cheaper in the common case.

Run as a script (Ray passes its path); imports nothing from this package.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys

_PLAIN = re.compile(r"[A-Za-z0-9_./:=,@%+-]+")  # words bash would pass through unchanged


def _expand(value: str) -> str:
    # ray._private.utils.update_envs
    return re.sub(r"\$\{[A-Z0-9_]+\}", "", os.path.expandvars(value))


def plan(argv: list[str]) -> tuple[str, list[str]]:
    """(executable, argv) to exec for Ray's setup-worker argv; sets the context's env vars."""
    parser = argparse.ArgumentParser()  # Ray's two arguments, read as its script reads them
    parser.add_argument("--serialized-runtime-env-context", type=str)
    parser.add_argument("--language", type=str)
    args, rest = parser.parse_known_args(argv)
    ctx_json, language = args.serialized_runtime_env_context, args.language
    if language not in (None, "PYTHON"):  # Java / C++ workers: Ray's own script
        import importlib.util

        spec = importlib.util.find_spec("ray")
        ray_dir = os.path.dirname(spec.origin) if spec and spec.origin else ""
        script = os.path.join(ray_dir, "_private", "workers", "setup_worker.py")
        return sys.executable, [sys.executable, script, *argv]
    ctx = json.loads(ctx_json or "{}")
    for key, value in (ctx.get("env_vars") or {}).items():
        os.environ[key] = _expand(value)
    py = ctx.get("py_executable") or sys.executable
    if ctx.get("override_worker_entrypoint") and rest:
        rest = [ctx["override_worker_entrypoint"], *rest[1:]]
    prefix = ctx.get("command_prefix") or []
    words = py.split()
    if prefix or not words or not all(_PLAIN.fullmatch(w) for w in words):
        cmd = [*prefix, "exec", py, *(shlex.quote(s) for s in rest)]  # as Ray builds it
        return "bash", ["bash", "-c", " ".join(cmd)]
    return words[0], [*words, *rest]


def main() -> None:
    exe, args = plan(sys.argv[1:])
    os.execvp(exe, args)


if __name__ == "__main__":
    main()
