"""The package's layout holds: no import cycles, the server and the site daemon apart,
the core free of drivers. Read from the source with `ast` (nothing is imported), so
an import inside a function or under TYPE_CHECKING counts as much as one at the top:
each is a dependency a reader has to follow, and a cycle hidden in a function is
still a cycle."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fedtrain"

#: Cycles the package lives with, each with its reason. None today: add one only with
#: a sentence saying why it cannot be broken.
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()

CORE = (
    "fedtrain.tensors",
    "fedtrain.task",
    "fedtrain.strategy",
    "fedtrain.secagg",
    "fedtrain.privacy",
    "fedtrain.compression",
)
DRIVERS = ("fedtrain.runtime", "fedtrain.simulation", "fedtrain.cli")
SERVER = "fedtrain.runtime.server"
SITE = "fedtrain.runtime.site"


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> its file, for every module under `package`."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports, wherever in its file the import is.

    `from a import b` is an edge to module `a.b` when there is one, else to `a`; an
    import's implied parent packages are not edges (Python runs their `__init__`
    first, but that cannot deadlock an import).
    """
    modules = module_files(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(tree):
            for target in _imported(node, name, is_package, modules):
                if target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def _imported(
    node: ast.AST, module: str, is_package: bool, modules: dict[str, Path]
) -> Iterable[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, base] if base else parts)
        names = [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
            for alias in node.names
        ]
    else:
        return []
    return [m for m in (_module_of(n, modules) for n in names) if m is not None]


def _module_of(name: str, modules: dict[str, Path]) -> str | None:
    """The module `name` is or lies in (`a.b.C` -> `a.b`); None outside the package."""
    while name not in modules:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> ... -> a) through each group of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(group, graph) for group in groups]


def _cycle_through(group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {w: [start, w] for w in graph[start] if w in group}
    frontier = list(paths)
    while start not in paths:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    return paths[start]


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module `start` imports, directly or not -> the import chain that gets there."""
    chains = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in chains:
                    chains[w] = [*chains[v], w]
                    nxt.append(w)
        frontier = nxt
    del chains[start]
    return chains


def within(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def under(graph: dict[str, set[str]], prefixes: Iterable[str]) -> list[str]:
    """The modules of `graph` in (or equal to) any of the packages `prefixes`."""
    return sorted(m for m in graph if within(m, prefixes))


def violations(
    graph: dict[str, set[str]], modules: Iterable[str], forbidden: Iterable[str]
) -> list[str]:
    """Import chains from one of `modules` to a module under `forbidden`."""
    forbidden = tuple(forbidden)
    return [
        " -> ".join(chain)
        for module in modules
        for target, chain in reachable(graph, module).items()
        if within(target, forbidden)
    ]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(PACKAGE)


def test_no_module_imports_itself_back_through_other_modules(graph) -> None:
    found = [c for c in cycles(graph) if frozenset(c) not in KNOWN_CYCLES]
    assert not found, "import cycles (break each with a Protocol or a module both use):\n" + (
        "\n".join(" -> ".join(c) for c in found)
    )


def test_the_site_daemon_and_the_aggregation_server_never_import_each_other(graph) -> None:
    site, server = under(graph, [SITE]), under(graph, [SERVER])
    assert len(site) > 1 and len(server) > 1
    found = violations(graph, site, [SERVER]) + violations(graph, server, [SITE])
    assert not found, "what both ends need belongs in fedtrain.runtime:\n" + "\n".join(found)


def test_what_both_ends_share_imports_neither_end(graph) -> None:
    shared = [m for m in under(graph, ["fedtrain.runtime"]) if not within(m, [SERVER, SITE])]
    assert "fedtrain.runtime.wire" in shared
    found = violations(graph, shared, [SERVER, SITE])
    assert not found, "a shared module reaches into one end:\n" + "\n".join(found)


def test_the_core_never_imports_a_driver_or_the_cli(graph) -> None:
    core = under(graph, CORE)
    assert all(c in core for c in CORE)
    found = violations(graph, core, DRIVERS)
    assert not found, "the core (ARCHITECTURE.md) knows no driver:\n" + "\n".join(found)


def test_the_checker_sees_imports_in_functions_and_under_type_checking(tmp_path: Path) -> None:
    """A cycle closed by a function-level or TYPE_CHECKING import is found, and a
    relative import resolves; so the checks above can fail."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\ndef g(): ...\n"
    )
    (package / "d.py").write_text("import pkg.c\n")
    graph = import_graph(package)
    assert graph == {
        "pkg": set(),
        "pkg.sub": set(),
        "pkg.a": {"pkg.sub.b"},
        "pkg.sub.b": {"pkg.c"},
        "pkg.c": {"pkg.a"},
        "pkg.d": {"pkg.c"},
    }
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    assert violations(graph, ["pkg.d"], ["pkg.sub"]) == ["pkg.d -> pkg.c -> pkg.a -> pkg.sub.b"]
