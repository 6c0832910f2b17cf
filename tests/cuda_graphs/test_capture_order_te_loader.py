"""The H5 doctor row runs TransformerEngine's own graph.py where it is installed (issue 23, item 4).

TransformerEngine is not installed here and needs a GPU, so these tests put a
fake ``transformer_engine`` package on ``sys.path`` (written by the test into
a temporary directory) and check the loader's wiring: the doctor finds it
through the import system, graphs one delayed-wgrad ``Linear`` per chunk with
its ``make_graphed_callables(_order=...)`` and reports what that raised. What
TransformerEngine itself does with the order is checked against its source by
the model (``te_capture``) in ``test_capture_order.py``, not here.
"""

from __future__ import annotations

import pathlib
import sys
import textwrap
from collections.abc import Iterator

import pytest

from gradsafe.cuda_graphs import _capture_order_hazards as h5

_INIT = '__version__ = "0.0+fake"\n'
_PYTORCH = """
import torch

class Linear(torch.nn.Linear):
    def __init__(self, in_features, out_features, *, delay_wgrad_compute=False, device=None):
        super().__init__(in_features, out_features, device=device)
        self.delay_wgrad_compute = delay_wgrad_compute
"""
_GRAPH = """
CALLS = []

def make_graphed_callables(modules, sample_args, *, _order=None, _num_layers_per_chunk=None):
    CALLS.append((modules, sample_args, _order, _num_layers_per_chunk))
    raise {error}
"""


@pytest.fixture
def fake_te(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[pathlib.Path]:
    """Writes a fake package and makes it importable; forgets every module it loaded afterwards."""
    package = tmp_path / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text(_INIT)
    (package / "pytorch" / "__init__.py").write_text(textwrap.dedent(_PYTORCH))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(h5, "_te_device", lambda: "cpu")
    yield package
    for name in [
        n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")
    ]:
        del sys.modules[name]


def _graph_raising(package: pathlib.Path, error: str) -> None:
    (package / "pytorch" / "graph.py").write_text(textwrap.dedent(_GRAPH.format(error=error)))


def test_installed_te_is_run_and_its_capture_failure_reported(fake_te: pathlib.Path) -> None:
    _graph_raising(
        fake_te, 'RuntimeError("This CUDAGraph instance already owns a captured graph (fake)")'
    )
    outcome = h5._upstream()
    assert outcome.correct is False
    assert (
        "accepted [1, 1, -1, -1, -1.5, -1.5] (count check), then capture failed" in outcome.detail
    )
    assert "already owns a captured graph (fake)" in outcome.detail
    assert "TransformerEngine 0.0+fake" in outcome.detail and str(fake_te) in outcome.detail
    graph = sys.modules["transformer_engine.pytorch.graph"]
    ((modules, sample_args, order, layers),) = graph.CALLS
    assert order == list(h5.WRONG_TE_ORDER) and layers == [1]
    assert len(modules) == 1 and modules[0].delay_wgrad_compute
    assert len(sample_args) == 2 and all(a[0].requires_grad for a in sample_args)


def test_installed_te_count_check_refusal_is_reported_as_up_front(fake_te: pathlib.Path) -> None:
    _graph_raising(
        fake_te,
        'RuntimeError("Number of wgrad graph(1) doesn\'t match number of dgrad graphs (2) for chunk -1.")',
    )
    outcome = h5._upstream()
    assert outcome.correct is True
    assert outcome.detail.startswith(
        "refused [1, 1, -1, -1, -1.5, -1.5] up front: RuntimeError: Number of wgrad"
    )


def test_installed_te_without_a_gpu_falls_back_to_the_model(
    fake_te: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _graph_raising(fake_te, 'AssertionError("must not be called")')
    monkeypatch.setattr(h5, "_te_device", lambda: None)
    outcome = h5._upstream()
    assert (
        "modelled from graph.py; TransformerEngine installed, no GPU to run it on" in outcome.detail
    )
    assert (
        f"then capture failed at position 5: RuntimeError: {h5.ALREADY_CAPTURED.rstrip('.')};"
        in outcome.detail
    )
    assert sys.modules["transformer_engine.pytorch.graph"].CALLS == []


def test_broken_te_install_is_reported_and_modelled(fake_te: pathlib.Path) -> None:
    _graph_raising(fake_te, "RuntimeError('unused')")
    (fake_te / "pytorch" / "graph.py").write_text(
        "raise ImportError('libtransformer_engine.so: cannot open')\n"
    )
    outcome = h5._upstream()
    assert (
        "installed but not importable (ImportError: libtransformer_engine.so: cannot open)"
        in outcome.detail
    )
    assert "modelled from graph.py" in outcome.detail and outcome.correct is False


def test_absent_te_is_modelled() -> None:
    assert h5.load_te_graph() is None  # not installed on gradsafe's CI machines
    outcome = h5._upstream()
    assert outcome.detail.endswith("(modelled from graph.py; TransformerEngine not installed)")
