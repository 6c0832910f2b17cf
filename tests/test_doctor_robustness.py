"""The doctor's promises (gradsafe/doctor.py, docs/architecture.md "The doctor")."""

from __future__ import annotations

import pytest

from gradsafe import doctor
from gradsafe.patching import PatchRegistry


def test_a_probe_that_raises_is_reported_not_raised(
    monkeypatch: pytest.MonkeyPatch, fresh_registry: PatchRegistry
) -> None:
    # The doctor promises "exceptions are caught and reported, never raised".
    # A plan() failing with something other than ImportError/AttributeError
    # (a changed torch internal raising RuntimeError) made the whole doctor
    # die with a traceback in _plans(), after every row had already run.
    import gradsafe.cuda_graphs._patch as cuda_graphs_patch

    def changed_internal() -> None:
        raise RuntimeError("probe hit a changed torch internal")

    monkeypatch.setattr(cuda_graphs_patch, "plan", changed_internal)
    report = doctor.run(["cuda_graphs"])
    assert not report.ok
    plan = next(p for p in report.patches if p.name == "cuda_graphs")
    assert plan.skipped is not None and "changed torch internal" in plan.skipped
    assert "changed torch internal" in report.render()


def test_table_fits_an_80_column_terminal() -> None:
    # render(width) cuts cells, the hazard column included, to fit the terminal.
    report = doctor.run(["cuda_graphs"])
    table = report.render(80).splitlines()[2:6]
    assert max(len(line) for line in table) <= 80
