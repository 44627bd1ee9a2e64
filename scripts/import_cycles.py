"""The import plan, checked: layer rules and import cycles of the engine (miles_platform/), the
kernels and the Dagster layer (assets/, ops/, sensors/, resources/, definitions.py).

Every import counts, module-level and inside functions (lazy: it hides a cycle or an upward import
until a call path closes it); imports under `if TYPE_CHECKING:` do not (they never run).

- RULES: what each floor must not import (a module prefix matches itself and its submodules). A
  rule may list pending exceptions: imports another branch removes (the integrator deletes the
  entry after merging it). A pending exception that no longer occurs fails too, so the table
  never keeps a dead one.
- Cycles: each strongly connected component of more than one module, once over module-level
  imports and once over all.
- It prints the number of imports inside functions (`function-level`): each is either heavy (torch,
  Ray, a CLI kept fast) or a circle dodged; the second kind should not exist.

Usage: python scripts/import_cycles.py   (exit 1 on a broken rule, a stale exception or a cycle)
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("miles_platform", "kernels", "assets", "ops", "sensors", "resources")
MODULES = ("definitions",)  # top-level modules of the code location
DAGSTER_LAYER = ("assets", "ops", "sensors", "resources", "definitions")
LOOP = ("miles_platform.loop", "miles_platform.run_services")
LAUNCH = ("miles_platform.preflight", "miles_platform.launch")  # checks before a run; where it runs


@dataclass(frozen=True)
class Rule:
    """Modules under `importers` (less `exempt`) import nothing under `forbidden`."""

    name: str
    importers: tuple[str, ...]
    forbidden: tuple[str, ...]
    exempt: tuple[str, ...] = ()
    # (importer, imported) -> who removes it: known until that branch lands
    pending: dict[tuple[str, str], str] = field(default_factory=dict)


RULES = (
    Rule("the engine imports no Dagster", ("miles_platform", "kernels"), ("dagster", "dagster_ray", *DAGSTER_LAYER)),
    Rule("kernels import nothing of the platform", ("kernels",), ("miles_platform",)),
    Rule(
        "store imports neither the loop nor training (nor rollout, weights, diffusion, preflight, launch)",
        ("miles_platform.store",),
        (*LOOP, *LAUNCH, "miles_platform.training", "miles_platform.weights", "miles_platform.rollout",
         "miles_platform.diffusion"),
    ),
    Rule(
        "cluster imports neither the loop nor training (nor preflight, launch, diffusion)",
        ("miles_platform.cluster",),
        (*LOOP, *LAUNCH, "miles_platform.training", "miles_platform.diffusion"),
    ),
    Rule(
        "config imports no rollout code",
        ("miles_platform.config",),
        ("miles_platform.rollout",),
    ),
    Rule(
        "the viewer reads the store only (it starts in a second, without torch)",
        ("miles_platform.viewer",),
        (*LOOP, *LAUNCH, "miles_platform.training", "miles_platform.weights", "miles_platform.rollout",
         "miles_platform.diffusion", "miles_platform.cluster", "miles_platform.models", "miles_platform.config"),
    ),
    # the Dagster layer's floors: resources <- assets <- ops <- sensors <- definitions
    Rule("resources import no assets, ops or sensors", ("resources",), ("assets", "ops", "sensors", "definitions")),
    Rule("assets import no ops or sensors", ("assets",), ("ops", "sensors", "definitions")),
    Rule(
        "ops import no sensors (the quickstart alone loads the code location)",
        ("ops",),
        ("sensors", "definitions"),
        exempt=("ops.quickstart",),
    ),
    Rule("sensors import no definitions", ("sensors",), ("definitions",)),
)  # fmt: skip


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str  # a module, or a name inside one (`from m import name` gives m and m.name)
    line: int
    lazy: bool  # inside a function


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> dict[str, Path]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    files |= {m: ROOT / f"{m}.py" for m in MODULES}
    return files


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imports_of(module: str, path: Path) -> list[Import]:
    out: list[Import] = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                continue
            if isinstance(child, ast.Import):
                out.extend(Import(module, a.name, child.lineno, lazy) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the importer's package
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*up, base] if base else up)
                out.append(Import(module, base, child.lineno, lazy))
                out.extend(Import(module, f"{base}.{a.name}", child.lineno, lazy) for a in child.names)
            visit(child, lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(ast.parse(path.read_text()), False)
    return out


def check_rules(imports: list[Import]) -> tuple[list[str], list[str], list[str]]:
    """(broken rules, pending exceptions seen, stale pending exceptions), one line each."""
    broken, pending, seen, said = [], [], set(), set()
    for rule in RULES:
        for imp in imports:  # `from m import name` is m and m.name: one line per statement
            if not any(within(imp.importer, p) for p in rule.importers) or any(
                within(imp.importer, p) for p in rule.exempt
            ):
                continue
            if not any(within(imp.imported, p) for p in rule.forbidden):
                continue
            if (rule.name, imp.importer, imp.line) in said:
                continue
            said.add((rule.name, imp.importer, imp.line))
            where = f"{imp.importer}:{imp.line} imports {imp.imported}{' (lazily)' if imp.lazy else ''}"
            key = next((k for k in rule.pending if k[0] == imp.importer and within(imp.imported, k[1])), None)
            if key is None:
                broken.append(f"{rule.name}: {where}")
            elif (rule.name, key) not in seen:
                seen.add((rule.name, key))
                pending.append(f"{rule.name}: {where} [pending: {rule.pending[key]}]")
    stale = [
        f"{rule.name}: {a} no longer imports {b}: remove the pending exception from RULES"
        for rule in RULES
        for a, b in rule.pending
        if (rule.name, (a, b)) not in seen
    ]
    return broken, pending, stale


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return sccs


def graph_of(files: dict[str, Path], imports: list[Import], lazy: bool) -> dict[str, set[str]]:
    # a submodule importing its own parent package is no cycle: Python initializes the parent first
    graph: dict[str, set[str]] = {m: set() for m in files}
    for imp in imports:
        if (lazy or not imp.lazy) and imp.imported in files and imp.imported != imp.importer:
            if not within(imp.importer, imp.imported):
                graph[imp.importer].add(imp.imported)
    return graph


def main() -> int:
    files = source_files()
    imports = [imp for m, p in sorted(files.items()) for imp in imports_of(m, p)]
    broken, pending, stale = check_rules(imports)
    for line in broken:
        print(f"broken rule: {line}")
    for line in pending:
        print(f"pending: {line}")
    for line in stale:
        print(f"stale exception: {line}")
    print(
        f"{len(RULES)} layer rules: {len(broken)} broken, {len(pending)} pending exception(s), {len(stale)} stale"
    )
    found = []
    for lazy, kind in ((False, "module-level"), (True, "module-level + lazy")):
        sccs = cycles(graph_of(files, imports, lazy))
        found += sccs
        for c in sccs:
            print(f"cycle ({kind}): {' <-> '.join(c)}")
        print(f"{len(sccs)} {kind} import cycle(s) among {len(files)} modules")
    statements = {(i.importer, i.line) for i in imports if i.lazy}
    ours = {
        (i.importer, i.line) for i in imports if i.lazy and i.imported.split(".")[0] in (*PACKAGES, *MODULES)
    }
    print(f"{len(statements)} function-level import statements ({len(ours)} of this project's modules)")
    return 1 if broken or stale or found else 0


if __name__ == "__main__":
    sys.exit(main())
