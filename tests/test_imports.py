"""The import graph of rag_mm, retriever and parallel runs one way: no module imports, directly or
through others, a module that imports it back, and ``parallel/`` never imports the app.

The graph is read with ``ast`` from every ``import`` statement of every module, those inside
functions and ``if TYPE_CHECKING:`` included (a lazy import hides a circle, it does not break it).
``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b`` (its
``__init__``); the parent packages an import initialises on the way are not edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rag_mm", "retriever", "parallel")
APP = ("rag_mm", "retriever")  # what parallel/ must never import

# Circles known and not yet broken, each with what ties it; the test fails when one is gone too,
# so this list only shrinks.
KNOWN_CYCLES: set[frozenset[str]] = set()


def _modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package) for every module of PACKAGES under ``root``."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in its file)."""
    mods = _modules(root)

    def project_module(name: str) -> str | None:  # the longest prefix of ``name`` that is a module
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(project_module(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: ``from ..x import y`` inside package ``package``
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets.update(project_module(f"{base}.{a.name}") for a in node.names)
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One circle through the component's first module, as ``a -> b -> a``."""
    inside, start = set(component), component[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth first inside the component, back to start
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & inside):
                if w == start:  # closed: walk back from v
                    walk = [v]
                    while walk[-1] != start:
                        walk.append(prev[walk[-1]])
                    return " -> ".join([*reversed(walk), start])
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return " <-> ".join(component)


def test_graph_sees_every_package():
    graph = import_graph()
    for pkg in PACKAGES:
        assert pkg in graph
    # a plain ``from parallel.tp.plan import``
    assert "parallel.tp.plan" in graph["parallel.tp.verify"]
    assert "parallel.tp.verify" in graph["parallel.api"]  # a relative ``from .tp.verify import``


def test_no_import_cycles():
    graph = import_graph()
    found = {frozenset(c): c for c in cycles(graph)}
    new = [_path(graph, c) for key, c in found.items() if key not in KNOWN_CYCLES]
    assert not new, "import circles between project modules:\n  " + "\n  ".join(new)
    gone = [sorted(k) for k in KNOWN_CYCLES if k not in found]
    assert not gone, f"circles broken since: remove them from KNOWN_CYCLES: {gone}"


def test_parallel_never_imports_the_app():
    graph = import_graph()
    bad = [
        f"{m} imports {t}"
        for m in sorted(graph)
        if m.split(".")[0] == "parallel"
        for t in sorted(graph[m])
        if t.split(".")[0] in APP
    ]
    assert not bad, "parallel/ imports the app:\n  " + "\n  ".join(bad)


def test_cycle_finder_on_a_small_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert _path(graph, ["a", "b", "c"]) == "a -> b -> c -> a"
    assert cycles({"a": {"b"}, "b": set()}) == []
