"""examples/fused_linear.py: imported by path (it is not part of the package), run through the six configurations."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from gradsafe.testing import MegatronStyleDDP
from gradsafe.wgrad import WeightGradStore, grad_lifetime_is_managed
from gradsafe.wgrad._hazards import CONFIGS, Config, check_config, check_mixed, reference

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fused_linear.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fused_linear_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ref():  # type: ignore[no-untyped-def]
    return reference(microbatches=4)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_example_passes_the_six_configurations(example, config: Config, ref) -> None:  # type: ignore[no-untyped-def]
    assert check_config(config, ref=ref, kernel=example.fused_linear) == []


def test_example_keeps_mixed_uses(example) -> None:  # type: ignore[no-untyped-def]
    uses = ("autograd", "now/fused", "delayed/fused", "delayed/unfused", "now/unfused")
    assert check_mixed(uses, 4, kernel=example.fused_linear) == []


def test_example_module_matches_nn_linear(example) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    lin = example.FusedLinear(3, 4, dtype=torch.float64)
    ref = torch.nn.Linear(3, 4, bias=False, dtype=torch.float64)
    ref.weight.data.copy_(lin.weight.data)
    x = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    lin(x).pow(2).sum().backward()
    ref(x_ref).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)


def test_example_marks_delayed_weights_at_construction(example) -> None:  # type: ignore[no-untyped-def]
    assert grad_lifetime_is_managed(example.FusedLinear(2, 2, wgrad_store=WeightGradStore()).weight)
    assert not grad_lifetime_is_managed(example.FusedLinear(2, 2).weight)


def test_example_without_main_grad_names_the_fix(example) -> None:  # type: ignore[no-untyped-def]
    w = torch.nn.Parameter(torch.randn(2, 2))
    out = example.fused_linear(torch.randn(1, 2), w, accumulate_into_main_grad=True)
    with pytest.raises(RuntimeError, match="allocate weight.main_grad"):
        out.sum().backward()


def test_example_runs_as_a_script() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, check=True
    )
    lines = done.stdout.splitlines()
    errors = [float(line.rsplit("=", 1)[1]) for line in lines[:4]]
    assert len(errors) == 4 and max(errors) < 1e-12
    # the last line: gradsafe's split W runs the weight GEMMs (issue 29 item 3)
    assert len(lines) == 5 and float(lines[4].rsplit(" ", 1)[1]) > 0.45


def test_example_is_not_in_the_package() -> None:
    import gradsafe.wgrad

    assert not hasattr(gradsafe.wgrad, "FusedLinear") and not hasattr(
        gradsafe.wgrad, "fused_linear"
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_example_ties_a_delayed_weight_to_an_undelayed_module_under_megatron(  # type: ignore[no-untyped-def]
    example, overlap: bool
) -> None:
    # DDP hands its hook to every module holding the marked weight, the
    # undelayed one too: that one used to raise at DDP construction.
    store = WeightGradStore()
    delayed = example.FusedLinear(4, 4, wgrad_store=store, dtype=torch.float64)
    plain = example.FusedLinear(4, 4, dtype=torch.float64)
    plain.weight = delayed.weight
    MegatronStyleDDP(
        torch.nn.ModuleList([plain, delayed]), delay_wgrad_compute=True, overlap_grad_reduce=overlap
    )
    w = delayed.weight.detach().clone().requires_grad_()
    for _ in range(3):
        x = torch.randn(2, 4, dtype=torch.float64)
        delayed(torch.tanh(plain(x))).pow(2).sum().backward()
        store.seal().run()
        (torch.tanh(x @ w.t()) @ w.t()).pow(2).sum().backward()
    torch.testing.assert_close(delayed.weight.main_grad, w.grad)
    assert delayed.weight.grad is None
