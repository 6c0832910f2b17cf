"""Names 0.2.0 renamed without an alias keep working, with a DeprecationWarning (CHANGELOG.md)."""

from __future__ import annotations

import pytest
import torch

import gradsafe.wgrad
from gradsafe.wgrad import WeightGradClosure, wgrad_return


def test_wgrad_return_accepts_the_0_1_keyword_with_a_deprecation_warning() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    wgrad = torch.full((3,), 2.0)
    with pytest.warns(DeprecationWarning, match="renamed accumulate_into_main_grad="):
        got = wgrad_return(weight, wgrad, accumulated_into_main_grad=False, delayed=False)
    assert got is wgrad
    with pytest.warns(DeprecationWarning):
        assert wgrad_return(weight, None, accumulated_into_main_grad=False, delayed=True) is None


def test_wgrad_return_refuses_the_old_and_new_keyword_together() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(TypeError, match="pass only accumulate_into_main_grad="):
        wgrad_return(
            weight,
            None,
            accumulate_into_main_grad=True,
            accumulated_into_main_grad=True,
            delayed=True,
        )


def test_wgrad_closure_old_name_is_the_new_one_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match="renamed WeightGradClosure"):
        old = gradsafe.wgrad.WgradClosure  # type: ignore[attr-defined]
    assert old is WeightGradClosure
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        gradsafe.wgrad.NoSuchName  # type: ignore[attr-defined]  # noqa: B018


def test_every_deprecation_warning_names_the_same_removal_release() -> None:
    import importlib
    import sys
    import warnings

    import gradsafe.pipelining
    from gradsafe._shared.deprecation import REMOVED_IN

    weight = torch.nn.Parameter(torch.ones(3))
    sys.modules.pop("gradsafe.testing.megatron", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gradsafe.wgrad.WgradClosure  # type: ignore[attr-defined]  # noqa: B018
        wgrad_return(weight, None, accumulated_into_main_grad=False, delayed=True)
        for name in ("verify", "ORDERS", "VerifyReport"):
            getattr(gradsafe.pipelining, name)
        importlib.import_module("gradsafe.testing.megatron")
    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
    assert len(messages) == 6
    for message in messages:
        assert f"removed in gradsafe {REMOVED_IN}" in message, message
        assert "next release" not in message and "one minor release" not in message
