"""The package's import graph follows the layer rule of docs/architecture.md.

Every import in ``gradsafe/`` counts (module level, inside functions, under
``TYPE_CHECKING``; relative and absolute). Layers, bottom up:

0. ``gradsafe.patching`` (the registry and its parts), ``gradsafe._torch_support``,
   ``gradsafe._shared`` (utilities capabilities and tools share)
1. ``gradsafe.checks`` (what a hazard reproduction is)
2. the capability subpackages: ``pipelining``, ``dtensor``, ``cuda_graphs``,
   ``wgrad``, ``testing``, and the ``verify`` tool (a client of ``pipelining``
   and ``wgrad`` that ``testing`` re-exports; no capability imports it, see
   :func:`test_no_capability_imports_the_verify_tool`)
3. ``gradsafe.capabilities`` (the table that registers every patch)
4. ``gradsafe`` (the package's face), ``gradsafe.doctor``, ``gradsafe.__main__``

An import is upward when it goes to a higher layer than its own. The one there
is: ``gradsafe.verify._worker``, the main program of a ``gradsafe verify
--schedule`` rank process, applies ``gradsafe.patch``.

Also from the ``ast``: no circle among the packages (``gradsafe.X``), no
private module of one package imported from another, every module named in
docs/architecture.md, and no function over 60 lines of code (no exemptions).
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

import gradsafe

# Reads gradsafe's source and docs only: the same on every torch (noxfile.py's SUITES).
pytestmark = pytest.mark.torch_independent

PACKAGE = Path(gradsafe.__file__).parent
CAPABILITY_PACKAGES = ("pipelining", "dtensor", "cuda_graphs", "wgrad", "testing", "verify")


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
                targets |= {
                    resolve(a.name) for a in node.names if a.name.split(".")[0] == "gradsafe"
                }
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
    if parts[1:2] in (["patching"], ["_torch_support"], ["_shared"]):
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
    assert {"gradsafe.pipelining._patch", "gradsafe.wgrad._hazards"} <= graph[
        "gradsafe.capabilities"
    ]


#: pipelining's lazy shim for the verify tool's old names (``gradsafe.pipelining.verify``
#: and friends, deprecated for one release): it imports the tool inside ``__getattr__``,
#: only when an old name is used, and goes with the deprecation.
DEPRECATED_SHIM = ("gradsafe.pipelining", "gradsafe.verify")


def without_shim(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    source, target = DEPRECATED_SHIM
    return {**graph, source: graph[source] - {target}}


def test_the_import_graph_has_no_cycle() -> None:
    assert cycles(without_shim(import_graph())) == []


def test_at_most_one_import_runs_up_the_layers() -> None:
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in import_graph().items()
        for target in targets
        if layer(target) > layer(source)
    )
    assert len(upward) <= 1, upward


def test_no_capability_imports_the_verify_tool() -> None:
    """verify sits on the capabilities; the one way down to it is pipelining's lazy shim for the
    names that moved (``gradsafe.pipelining.verify`` and friends, deprecated for one release)."""
    into_verify = sorted(
        f"{source} -> {target}"
        for source, targets in import_graph().items()
        for target in targets
        if target.startswith("gradsafe.verify")
        and source.split(".")[1:2] in (["pipelining"], ["dtensor"], ["cuda_graphs"], ["wgrad"])
    )
    assert into_verify == ["gradsafe.pipelining -> gradsafe.verify"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# -- package-level rules ----------------------------------------------------------------


def package_of(module: str) -> str:
    """The unit of the package-level rules: ``gradsafe.X`` (a subpackage or a top-level module), or ``gradsafe``."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {package_of(m): set() for m in graph}
    for source, targets in graph.items():
        packages[package_of(source)] |= {package_of(t) for t in targets} - {package_of(source)}
    return packages


#: The rank process's main program of ``gradsafe verify --schedule``.
RANK_MAIN = "gradsafe.verify._worker"


def test_no_circle_among_packages() -> None:
    # A module-level import graph can be free of circles while two packages
    # import each other through different modules (wgrad's reproductions used
    # testing's Megatron double, which used wgrad's hook). The one upward
    # import, a --schedule rank's main program applying gradsafe.patch(), is
    # left out: no module imports that program, it is run as a process; so is
    # the DEPRECATED_SHIM.
    graph = without_shim(import_graph())
    graph[RANK_MAIN] = graph[RANK_MAIN] - {"gradsafe"}
    assert cycles(package_graph(graph)) == []


def test_the_package_graph_joins_modules_into_their_packages() -> None:
    graph = {
        "gradsafe.a._x": {"gradsafe.b.y"},
        "gradsafe.b.y": {"gradsafe.b"},
        "gradsafe.b": {"gradsafe.a"},
        "gradsafe.a": set(),
    }
    assert cycles(package_graph(graph)) == [["gradsafe.a", "gradsafe.b"]]


