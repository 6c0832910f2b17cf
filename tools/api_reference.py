"""Write docs/api.md, the API reference, from the docstrings of every public gradsafe module.

Usage: ``python tools/api_reference.py`` rewrites ``docs/api.md``;
``python tools/api_reference.py --check`` exits 1 if it is stale (as
``tests/test_docs.py`` does). Public modules are found by walking the package:
every module whose dotted path has no component starting with ``_``; its
public names are its ``__all__``. An object several modules export (a
package re-exporting its module's names) is described once, under the first
module that exports it, and the others point to it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import inspect
import pkgutil
import re
import sys
import typing
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
API_MD = ROOT / "docs" / "api.md"

_HEADER = """# API reference

Generated from the docstrings by `python tools/api_reference.py` (do not edit by
hand; `tests/test_docs.py` fails when this page is stale). Every public module
of gradsafe (a dotted path with no part starting with `_`) and every name in its
`__all__`. Start with the [README](../README.md); symptoms are in
[troubleshooting.md](troubleshooting.md).
"""


def public_modules() -> list[ModuleType]:
    """gradsafe and every public module under it, parents before children, then by name."""
    import gradsafe

    names = ["gradsafe"] + [
        info.name for info in pkgutil.walk_packages(gradsafe.__path__, "gradsafe.")
    ]
    public = [n for n in names if not any(part.startswith("_") for part in n.split("."))]
    public.sort(key=lambda n: (n.count("."), n))
    return [importlib.import_module(n) for n in public]


def public_names() -> dict[str, list[str]]:
    """Each public module's name and the names in its ``__all__``."""
    return {m.__name__: list(getattr(m, "__all__", ())) for m in public_modules()}


def _rst_to_md(text: str) -> str:
    # :func:`~a.b.c` -> `c`, :class:`a.b` -> `a.b`, ``x`` -> `x`.
    text = re.sub(r":[a-z]+:`~(?:[\w.]+\.)?([\w]+)`", r"`\1`", text)
    text = re.sub(r":[a-z]+:`([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _own_doc(obj: object) -> str | None:
    # Never inherited (inspect.getdoc would give a torch base class's text,
    # which differs between torch releases), never dataclasses' generated one.
    doc = obj.__doc__ if isinstance(obj.__doc__, str) else None
    if doc is None or (dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}(")):  # type: ignore[union-attr]
        return None
    return _rst_to_md(inspect.cleandoc(doc))


def _doc(obj: object) -> str:
    return _own_doc(obj) or "(no docstring)"


class _Shown:
    """Shows its text as it is: an annotation without quotes, a default without its address."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _annotation(value: object) -> object:
    if value is inspect.Parameter.empty:
        return value
    return _Shown(value if isinstance(value, str) else inspect.formatannotation(value))


def _default(value: object) -> object:
    if value is inspect.Parameter.empty:
        return value
    return _Shown(re.sub(r" at 0x[0-9a-f]+", "", repr(value)))


def _signature(obj: object) -> str:
    try:
        sig = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"
    params = [
        p.replace(annotation=_annotation(p.annotation), default=_default(p.default))
        for p in sig.parameters.values()
    ]
    return str(sig.replace(parameters=params, return_annotation=_annotation(sig.return_annotation)))


def _class_signature(cls: type) -> str:
    # Only a constructor gradsafe defines: the signature Python derives for a
    # Protocol or an exception's inherited builtin constructor differs between
    # Python releases.
    if getattr(cls, "_is_protocol", False):
        return ""
    own = any(
        c.__module__.startswith("gradsafe") and ("__init__" in vars(c) or "__new__" in vars(c))
        for c in cls.__mro__
    )
    return _signature(cls) if own else ""


def _members(cls: type) -> list[str]:
    lines = []
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            lines.append(f"* `{name}` (property){_first_paragraph(member, ': ')}")
        elif isinstance(member, (staticmethod, classmethod)):
            func = member.__func__
            lines.append(f"* `{name}{_signature(func)}`{_first_paragraph(func, ': ')}")
        elif inspect.isfunction(member):
            lines.append(f"* `{name}{_signature(member)}`{_first_paragraph(member, ': ')}")
    return lines


def _first_paragraph(obj: object, lead: str = "") -> str:
    doc = _own_doc(obj)
    return lead + " ".join(doc.split("\n\n")[0].split()) if doc else ""


def _alias(name: str) -> tuple[str, str] | None:
    """A ``Name: TypeAlias = ...`` in gradsafe's source: its value as written and its docstring.

    Read from the source because Python shows a generic alias differently from
    one release to the next (3.10 calls ``Callable[...]`` a class) and keeps no
    docstring for it.
    """
    for path in sorted((ROOT / "gradsafe").rglob("*.py")):
        body = ast.parse(path.read_text()).body
        for i, node in enumerate(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == name
                and ast.unparse(node.annotation) == "TypeAlias"
                and node.value is not None
            ):
                after = body[i + 1] if i + 1 < len(body) else None
                doc = ""
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    doc = _rst_to_md(inspect.cleandoc(str(after.value.value)))
                return ast.unparse(node.value), doc
    return None


def _describe(module: str, name: str, obj: object) -> list[str]:
    lines = [f"### `{module}.{name}`", ""]
    alias = _alias(name) if typing.get_origin(obj) is not None else None
    if alias is not None:
        value, doc = alias
        lines += [f"type alias `{name} = {value}`", "", doc or "(no docstring)", ""]
    elif inspect.isclass(obj) and issubclass(obj, enum.Enum):
        # An enum's signature differs between Python releases; its members do not.
        values = ", ".join(f"`{m.name}` = `{m.value!r}`" for m in obj)
        lines += [f"enum `{name}`: {values}", "", _doc(obj), ""]
    elif inspect.isclass(obj):
        kind = "exception" if issubclass(obj, BaseException) else "class"
        lines += [f"{kind} `{name}{_class_signature(obj)}`", "", _doc(obj), ""]
        members = _members(obj)
        if members:
            lines += ["Members:", "", *members, ""]
    elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
        lines += [f"`{name}{_signature(obj)}`", "", _doc(obj), ""]
    else:
        # Data: a constant or a typing alias. Its repr may hold an address, so
        # only its type is shown (an alias's own text is stable).
        shown = repr(obj) if type(obj).__module__ == "typing" else type(obj).__name__
        lines += [f"`{name}`: `{shown}`", ""]
    return lines


def render() -> str:
    """docs/api.md's text for the gradsafe importable now."""
    lines = [_HEADER]
    seen: dict[int, str] = {}
    for module in public_modules():
        names = list(getattr(module, "__all__", ()))
        lines += [f"## `{module.__name__}`", "", _first_paragraph(module), ""]
        for name in names:
            obj = getattr(module, name)
            first = seen.get(id(obj))
            if first is not None and not isinstance(obj, (str, int, bool)):
                lines += [
                    f"### `{module.__name__}.{name}`",
                    "",
                    f"The same object as `{first}`.",
                    "",
                ]
                continue
            seen[id(obj)] = f"{module.__name__}.{name}"
            lines += _describe(module.__name__, name, obj)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python tools/api_reference.py", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = API_MD.read_text() if API_MD.exists() else ""
        if current != text:
            print("docs/api.md is stale: run python tools/api_reference.py", file=sys.stderr)
            return 1
        return 0
    API_MD.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
