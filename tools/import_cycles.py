"""Import cycles among the modules of nanoserve/ and offload/: prints each cycle (a strongly
connected component of more than one module) with the import lines that close it; exits 1 if
there is any.

    python tools/import_cycles.py [package ...]    # default: nanoserve offload

An edge is any import statement that names a module of these packages, at the top of a file or
inside a function (a deferred import still ties the two modules together). `from p import n`
points at p.n where that is a module, else at p. Not counted: imports under
`if TYPE_CHECKING:` (never run), and the implicit import of a package's `__init__` that
importing one of its submodules triggers (otherwise every package that imports its own
submodules would count as a cycle).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("nanoserve", "offload")

Edges = dict[str, dict[str, list[int]]]  # module -> imported module -> line numbers


def module_names(packages: tuple[str, ...]) -> dict[str, Path]:
    modules = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, however deeply nested, except under `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif _is_type_checking(child):
            for orelse in child.orelse:
                yield from _imports(orelse)
        else:
            yield from _imports(child)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted `name` that is one of `modules`."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in modules:
            return prefix
    return None


def import_edges(modules: dict[str, Path]) -> Edges:
    edges: Edges = {m: {} for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [_known(alias.name, modules) for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [_known(f"{base}.{alias.name}", modules) for alias in node.names]
            for target in targets:
                if target is not None and target != module:
                    edges[module].setdefault(target, []).append(node.lineno)
    return edges


def cycles(edges: Edges) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges)))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def main(packages: tuple[str, ...]) -> int:
    modules = module_names(packages)
    edges = import_edges(modules)
    found = cycles(edges)
    print(f"{len(found)} import cycle(s) among {len(modules)} modules of {', '.join(packages)}")
    for i, component in enumerate(found, 1):
        print(f"cycle {i}: {', '.join(component)}")
        members = set(component)
        for module in component:
            path = modules[module].relative_to(ROOT)
            for target, lines in sorted(edges[module].items()):
                if target in members:
                    print(f"  {path}:{','.join(map(str, sorted(set(lines))))} -> {target}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(tuple(sys.argv[1:]) or PACKAGES))
