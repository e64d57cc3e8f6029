"""erase_fx's own modules import one another without a circle.

The graph is read from the source (the ``ast`` of each module), not from
``sys.modules``: an edge ``a -> b`` for every ``import`` of ``b`` in ``a``,
at the top of the module or inside a function. A function-level import
counts as an edge: one placed there to break a circle is still the circle.
The lazy imports that are not circles are listed below with their reason.

Not edges: a submodule's import of its parent packages (Python runs
``erase_fx/__init__.py`` before any ``erase_fx.*``, and every package with an
``__init__`` that re-exports its submodules has that loop), and imports of
anything outside erase_fx (torch's heavy modules are imported lazily in
places, which is fine).

``python tests/test_imports.py`` prints the graph, one ``a -> b`` a line
(``*`` marks a function-level import); ``--dot`` prints it for Graphviz.
"""
from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the folders of erase_fx's packages by their names: erase_fx/ and its subpackages, and
#: passes/, which installs as erase_fx.passes (pyproject.toml's package-dir)
PACKAGES = {
    **{".".join(init.parent.relative_to(ROOT).parts): init.parent
       for init in sorted((ROOT / "erase_fx").rglob("__init__.py"))},
    "erase_fx.passes": ROOT / "passes",
}

#: Function-level imports of erase_fx modules that are deliberate, and why. Each is an
#: edge of the graph like any other (none may close a circle); listed so that a new one
#: is a choice, not a way around a circle.
LAZY_IMPORTS = {
    ("erase_fx.cli", "erase_fx.demo"): "the CLI starts without building the demo's models",
    ("erase_fx.instruments", "erase_fx.schedule_picture"):
        "it needs pydot, an optional dependency (erase-fx[viz]), only when a dump draws",
    ("erase_fx.profile", "erase_fx.backend"):
        "profile imports no torch at the top: the CLI reads its defaults and starts fast",
    ("erase_fx.profile", "erase_fx.emit.program"): "as above",
}


def modules() -> dict[str, Path]:
    """Every module of erase_fx, by its dotted name."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
    return found


def _imports(tree: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Every import statement under ``tree``, with whether it runs inside a function."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda))
        yield from _imports(child, inside)


def _targets(statement: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The erase_fx modules one import statement of module ``name`` imports."""
    if isinstance(statement, ast.Import):
        return {alias.name for alias in statement.names if alias.name in known}
    assert isinstance(statement, ast.ImportFrom)
    base = statement.module or ""
    if statement.level:
        parts = name.split(".")
        anchor = parts if is_package else parts[:-1]
        anchor = anchor[:len(anchor) - (statement.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    targets = set()
    for alias in statement.names:
        submodule = f"{base}.{alias.name}"
        if submodule in known:
            targets.add(submodule)  # from erase_fx import ddp
        elif base in known:
            targets.add(base)  # from erase_fx.passes import MAIN_STREAM
    return targets


def import_graph() -> dict[tuple[str, str], bool]:
    """Every edge ``(importer, imported)`` among erase_fx's modules, to whether it is only
    imported inside functions."""
    found = modules()
    known = set(found)
    edges: dict[tuple[str, str], bool] = {}
    for name, path in found.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for statement, in_function in _imports(tree):
            for target in _targets(statement, name, path.stem == "__init__", known):
                if target != name:
                    key = (name, target)
                    edges[key] = edges.get(key, True) and in_function
    return edges


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_modules_are_found():
    found = modules()
    assert {"erase_fx", "erase_fx.backend", "erase_fx.ddp", "erase_fx.emit.program",
            "erase_fx.passes", "erase_fx.passes.pipeline"} <= set(found)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert all(f'"{package}"' in pyproject for package in PACKAGES)  # installed packages


def test_the_graph_sees_every_kind_of_import():
    edges = import_graph()
    assert edges[("erase_fx.backend", "erase_fx.compilation")] is False  # from a import B
    assert edges[("erase_fx.backend", "erase_fx.ddp")] is False  # from erase_fx import ddp
    assert edges[("erase_fx.emit.program", "erase_fx.passes")] is False  # from a package
    assert edges[("erase_fx.cli", "erase_fx.demo")] is True  # inside a function
    assert cycles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == [["a", "b", "c"]]


def test_no_import_circle_among_erase_fx_modules():
    circles = cycles(set(import_graph()))
    assert not circles, (
        "erase_fx's modules import one another in a circle (function-level imports count): "
        f"{circles}; move what both sides need to a module both can import "
        "(passes/graph.py for graph helpers)")


def test_function_level_imports_are_the_listed_lazy_ones():
    lazy = {edge for edge, in_function in import_graph().items() if in_function}
    assert lazy == set(LAZY_IMPORTS), (
        f"new: {sorted(lazy - set(LAZY_IMPORTS))}, gone: {sorted(set(LAZY_IMPORTS) - lazy)}: "
        "import at the top of the module, or list a deliberate lazy import in LAZY_IMPORTS "
        "with its reason")


def main(argv: list[str]) -> int:
    edges = import_graph()
    if "--dot" in argv:
        print("digraph erase_fx_imports {")
        for (a, b), lazy in sorted(edges.items()):
            print(f'  "{a}" -> "{b}"{" [style=dashed]" if lazy else ""};')
        print("}")
    else:
        for (a, b), lazy in sorted(edges.items()):
            print(f"{a} -> {b}{' *' if lazy else ''}")
    for circle in cycles(set(edges)):
        print("circle:", " ".join(circle), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