def private_owner(module: str) -> str | None:
    """The package ``module`` is private to: ``gradsafe.A`` for ``gradsafe.A._b`` or ``gradsafe.A.B._c``.

    None for a public module and for the top-level private modules
    (``gradsafe._x``, ``gradsafe._shared``), which every package may import.
    """
    parts = module.split(".")
    if len(parts) < 3 or _is_private(parts[1]):
        return None
    return ".".join(parts[:2]) if any(map(_is_private, parts[2:])) else None


#: The capability table imports each capability's plan and reproductions (and
#: the testing patch's plan) by design: CONTRIBUTING.md, "Add a capability".
TABLE = "gradsafe.capabilities"
TABLE_IMPORTS = (
    "._patch",
    "._hazards",
    "._capture_order_hazards",
    "gradsafe.testing._cuda_emulation",
)


def cross_package_private_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    found = set()
    for source, targets in graph.items():
        for target in targets:
            owner = private_owner(target)
            if owner is None or package_of(source) == owner:
                continue
            if source == TABLE and target.endswith(TABLE_IMPORTS):
                continue
            found.add((source, target))
    return found


def test_no_private_module_of_another_package_is_imported() -> None:
    assert cross_package_private_imports(import_graph()) == set(), (
        "a private module imported from another package: make what it needs public, or move "
        "the shared part down into gradsafe/_shared/"
    )


def test_the_private_import_rule_allows_the_own_package_and_top_level_private_modules() -> None:
    graph = {
        "gradsafe.a.b": {"gradsafe.a.x._y", "gradsafe._shared.z", "gradsafe._torch_support"},
        "gradsafe.c": {"gradsafe.a.x._y", "gradsafe.a.x"},
        "gradsafe.d._e": {"gradsafe.a._f"},
    }
    assert cross_package_private_imports(graph) == {
        ("gradsafe.c", "gradsafe.a.x._y"),
        ("gradsafe.d._e", "gradsafe.a._f"),
    }


# -- docs/architecture.md names every module --------------------------------------------

# The checkout's docs (CI tests an installed copy of the package, without docs/).
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def unnamed_modules(text: str) -> list[str]:
    """Module files of gradsafe/ whose path ``docs/architecture.md`` does not give.

    A package's ``__init__.py`` is named by its folder (``gradsafe/wgrad/``).
    """
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).as_posix()
        name = relative.removesuffix("__init__.py") if path.name == "__init__.py" else relative
        if f"`{name}`" not in text:
            missing.append(name)
    return missing


def test_architecture_md_names_every_module() -> None:
    assert unnamed_modules(ARCHITECTURE.read_text()) == [], (
        "name each module (as `gradsafe/...`) and its concern in docs/architecture.md"
    )


def test_the_module_names_check_sees_a_missing_module() -> None:
    text = ARCHITECTURE.read_text().replace("`gradsafe/wgrad/_store.py`", "")
    assert "gradsafe/wgrad/_store.py" in unnamed_modules(text)


# -- long functions ---------------------------------------------------------------------

LONG = 60


