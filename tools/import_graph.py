"""The module graph of src/kvserve/, drawn from its import statements.

    python tools/import_graph.py              # package -> packages it imports
    python tools/import_graph.py --modules    # module -> modules it imports

Every `import` counts, including those inside functions and under
`if TYPE_CHECKING:`: a lazy import still runs (or at least names a
dependency) when its function does. tests/test_architecture.py checks the
rules of docs/architecture.md against this graph.

A node is a module's dotted name (`kvserve.plan.cli`); its package is the
first component under kvserve (`plan`), or the module itself for a module at
the top (`config`, `contract`, ...).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src"
PACKAGE = "kvserve"


def module_files(source: Path = SOURCE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    files = {}
    for path in sorted((source / PACKAGE).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(source).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def imported_names(path: Path, module: str, modules: Iterable[str] = ()) -> set[str]:
    """Every dotted name `module`'s file imports (absolute; relative imports
    resolved against `module`). `from a import b` yields `a.b` when that is
    one of `modules` (a submodule), else `a` (a name defined in a)."""
    known = set(modules)
    names: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                names.add(submodule if submodule in known else base)
    return names


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[:len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def resolve(name: str, modules: Iterable[str]) -> str | None:
    """The kvserve module a dotted name refers to (the longest module prefix
    of it), or None for a name outside the package."""
    known = set(modules)
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def module_graph(source: Path = SOURCE) -> dict[str, set[str]]:
    """kvserve module -> kvserve modules it imports (itself excluded)."""
    files = module_files(source)
    graph = {}
    for module, path in files.items():
        targets = {resolve(name, files) for name in imported_names(path, module, files)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def external_imports(source: Path = SOURCE) -> dict[str, set[str]]:
    """kvserve module -> top-level names of what it imports from outside the
    package (`torch`, `numpy`, ...)."""
    files = module_files(source)
    return {module: {name.split(".")[0] for name in imported_names(path, module, files)
                     if name and resolve(name, files) is None and name.split(".")[0] != PACKAGE}
            for module, path in files.items()}


def package_of(module: str) -> str:
    """`kvserve.plan.cli` -> `plan`; `kvserve.config` -> `config`; `kvserve` -> `kvserve`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges = packages.setdefault(package_of(module), set())
        edges.update(package_of(t) for t in targets if package_of(t) != package_of(module))
    return packages


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every node `start` imports directly or through others (not itself
    unless through a cycle)."""
    seen: set[str] = set()
    stack = list(graph.get(start, ()))
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(graph.get(node, ()))
    return seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan),
    each sorted: every import cycle lies inside one of them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", action="store_true", help="module graph instead of packages")
    args = parser.parse_args(argv)
    graph = module_graph()
    shown = graph if args.modules else package_graph(graph)
    for node in sorted(shown):
        print(f"{node} -> {', '.join(sorted(shown[node])) or '(nothing)'}")
    found = cycles(shown)
    print(f"\ncycles: {found or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
