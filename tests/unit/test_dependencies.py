"""pyproject's runtime dependencies are what the installed code imports: every third-party import of
the packages `pip install .` installs is a runtime dependency (or, imported inside a function only,
one of a named extra), every runtime dependency is imported (or named below with why not), no test
tool is one, and `make install` installs every extra the tests and benches import."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# runtime, though no module imports it by this name
NOT_IMPORTED = {
    "dagster-webserver": "the UI (make ui)",
    "duckdb-cli": "the duckdb shell the README opens the catalog with",
    "accelerate": "peft imports it",
    "s3fs": "fsspec's s3:// protocol",
}
# what this CPU machine does not install (the gpu extra): top-level module -> its distribution
NOT_INSTALLED_HERE = {"transformer_engine": "transformer-engine", "fla": "flash-linear-attention"}
TEST_TOOLS = {
    "pytest",
    "pytest-timeout",
    "pytest-xdist",
    "hypothesis",
    "openai",
    "jsonschema",
    "moto",
    "ruff",
    "pandas",
}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-").replace(".", "-")


RUNTIME = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
EXTRAS = {
    extra: {_name(r) for r in reqs} for extra, reqs in PYPROJECT["project"]["optional-dependencies"].items()
}
DISTRIBUTIONS = metadata.packages_distributions()


TOOL = PYPROJECT["tool"]["setuptools"]
# the top-level names `pip install .` installs: setuptools' package include list and py-modules
INSTALLED = {p.rstrip("*") for p in TOOL["packages"]["find"]["include"]} | set(TOOL["py-modules"])


def _installed_code() -> list[Path]:
    files = [ROOT / f"{m}.py" for m in TOOL["py-modules"]]
    for package in sorted(INSTALLED - set(TOOL["py-modules"])):
        files += sorted((ROOT / package).rglob("*.py"))
    return files


def _imports(files: list[Path], local: set[str]) -> dict[str, set[tuple[str, bool]]]:
    """Third-party top-level module -> {(file, imported at module level)}."""
    out: dict[str, set[tuple[str, bool]]] = {}

    def visit(node: ast.AST, path: str, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module]
            for name in names:
                mod = name.split(".")[0]
                if mod not in sys.stdlib_module_names and mod not in local and mod != "__future__":
                    out.setdefault(mod, set()).add((path, top))
            visit(child, path, inner)

    for f in files:
        visit(ast.parse(f.read_text()), str(f.relative_to(ROOT)), True)
    return out


def _dists(module: str) -> set[str]:
    found = {_name(d) for d in DISTRIBUTIONS.get(module, ())}
    return found or ({NOT_INSTALLED_HERE[module]} if module in NOT_INSTALLED_HERE else set())


def test_runtime_dependencies_are_what_the_installed_code_imports():
    imports = _imports(_installed_code(), INSTALLED)
    optional = set().union(*EXTRAS.values())
    wrong = []
    for module, sites in sorted(imports.items()):
        dists = _dists(module)
        eager = sorted(path for path, top in sites if top)
        if not dists:
            wrong.append(f"{module}: installed by no distribution here ({sorted(sites)[0][0]}); declare it")
        elif not dists & RUNTIME and (eager or not dists & optional):
            where = f"imported at module level in {eager[0]}" if eager else "in no extra either"
            wrong.append(f"{module} ({'/'.join(sorted(dists))}): not a runtime dependency, {where}")
    assert not wrong, "\n".join(wrong)

    imported = set().union(*(_dists(m) for m in imports))
    unused = sorted(RUNTIME - imported - set(NOT_IMPORTED))
    assert not unused, f"runtime dependencies nothing installed imports: {unused} (move them to an extra)"
    assert not RUNTIME & TEST_TOOLS, (
        f"test tools among the runtime dependencies: {sorted(RUNTIME & TEST_TOOLS)}"
    )


def test_make_install_installs_every_extra_the_tests_and_benches_import():
    makefile = (ROOT / "Makefile").read_text()
    (extras,) = re.findall(r"^EXTRAS\s*:=\s*(\S+)$", makefile, re.M)
    installs = re.findall(r"install .*-e '([^']*)'", makefile)
    assert installs and set(installs) == {".[$(EXTRAS)]"}, installs  # uv and its pip fallback alike
    installed = RUNTIME.union(*(EXTRAS[e] for e in extras.split(",")))
    assert set(extras.split(",")) == set(EXTRAS) - {"gpu"}, extras  # gpu: CUDA builds, not on CPU
    files = sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "bench").glob("*.py"))
    files = [f for f in files if f.name != "trl_grpo.py" and "gpu" not in f.parts]  # own venv / GPU runs
    helpers = {f.stem for f in files + sorted((ROOT / "scripts").glob("*.py"))}  # on sys.path in tests
    local = INSTALLED | helpers | {"bench", "tests", "my_rewards"}  # my_rewards: a module a test writes
    missing = {
        m: sorted(sites)[0][0] for m, sites in _imports(files, local).items() if not _dists(m) & installed
    }
    assert not missing, (
        f"imported by tests or benches, installed by no extra make install installs: {missing}"
    )