def code_lines(lines: list[str], function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of ``function`` that are neither blank, nor comments, nor its docstring."""
    docstring: range = range(0)
    first = function.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            docstring = range(first.lineno, (first.end_lineno or first.lineno) + 1)
    return sum(
        1
        for number in range(function.lineno, (function.end_lineno or function.lineno) + 1)
        if number not in docstring and lines[number - 1].strip()[:1] not in ("", "#")
    )


def long_functions(path: Path) -> set[str]:
    """Qualified names of the functions in ``path`` over LONG code lines."""
    lines = path.read_text().splitlines()
    found: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and code_lines(lines, child) > LONG:
                    found.add(name)
                visit(child, f"{name}.")

    visit(ast.parse(path.read_text(), str(path)), "")
    return found


def test_no_function_is_over_60_code_lines() -> None:
    long = {
        f"{path.relative_to(PACKAGE.parent).as_posix()}:{name}"
        for path in PACKAGE.rglob("*.py")
        for name in long_functions(path)
    }
    assert long == set(), f"over {LONG} lines of code, split them: {sorted(long)}"


def test_the_long_function_check_counts_code_lines_only(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(LONG - 1))
    sample = tmp_path / "sample.py"
    sample.write_text(
        f'def short():\n    """Doc."""\n\n    # why\n{body}\n\n\ndef long():\n{body}\n    y = 1\n'
    )
    assert long_functions(sample) == {"long"}
    sample.write_text(
        f"class C:\n    def long(self):  # long: a comment does not exempt it\n{body.replace('    ', '        ')}\n        y = 1\n"
    )
    assert long_functions(sample) == {"C.long"}


# -- private torch internals: one module per capability (docs/architecture.md) -----------

#: Per package, the modules that may touch private torch internals; every
#: capability's ``_patch.py`` may too (its patch targets are torch's own slots).
INTERNALS_MODULES = {
    "gradsafe.patching": {"gradsafe.patching._registry"},  # plans probed outside dispatch modes
    "gradsafe.pipelining": {"gradsafe.pipelining._torch"},
    "gradsafe.dtensor": {"gradsafe.dtensor._torch"},
    "gradsafe.cuda_graphs": {"gradsafe.cuda_graphs._structure", "gradsafe.cuda_graphs._autograd"},
    "gradsafe.wgrad": {"gradsafe.wgrad._torch"},
    # A dispatch mode (no public API for one): the CPU graph recorder.
    "gradsafe.testing": {"gradsafe.testing._graph_recorder"},
    # Dispatch modes: live tensor memory on any device (and storages' identities), and the
    # FLOP counter (FlopCounterMode's module hooks break a split's B and checkpoints).
    "gradsafe._shared": {"gradsafe._shared.live_storage", "gradsafe._shared.flops"},
    # torch.utils.checkpoint's call-time globals, replaced for verify's run without checkpoints.
    "gradsafe.verify": {"gradsafe.verify._uncheckpointed"},
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_torch_path(dotted: str) -> bool:
    parts = dotted.split(".")
    # torch.ops.aten._foo names an operator (public namespace), not a Python internal.
    return parts[0] == "torch" and parts[1:2] != ["ops"] and any(map(_is_private, parts[1:]))


def _private_object_attributes() -> frozenset[str]:
    """Private attributes of torch's own objects gradsafe reads (module hook dicts, Tensor and Node internals)."""
    import torch

    node = torch.ones(1, requires_grad=True).mul(2).grad_fn
    names = {*dir(torch.nn.Module()), *dir(torch.Tensor), *dir(node)}
    return frozenset(n for n in names if _is_private(n))


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def private_torch_uses(path: Path) -> set[str]:
    """What ``path`` uses of private torch: imports, ``torch.`` attribute paths, ``import_module``
    strings, and private attributes of torch objects (other than gradsafe's own, on ``self``/``cls``)."""
    object_attributes = _private_object_attributes()
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if _private_torch_path(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {
                f"{node.module}.{a.name}"
                for a in node.names
                if _private_torch_path(f"{node.module}.{a.name}")
            }
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted is not None and _private_torch_path(dotted):
                found.add(dotted)
            elif node.attr in object_attributes and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):
                found.add(f".{node.attr}")
        elif isinstance(node, ast.Call):
            func = _dotted(node.func) or ""
            names = [a.value for a in node.args[:2] if isinstance(a, ast.Constant)]
            if func.endswith("import_module"):
                found |= {n for n in names if isinstance(n, str) and _private_torch_path(n)}
            elif func in ("getattr", "hasattr", "setattr"):
                found |= {f".{n}" for n in names if n in object_attributes}
    return found


def test_private_torch_internals_live_in_one_module_per_capability() -> None:
    outside = {}
    for module, path in modules().items():
        package = module.rpartition(".")[0] if path.name != "__init__.py" else module
        allowed = INTERNALS_MODULES.get(package.rpartition(".")[0], set()) | INTERNALS_MODULES.get(
            package, set()
        )
        # An allowed module may be a package of its own: its modules are allowed too.
        if (
            module in allowed
            or package in allowed
            or (package in INTERNALS_MODULES and path.name == "_patch.py")
        ):
            continue
        uses = private_torch_uses(path)
        if uses:
            outside[module] = sorted(uses)
    assert outside == {}, f"private torch internals outside their capability's module: {outside}"


def test_the_internals_scan_sees_imports_attribute_paths_and_object_attributes(
    tmp_path: Path,
) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import importlib\n"
        "import torch\n"
        "from torch.utils._pytree import tree_flatten\n"
        "def f(m, t):\n"
        "    import torch.distributed.pipelining._backward as b\n"
        "    importlib.import_module('torch._dynamo')\n"
        "    getattr(t, '_backward_hooks', None)\n"
        "    torch.ops.aten._unique.default\n"
        "    return torch._C._current_graph_task_id(), m._forward_hooks, self._apply\n"
    )
    assert private_torch_uses(sample) == {
        "torch.utils._pytree.tree_flatten",
        "torch.distributed.pipelining._backward",
        "torch._dynamo",
        "._backward_hooks",
        "torch._C._current_graph_task_id",
        "torch._C",
        "._forward_hooks",
    }


# -- renamed modules keep their old name one minor release -------------------------------


