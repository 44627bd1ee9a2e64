"""Import cycles inside miles_platform: module-level imports, and also imports inside functions
(lazy), which hide a cycle until a call path closes it. Prints each strongly connected component
of more than one module; exit 1 if any. Usage: python scripts/import_cycles.py [--module-level]"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "miles_platform"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path, module_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    out = set()
    for n in nodes:
        if isinstance(n, ast.If) and module_level_only:  # TYPE_CHECKING blocks do not import at run time
            continue
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names if a.name.startswith(PKG)}
        elif isinstance(n, ast.ImportFrom) and n.module and n.module.startswith(PKG) and n.level == 0:
            out.add(n.module)
            out |= {f"{n.module}.{a.name}" for a in n.names}
    return out


def main() -> int:
    module_level = "--module-level" in sys.argv
    files = {module_name(p): p for p in (ROOT / PKG).rglob("*.py")}
    # a submodule importing its own parent package is no cycle: Python initializes the parent first
    graph = {
        m: {i for i in imports(p, module_level) if i in files and i != m and not m.startswith(i + ".")}
        for m, p in files.items()
    }
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
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
    kind = "module-level" if module_level else "module-level + lazy"
    for c in sccs:
        print(f"cycle ({kind}): {' <-> '.join(c)}")
    print(f"{len(sccs)} {kind} import cycle(s) among {len(files)} modules")
    return 1 if sccs else 0


if __name__ == "__main__":
    sys.exit(main())
