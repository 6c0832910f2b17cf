"""``gradsafe.verify`` is a package of its own: pipelining does not load it, its old names still work."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

import gradsafe.pipelining
import gradsafe.verify


def _modules_after(statement: str) -> list[str]:
    """The gradsafe and torch modules a fresh interpreter has loaded after ``statement``."""
    code = (
        f"import sys; {statement}; "
        "print('\\n'.join(m for m in sys.modules if m.split('.')[0] in ('gradsafe', 'torch')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return done.stdout.split()


def test_importing_pipelining_loads_no_part_of_the_verify_tool() -> None:
    # pipelining does load gradsafe.wgrad (its split protocol: a kernel's weight
    # part recorded in B and run in W), but nothing of the tool built on it.
    loaded = _modules_after("import gradsafe.pipelining")
    assert "gradsafe.pipelining" in loaded
    assert [m for m in loaded if "verify" in m] == []


def test_importing_the_verify_package_and_the_command_line_loads_no_torch() -> None:
    loaded = _modules_after("import gradsafe.verify, gradsafe.__main__")
    assert "gradsafe.verify.cli" in loaded
    assert [m for m in loaded if m.split(".")[0] == "torch"] == []


@pytest.mark.parametrize("name", ["verify", "ORDERS", "VerifyReport"])
def test_the_moved_names_still_resolve_from_pipelining_with_a_warning_naming_the_new_import(
    name: str,
) -> None:
    with pytest.warns(DeprecationWarning, match=f"from gradsafe.verify import {name}"):
        moved = getattr(gradsafe.pipelining, name)
    assert moved is getattr(gradsafe.verify, name)


def test_the_moved_names_import_from_pipelining_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="gradsafe.pipelining.verify moved"):
        from gradsafe.pipelining import verify
    assert verify is gradsafe.verify.verify


def test_other_missing_names_of_pipelining_raise_attribute_error_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="has no attribute 'nonesuch'"):
            gradsafe.pipelining.nonesuch  # noqa: B018
        assert not hasattr(gradsafe.verify, "nonesuch")


def test_the_package_exports_what_its_all_lists() -> None:
    for name in gradsafe.verify.__all__:
        assert getattr(gradsafe.verify, name) is not None
