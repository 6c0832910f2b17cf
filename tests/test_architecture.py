"""The package's import graph follows the layer rule of docs/architecture.md.

Every import in ``gradsafe/`` counts (module level, inside functions, under
``TYPE_CHECKING``; relative and absolute). Layers, bottom up:

0. ``gradsafe.patching`` (the registry and its parts), ``gradsafe._torch_support``
1. ``gradsafe.checks`` (what a hazard reproduction is)
2. the capability subpackages: ``pipelining``, ``dtensor``, ``cuda_graphs``,
   ``wgrad``, ``testing``
3. ``gradsafe.capabilities`` (the table that registers every patch)
4. ``gradsafe`` (the package's face), ``gradsafe.doctor``, ``gradsafe.__main__``

An import is upward when it goes to a higher layer than its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gradsafe

PACKAGE = Path(gradsafe.__file__).parent
CAPABILITY_PACKAGES = ("pipelining", "dtensor", "cuda_graphs", "wgrad", "testing")


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the gradsafe modules it imports (a name imported from a package counts as its submodule when it is one)."""
    known = modules()

    def resolve(name: str) -> str:
        while name not in known:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names if a.name.split(".")[0] == "gradsafe"}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                if source.split(".")[0] != "gradsafe":
                    continue
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    targets.add(full if full in known else resolve(source))
        graph[module] = targets - {module}
    return graph


def layer(module: str) -> int:
    parts = module.split(".")
    if parts[1:2] in (["patching"], ["_torch_support"]):
        return 0
    if parts[1:2] == ["checks"]:
        return 1
    if len(parts) > 1 and parts[1] in CAPABILITY_PACKAGES:
        return 2
    if parts[1:2] == ["capabilities"]:
        return 3
    return 4  # gradsafe itself, doctor, __main__


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_layer_and_the_graph_sees_imports_inside_functions() -> None:
    graph = import_graph()
    assert "gradsafe.patching" in graph and "gradsafe.checks" in graph
    # capabilities.py imports each capability's _patch and _hazards inside functions only.
    assert {"gradsafe.pipelining._patch", "gradsafe.wgrad._hazards"} <= graph["gradsafe.capabilities"]


def test_the_import_graph_has_no_cycle() -> None:
    assert cycles(import_graph()) == []


def test_at_most_one_import_runs_up_the_layers() -> None:
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in import_graph().items()
        for target in targets
        if layer(target) > layer(source)
    )
    assert len(upward) <= 1, upward


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
