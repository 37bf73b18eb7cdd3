"""No import circles inside ``xllm_vmm``.

The graph has one node per module of the package (a package is its ``__init__``) and an
edge ``a -> b`` for every import of ``b`` written in ``a``, at module level **and inside
functions** (a function-local import is a dependency too; it only moves the moment it is
paid). Relative imports are resolved against the importing module's package;
``from xllm_vmm.x import y`` is an import of the submodule ``xllm_vmm.x.y`` when ``y`` is a
submodule, else of ``xllm_vmm.x`` (the package's ``__init__``). Importing ``xllm_vmm.x.y``
runs ``xllm_vmm/x/__init__.py`` first, but that edge is implied and not drawn: a package
``__init__`` that re-exports from its own submodules is the usual façade, not a circle.

Imports under ``if TYPE_CHECKING:`` do **not** count: they never run, and they are how a
lower module names a higher module's type in an annotation without depending on it.

The rule this enforces (docs/architecture.md, *Package layout*): the modules form a
directed acyclic graph — every import points down, none runs back up, also not through a
function-local import. The test prints every circle it finds, shortest path first.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import xllm_vmm

ROOT = Path(xllm_vmm.__file__).resolve().parent
PACKAGE = "xllm_vmm"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    if isinstance(test, ast.Attribute):
        return test.attr == "TYPE_CHECKING"
    return False


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree``, at any depth, outside ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    walk_one(sub)
                continue
            walk_one(child)

    def walk_one(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        walk(node)

    walk(tree)
    return found


def _resolve(
    name: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]
) -> set[str]:
    """The package's modules that ``node`` (written in module ``name``) imports."""
    targets: set[str] = set()

    def nearest(dotted: str) -> str | None:
        while dotted:
            if dotted in modules:
                return dotted
            dotted = dotted.rpartition(".")[0]
        return None

    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] == PACKAGE:
                hit = nearest(alias.name)
                if hit:
                    targets.add(hit)
        return targets
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        if node.level > 1:
            base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] != PACKAGE:
        return targets
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        if sub in modules:
            targets.add(sub)
        else:
            hit = nearest(source)
            if hit:
                targets.add(hit)
    return targets


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        with warnings.catch_warnings():  # a module's own escape-sequence warnings are not ours
            warnings.simplefilter("ignore")
            tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in _imports(tree):
            edges |= _resolve(name, is_package, node, modules)
        edges.discard(name)
        graph[name] = edges
    return graph


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest circle through the component's first module, as a path a -> ... -> a."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in seen:
                    seen.add(child)
                    parents[child] = node
                    nxt.append(child)
        frontier = nxt
    return component


def describe_cycles(graph: dict[str, set[str]]) -> str:
    lines = []
    for component in _strongly_connected(graph):
        cycle = _shortest_cycle(graph, component)
        lines.append(
            f"{len(component)} modules in a circle, e.g. " + " -> ".join(cycle)
            + "\n    all: " + ", ".join(component)
        )
    return "\n".join(lines)


def test_no_import_cycles():
    graph = import_graph()
    report = describe_cycles(graph)
    assert not report, "import circles in xllm_vmm:\n" + report


def test_walker_sees_local_submodule_and_relative_imports(tmp_path):
    """The walker itself: a function-local relative import of a submodule is an edge, a
    TYPE_CHECKING import is not, and a two-module circle is reported."""
    modules = {"xllm_vmm.a": Path("a.py"), "xllm_vmm.b": Path("b.py"), "xllm_vmm": Path("i.py")}
    local = ast.parse("def f():\n    from . import b\n")
    typed = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from xllm_vmm import a\n")
    edges_a = set().union(*(_resolve("xllm_vmm.a", False, n, modules) for n in _imports(local)))
    edges_b = set().union(*(_resolve("xllm_vmm.b", False, n, modules) for n in _imports(typed)))
    assert edges_a == {"xllm_vmm.b"}
    assert edges_b == set()
    circle = describe_cycles({"xllm_vmm.a": {"xllm_vmm.b"}, "xllm_vmm.b": {"xllm_vmm.a"}, "xllm_vmm": set()})
    assert "xllm_vmm.a -> xllm_vmm.b -> xllm_vmm.a" in circle
