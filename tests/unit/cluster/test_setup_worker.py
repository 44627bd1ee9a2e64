"""cluster/setup_worker.py starts a worker exactly as Ray's setup_worker.py would (same program, argv
and environment), without importing Ray; local clusters use it."""

import json
import os
import shlex
import subprocess
import sys

import pytest
from ray._private import ray_constants
from ray._private.runtime_env.context import RuntimeEnvContext
from ray.core.generated.common_pb2 import Language

from miles_platform.cluster import ray_cluster, setup_worker

WORKER = ["/venv/ray/_private/workers/default_worker.py", "--node-ip-address=127.0.0.1", "--x=a b", "-S"]
CONTEXTS = [
    {},
    {"env_vars": {"OMP_NUM_THREADS": "1", "P": "${SW_TEST_HOME}/bin:${SW_TEST_NOPE}", "Q": "$SW_TEST_HOME"}},
    {"py_executable": f"{sys.executable} -S /repo/miles_platform/cluster/fork_exec.py /tmp/fs dir"},
    {"override_worker_entrypoint": "/other/entry.py", "env_vars": {"A": "1"}},
    {"command_prefix": ["cd", "/tmp/work dir", "&&"], "py_executable": "python3"},
    {"py_executable": "python3 $SW_TEST_FLAGS"},  # shell syntax: through bash, as Ray
]


def _ray_exec(ctx: dict, argv: list[str], monkeypatch) -> tuple[list[str], dict]:
    seen = {}
    monkeypatch.setattr(os, "execvp", lambda exe, args: seen.update(exe=exe, args=list(args)))
    RuntimeEnvContext(**ctx).exec_worker(list(argv), Language.PYTHON)
    return seen["args"], dict(os.environ)


@pytest.mark.parametrize("ctx", CONTEXTS, ids=range(len(CONTEXTS)))
def test_the_worker_command_and_env_equal_rays(ctx, monkeypatch):
    monkeypatch.setenv("SW_TEST_HOME", "/home/u")
    monkeypatch.setenv("SW_TEST_FLAGS", "-u")
    base = dict(os.environ)
    ray_args, ray_env = _ray_exec(ctx, WORKER, monkeypatch)
    os.environ.clear()
    os.environ.update(base)
    argv = [f"--serialized-runtime-env-context={json.dumps(ctx)}", "--language=PYTHON", *WORKER]
    exe, args = setup_worker.plan(argv)
    assert dict(os.environ) == ray_env
    assert ray_args[:2] == ["bash", "-c"]
    if exe == "bash":  # a context that needs a shell: Ray's very command
        assert args == ray_args
    else:  # what bash would have exec'ed
        assert ctx.get("command_prefix") is None
        assert args == shlex.split(ray_args[2])[1:] and exe == args[0]


def test_separate_arg_form_and_other_languages():
    exe, args = setup_worker.plan(["--serialized-runtime-env-context", "{}", "--language", "PYTHON", "w.py"])
    assert (exe, args) == (sys.executable, [sys.executable, "w.py"])
    exe, args = setup_worker.plan(["--language=JAVA", "io.ray.Main"])
    assert args[1].endswith(os.path.join("ray", "_private", "workers", "setup_worker.py"))
    assert args[2:] == ["--language=JAVA", "io.ray.Main"]


def test_it_imports_no_ray_and_execs_the_worker(tmp_path):
    """Run as Ray runs it: a script path, argv after it; the exec'ed program sees the env and args."""
    out = tmp_path / "out"
    code = f"import os,sys; open({str(out)!r},'w').write(os.environ['K'] + '|' + ' '.join(sys.argv[1:]))"
    ctx = json.dumps({"env_vars": {"K": "v"}, "py_executable": sys.executable})
    # the module imports nothing outside the standard library (loaded in a fresh interpreter)
    load = (f"import importlib.util as u, sys; s = u.spec_from_file_location('sw', {setup_worker.__file__!r}); "
            "s.loader.exec_module(u.module_from_spec(s)); print(sorted(m for m in sys.modules if m.startswith(('ray', 'miles'))))")  # fmt: skip
    check = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, check=True)
    assert check.stdout.strip() == "[]"
    subprocess.run([sys.executable, setup_worker.__file__, f"--serialized-runtime-env-context={ctx}",
                    "--language=PYTHON", "-c", code, "a", "b c"], check=True)  # fmt: skip
    assert out.read_text() == "v|a b c"


def test_local_clusters_start_workers_through_it_and_the_default_comes_back():
    before = ray_constants.SETUP_WORKER_FILENAME
    with ray_cluster._light_setup_worker():
        path = ray_constants.SETUP_WORKER_FILENAME
        assert os.path.isabs(path) and os.path.samefile(path, setup_worker.__file__)
        assert os.path.join("/ray/_private", "workers", path) == path  # how Ray's node joins it
    assert ray_constants.SETUP_WORKER_FILENAME == before == "setup_worker.py"
