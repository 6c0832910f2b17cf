"""The house contracts every module of gradsafe/ promises."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gradsafe

# Reads gradsafe's source and docs only: the same on every torch (noxfile.py's SUITES).
pytestmark = pytest.mark.torch_independent


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


def test_modules_named_by_the_architecture_page_exist() -> None:
    # docs/architecture.md names the module of each capability that keeps its
    # uses of private torch internals; each must exist.
    import re

    root = Path(gradsafe.__file__).parent
    page = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    found = re.findall(r"`(?:gradsafe/((?:\w+/)?_\w+\.py)|(\w+/_\w+\.py))`", page)
    named = sorted({full or short for full, short in found})
    assert named, "the page names no module any more; update this test"
    assert [p for p in named if not (root / p).exists()] == []
