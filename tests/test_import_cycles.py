"""No module of the package imports another that imports it back, directly or round a loop,
type-checking imports included: a loop means neither side can be read, tested or moved
without the other. Read off the source (every `import` and `from ... import`, wherever it
sits), so a loop fails here the moment it is written."""

from __future__ import annotations

import ast
from pathlib import Path

import tokenpools

PACKAGE = Path(tokenpools.__file__).parent


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module (dotted name) → the package's modules it imports."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = ("tokenpools", *path.relative_to(root).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:  # `from pkg import module` imports the module
                    full = f"{node.module}.{alias.name}"
                    target = full if full in modules else node.module
                    if target in modules:
                        graph[name].add(target)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other round a loop (strongly connected
    components of more than one module, or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert loops(import_graph()) == []


def test_a_loop_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(loops(graph)) == [["a", "b", "c"], ["e"]]


def test_the_graph_sees_type_checking_and_package_imports(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "sub" / "__init__.py").write_text("from tokenpools.sub.one import X\n")
    (tmp_path / "sub" / "one.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tokenpools.sub import two\n"
    )
    (tmp_path / "sub" / "two.py").write_text("import tokenpools.sub.one\n")
    graph = import_graph(tmp_path)
    assert graph["tokenpools.sub.one"] == {"tokenpools.sub.two"}
    assert loops(graph) == [["tokenpools.sub.one", "tokenpools.sub.two"]]
