"""The pipelining patch's probe of how torch's stage calls the split functions.

Each test hands the probe a stage module altered in one way and checks that
the patch becomes a skip naming what differed, decided at patch time.
"""

from __future__ import annotations

import re
import types

import pytest
import torch.distributed.pipelining._backward as torch_backward
import torch.distributed.pipelining.stage as torch_stage

from gradsafe.patching import Skip
from gradsafe.pipelining import _patch

# The newest torch on the registry runs these first (noxfile.py's newest session).
pytestmark = pytest.mark.smoke


def _stage(source: str, *, imported: bool = True) -> types.ModuleType:
    """A module whose source is ``source`` and which imports torch's three functions by name."""
    module = types.ModuleType("fake_stage")
    if imported:
        for name in ("stage_backward", "stage_backward_input", "stage_backward_weight"):
            setattr(module, name, getattr(torch_backward, name))
    module.__source__ = source  # type: ignore[attr-defined]
    return module


@pytest.fixture(autouse=True)
def _read_fake_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _patch.inspect.getsource

    def getsource(obj: object) -> str:
        return getattr(obj, "__source__", None) or real(obj)  # type: ignore[arg-type]

    monkeypatch.setattr(_patch.inspect, "getsource", getsource)


_CALLS = """
def backward(self, kw, last):
    full = stage_backward(kw["out"], kw["grads"], kw["inputs"])
    b = stage_backward_input(kw["out"], kw["grads"], kw["inputs"], self.submod.parameters())
    w = stage_backward_weight(self.submod.parameters(), kw["param_groups"])
"""


def test_installed_torch_call_sites_are_accepted() -> None:
    assert _patch._call_site_mismatch(torch_stage, torch_backward) is None
    assert not isinstance(_patch.plan(), Skip)


def test_matching_stage_is_accepted() -> None:
    assert _patch._call_site_mismatch(_stage(_CALLS), torch_backward) is None


@pytest.mark.parametrize(
    "altered, message",
    [
        (
            _CALLS.replace('kw["param_groups"])', 'kw["param_groups"], True, "extra")'),
            "calls stage_backward_weight with 4 positional argument",
        ),
        (
            _CALLS.replace("self.submod.parameters())", 'self.submod.parameters(), grad_mode="x")'),
            r"keywords \['grad_mode'\]",
        ),
        (
            _CALLS.replace(
                'stage_backward_weight(self.submod.parameters(), kw["param_groups"])',
                'stage_backward_weight(*kw["args"])',
            ),
            "with \\*args/\\*\\*kwargs",
        ),
        (
            _CALLS.replace("stage_backward_input(", "torch_backward_input("),
            "no longer calls stage_backward_input",
        ),
    ],
    ids=["extra positional", "unknown keyword", "starred call", "call moved"],
)
def test_changed_call_site_is_a_skip_with_the_reason(altered: str, message: str) -> None:
    mismatch = _patch._call_site_mismatch(_stage(altered), torch_backward)
    assert mismatch is not None
    assert re.search(message, mismatch), mismatch


def test_stage_that_stops_importing_by_name_is_a_skip() -> None:
    stage = _stage(_CALLS)
    stage.stage_backward_weight = lambda *a: None  # type: ignore[attr-defined]  # a wrapper
    mismatch = _patch._call_site_mismatch(stage, torch_backward)
    assert mismatch is not None and "no longer imports it by name" in mismatch


def test_unreadable_source_is_a_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_source(obj: object) -> str:
        raise OSError("could not get source code")

    monkeypatch.setattr(_patch.inspect, "getsource", no_source)
    mismatch = _patch._call_site_mismatch(_stage(_CALLS), torch_backward)
    assert mismatch is not None and "cannot read" in mismatch


def test_direct_call_on_a_torch_lacking_a_feature_refuses_before_any_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from gradsafe.pipelining import SplitBackwardError, _refusals, stage_backward_input

    monkeypatch.setattr(
        _refusals, "_missing_feature", lambda: "autograd nodes have no _input_metadata"
    )
    w = torch.ones(2, requires_grad=True)
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(
        SplitBackwardError, match=re.escape(f"torch {torch.__version__}: autograd nodes")
    ):
        stage_backward_input([x * w], [torch.ones(2)], [x], [w])
    assert x.grad is None and w.grad is None


def test_inference_wrappers_follow_the_methods_torch_defines() -> None:
    # H6: whichever of torch's inference methods exist are wrapped, found by
    # probing the classes (2.13+: schedule-wide, per stage, _to_tensor; 2.11:
    # _shape_inference), and nothing else of the stage is touched.
    import types

    import torch.distributed.pipelining.schedules as schedules
    import torch.distributed.pipelining.stage as stage

    from gradsafe.pipelining import _patch

    wrapped = {t.where.rsplit(".", 1)[1] for t in _patch._inference_targets(stage, schedules)}
    defined = set(vars(stage.PipelineStage)) | set(vars(schedules._PipelineSchedule))
    candidates = {
        "_initialize_pp_stages",
        "_forward_metadata_inference",
        "_backward_metadata_inference",
        "_shape_inference",
        "_to_tensor",
    }
    assert wrapped == candidates & defined and wrapped

    bare = types.SimpleNamespace(
        PipelineStage=type("PipelineStage", (), {}),
    )
    no_schedule = types.SimpleNamespace(_PipelineSchedule=type("_PipelineSchedule", (), {}))
    assert _patch._inference_targets(bare, no_schedule) == []


def test_an_engine_that_cannot_spare_parameters_is_a_missing_feature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gradsafe.pipelining import _torch

    assert _torch.missing_feature() is None
    monkeypatch.setattr(_torch._engine, "_unspared_inputs", lambda roots, inputs, spared: None)
    assert "still reaches the parameter" in (_torch.missing_feature() or "")
