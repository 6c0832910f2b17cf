"""Review findings on the house contracts every module of gradsafe/ promises."""

from __future__ import annotations

import ast
from pathlib import Path

import gradsafe


def test_no_assert_statements_in_the_package() -> None:
    # "No assert for control flow anywhere in gradsafe/ (python -O strips it)."
    root = Path(gradsafe.__file__).parent
    found = [
        f"{path.relative_to(root.parent)}:{node.lineno}"
        for path in sorted(root.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Assert)
    ]
    assert found == []
