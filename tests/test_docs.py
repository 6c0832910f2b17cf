"""The docs stay true to the code: the API reference is current, every public name is documented."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

# Reads gradsafe's source and docs only: the same on every torch (noxfile.py's SUITES).
pytestmark = pytest.mark.torch_independent

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _user_pages() -> dict[str, str]:
    """README and docs/, less the generated reference (which names everything by construction)."""
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {p.name: p.read_text() for p in pages if p.name != "api.md"}


def test_api_reference_is_regenerated_from_the_current_docstrings() -> None:
    expected = _tool("api_reference").render()
    current = (ROOT / "docs" / "api.md").read_text()
    assert current == expected, "docs/api.md is stale: run python tools/api_reference.py"


def test_api_reference_covers_every_public_module_found_by_walking_the_package() -> None:
    names = _tool("api_reference").public_names()
    for package in ("gradsafe", "gradsafe.pipelining", "gradsafe.dtensor", "gradsafe.wgrad"):
        assert names[package], package
    assert not [m for m in names if any(part.startswith("_") for part in m.split("."))]
    text = (ROOT / "docs" / "api.md").read_text()
    for module, public in names.items():
        for name in public:
            assert f"### `{module}.{name}`" in text, f"{module}.{name}"


def test_every_public_name_appears_in_a_user_page() -> None:
    text = "\n".join(_user_pages().values())
    missing = [
        f"{module}.{name}"
        for module, public in _tool("api_reference").public_names().items()
        for name in public
        if not re.search(rf"\b{re.escape(name)}\b", text)
    ]
    assert not missing, f"public names no page of README.md or docs/ mentions: {missing}"


def test_every_status_entry_is_a_patch_name_or_a_documented_testing_patch() -> None:
    import gradsafe

    readme = (ROOT / "README.md").read_text()
    for state in gradsafe.status().patches:
        assert state.testing == (state.name not in gradsafe.patch_names()), state.name
        if state.testing:
            assert f"`{state.name}`" in readme, state.name


@pytest.mark.parametrize("tool", ["compat_table.py", "api_reference.py"])
def test_tools_print_their_usage_on_a_usage_error(tool: str) -> None:
    args = [] if tool == "compat_table.py" else ["--bogus"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / tool), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"usage: python tools/{tool}"), proc.stderr
