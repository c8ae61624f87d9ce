"""The package's layers, read from its imports (ast, nothing imported): so the layout stays true.

    entrypoints --> api --> coordinator --> engine, kv_transfer, models, protocol, ...
                   (text)   (token ids)

An import anywhere in a module counts (a lazy one inside a function too, and one under
TYPE_CHECKING): each is a dependency a reader has to follow.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "splitserve"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str], root: Path = PACKAGE) -> set[str]:
    """The splitserve modules (of `modules`) this file imports: `from a import b` is a.b when b is
    a module, else a."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                module = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            submodules = {f"{module}.{a.name}" for a in node.names} & modules
            found.update(submodules or ({module} & modules))
    found.discard(name)
    return found


def package_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the splitserve modules it imports."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    return {name: imports_of(path, set(files), root) for name, path in files.items()}


def under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def violations(graph: dict[str, set[str]]) -> list[str]:
    """What breaks the layering, one line each; [] when the layout holds."""
    rules = [  # (importers, what they must not import, why)
        (("splitserve",), ("splitserve.frontend",), "splitserve.frontend is gone"),
        (("splitserve.coordinator", "splitserve.engine", "splitserve.cluster"), ("splitserve.api",),
         "token ids never reach up into the text layer"),
        (("splitserve.engine", "splitserve.kv_transfer", "splitserve.models"),
         ("splitserve.coordinator", "splitserve.api", "splitserve.trial", "splitserve.entrypoints"),
         "the engine side knows nothing of who drives it"),
        (("splitserve.coordinator", "splitserve.api"), ("splitserve.entrypoints",),
         "entry points wire the layers; nothing below imports them"),
    ]
    found = []
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            for importers, forbidden, why in rules:
                if under(module, *importers) and under(target, *forbidden):
                    found.append(f"{module} imports {target}: {why}")
    if any(under(m, "splitserve.frontend") for m in graph):
        found.append("a module under splitserve.frontend exists")
    for package in ("splitserve.coordinator", "splitserve.api"):
        found += [f"import cycle in {package}: {' -> '.join(c)}" for c in cycles(graph, package)]
    return found


def cycles(graph: dict[str, set[str]], package: str) -> list[list[str]]:
    """One cycle per strongly connected group of `package`'s modules (Tarjan), with its path."""
    nodes = sorted(m for m in graph if under(m, package))
    edges = {m: sorted(t for t in graph[m] if under(t, package)) for m in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

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
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in edges[v]:
                groups.append(group)

    for v in nodes:
        if v not in index:
            visit(v)
    return [path_through(sorted(g), edges) for g in groups]


def path_through(group: list[str], edges: dict[str, list[str]]) -> list[str]:
    """The shortest way from group[0] back to itself inside the group (breadth first)."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in edges[v]:
                if w == start:
                    return paths[v] + [start]
                if w in members and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return group


def test_the_package_keeps_its_layers():
    graph = package_graph()
    assert "splitserve.coordinator.dispatcher" in graph and "splitserve.api.serving" in graph  # it read the tree
    assert violations(graph) == []


def test_the_check_finds_each_kind_of_violation():
    graph = {
        "splitserve.frontend.old": set(),
        "splitserve.engine.core": {"splitserve.coordinator.router"},
        "splitserve.cluster.ray": {"splitserve.api.render"},
        "splitserve.coordinator.a": {"splitserve.coordinator.b"},
        "splitserve.coordinator.b": {"splitserve.coordinator.a"},
        "splitserve.coordinator.router": set(),
        "splitserve.api.render": set(),
        "splitserve.api.serving": {"splitserve.api.render", "splitserve.coordinator.router"},  # allowed
    }
    found = violations(graph)
    assert any("engine.core imports splitserve.coordinator.router" in v for v in found)
    assert any("cluster.ray imports splitserve.api.render" in v for v in found)
    assert any("under splitserve.frontend" in v for v in found)
    assert any(v.startswith("import cycle in splitserve.coordinator") and "coordinator.a" in v for v in found)
    assert not any("api.serving" in v for v in found)
    assert len(found) == 4


def test_relative_and_lazy_imports_are_read(tmp_path):
    pkg = tmp_path / "splitserve" / "coordinator"
    pkg.mkdir(parents=True)
    (tmp_path / "splitserve" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n    from splitserve.coordinator.c import X\n")
    (pkg / "b.py").write_text("from .a import f\n")
    (pkg / "c.py").write_text("X = 1\n")
    graph = package_graph(tmp_path / "splitserve")
    assert graph["splitserve.coordinator.a"] == {"splitserve.coordinator.b", "splitserve.coordinator.c"}
    assert graph["splitserve.coordinator.b"] == {"splitserve.coordinator.a"}