def test_the_old_megatron_test_double_module_warns_and_gives_the_same_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gradsafe.testing

    monkeypatch.delitem(sys.modules, "gradsafe.testing.megatron", raising=False)
    with pytest.warns(DeprecationWarning, match="import HookCall, MegatronStyleDDP and module_of"):
        old = importlib.import_module("gradsafe.testing.megatron")
    assert (old.HookCall, old.MegatronStyleDDP, old.module_of) == (
        gradsafe.testing.HookCall,
        gradsafe.testing.MegatronStyleDDP,
        gradsafe.testing.module_of,
    )


# -- docs/architecture.md's inventory of private torch internals -------------------------

_PRIVATE_NAME = re.compile(r"_[A-Za-z0-9]\w*")
#: Private names the internals modules use that are not torch's (Python's own).
NOT_TORCH = {"_DummyThread"}


def internals_module_paths() -> list[Path]:
    """The modules allowed to touch private torch internals (INTERNALS_MODULES and every ``_patch.py``)."""
    found = []
    for module, path in modules().items():
        package = module.rpartition(".")[0] if path.name != "__init__.py" else module
        allowed = INTERNALS_MODULES.get(package.rpartition(".")[0], set()) | INTERNALS_MODULES.get(
            package, set()
        )
        if module in allowed or package in allowed or path.name == "_patch.py":
            found.append(path)
    return sorted(found)


def _gradsafe_attributes() -> set[str]:
    """Attribute names gradsafe gives its own objects (``self.x = ...``, ``__slots__``, fields)."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
            ):
                names |= {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant)}
    return names


def _defined_in(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias) and not node.name.startswith("torch"):
            names.add(node.asname or node.name.split(".")[-1])
    return names


def private_torch_names(path: Path, own: set[str]) -> set[str]:
    """Private names (``_x``) ``path`` reads of torch: attributes (but on ``self``/``cls``),
    strings that name one (``getattr(m, "_Holder")``, ``"_Class.method"``), and torch imports;
    less what ``path`` defines and ``own`` (gradsafe's own attributes)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"[\w.]+", node.value):
                found |= {p for p in node.value.split(".") if _PRIVATE_NAME.fullmatch(p)}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            parts = [*(node.module or "").split("."), *(a.name for a in node.names)]
            found |= {p for p in parts if _is_private(p)}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch"):
                    found |= {p for p in alias.name.split(".") if _is_private(p)}
    return {n for n in found if not n.startswith("__")} - _defined_in(tree) - own - NOT_TORCH


def inventory_rows(text: str) -> list[tuple[str, str]]:
    """(name cell, where cell) of each row of docs/architecture.md's internals table."""
    section = text.split("## Private torch internals", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 5:
            rows.append((cells[0], cells[1]))
    return rows


def missing_from_inventory(text: str) -> list[str]:
    """``module: name`` for each private torch name a module uses that no row names with that module."""
    rows = inventory_rows(text)
    own = _gradsafe_attributes()
    missing = []
    for path in internals_module_paths():
        where = f"`{path.relative_to(PACKAGE.parent).as_posix()}`"
        for name in sorted(private_torch_names(path, own)):
            if not any(name in names and where in modules_cell for names, modules_cell in rows):
                missing.append(f"{where}: {name}")
    return missing


def test_the_inventory_names_every_private_torch_name_with_its_module() -> None:
    assert missing_from_inventory(ARCHITECTURE.read_text()) == [], (
        "add the private torch name to docs/architecture.md's 'Private torch internals' table "
        "(name, where, what gradsafe relies on, probe, fallback), with the module that uses it"
    )


def test_the_inventory_check_sees_a_name_left_out_and_a_module_left_out() -> None:
    text = ARCHITECTURE.read_text()
    assert "`gradsafe/wgrad/_torch.py`: _current_graph_task_id" in missing_from_inventory(
        text.replace("`torch._C._current_graph_task_id`", "`torch._C.gone`")
    )
    holder_row = next(
        line for line in text.splitlines() if line.startswith("| `torch.utils.checkpoint._Holder`")
    )
    left_out = holder_row.replace("`gradsafe/pipelining/_torch/_checkpoint.py`, ", "")
    assert "`gradsafe/pipelining/_torch/_checkpoint.py`: _Holder" in missing_from_inventory(
        text.replace(holder_row, left_out)
    )


def test_the_inventory_scan_sees_strings_attributes_and_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch.utils.checkpoint\n"
        "from torch.utils._pytree import tree_map\n"
        "class Mine:\n"
        "    def f(self, node):\n"
        "        self._mine = 1\n"
        "        getattr(torch.utils.checkpoint, '_Holder', None)\n"
        "        return node._input_metadata, self._mine, '_Stage.forward_one_chunk'\n"
    )
    assert private_torch_names(sample, set()) == {
        "_pytree",
        "_Holder",
        "_input_metadata",
        "_Stage",
    }
