"""``verify(memory=True)`` / ``gradsafe verify --memory``: peak live tensor memory per run, on CPU."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from gradsafe.__main__ import main
from gradsafe.verify import verify

_F64 = 8


def _peaks(module: nn.Module, batch: int, dim: int, count: int) -> dict[str, dict[str, int]]:
    generator = torch.Generator().manual_seed(5)
    microbatches = [(torch.randn(batch, dim, generator=generator),) for _ in range(count)]
    report = verify(module, microbatches, memory=True, orders=("w-after-b", "w-reversed"))
    assert report.ok, str(report)
    assert report.memory is not None
    return {impl: {o: m.peak_bytes for o, m in per.items()} for impl, per in report.memory.items()}


def _mlp(dim: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))


def test_every_run_holds_at_least_the_parameter_gradients_it_returns() -> None:
    module = _mlp(32)
    grads = sum(p.numel() for p in module.parameters()) * _F64
    peaks = _peaks(module, batch=4, dim=32, count=2)
    assert set(peaks) == {"fused", "gradsafe", "upstream"}
    assert set(peaks["gradsafe"]) == set(peaks["upstream"]) == {"w-after-b", "w-reversed"}
    assert all(peak >= grads for per in peaks.values() for peak in per.values()), peaks


def test_a_weight_dominated_stage_shows_the_split_holding_more_than_fused() -> None:
    # Weight gradients dwarf the activations (batch 2, 256x256 weights): a
    # split's W holds a weight-sized gradient beside the accumulated one.
    peaks = _peaks(_mlp(256), batch=2, dim=256, count=3)
    fused = peaks["fused"]["fused"]
    for impl in ("gradsafe", "upstream"):
        for order, peak in peaks[impl].items():
            assert peak > fused, (impl, order, peaks)


def test_all_b_before_w_keeps_every_microbatchs_activations_alive() -> None:
    # Activations dwarf the weights: with every B before any W, each further
    # microbatch adds its saved activations to the peak; fused frees them.
    batch, dim = 1024, 8
    activation = batch * dim * _F64
    two, four = (_peaks(_mlp(dim), batch, dim, count) for count in (2, 4))
    per_fused = (four["fused"]["fused"] - two["fused"]["fused"]) / 2
    for impl in ("gradsafe", "upstream"):
        per_reversed = (four[impl]["w-reversed"] - two[impl]["w-reversed"]) / 2
        per_after = (four[impl]["w-after-b"] - two[impl]["w-after-b"]) / 2
        assert per_reversed >= per_fused + 2 * activation, (impl, two, four)
        assert per_reversed >= per_after + 2 * activation, (impl, two, four)


def test_cli_memory_prints_the_table_and_the_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "_factories:param_only_output", "--memory"]) == 0
    out, _ = capsys.readouterr()
    assert "Peak live tensor memory (MiB, x fused):" in out
    assert main(["verify", "_factories:param_only_output", "--memory", "--json"]) == 0
    memory = json.loads(capsys.readouterr()[0])["memory"]
    assert memory["fused"]["fused"]["peak_bytes"] > 0
    assert set(memory["gradsafe"]) == {"w-after-b", "w-reversed", "w-lag-3"}


def test_memory_and_time_together_count_in_runs_of_their_own(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["verify", "_factories:param_only_output", "--memory", "--time"]) == 0
    out, err = capsys.readouterr()
    assert "Backward time" in out and "Peak live tensor memory" in out
    # warm-up, reference twice, 2 x 3 checked runs, then the fused and 2 x 3 counted runs
    assert err.count("verify: ") == 3 + 6 + 1 + 6


def test_verify_keeps_no_graph_alive_so_the_splits_compare_as_a_schedule_runs_them() -> None:
    # verify's hook counting once kept every graph node of a run alive, so
    # saved tensors torch's W frees (it runs without retain_graph) stayed
    # counted while gradsafe's, freed when the graph is dropped, did too.
    torch.manual_seed(0)
    module = nn.Sequential(
        *(m for _ in range(4) for m in (nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)))
    )
    peaks = _peaks(module, batch=16, dim=32, count=4)
    for order, peak in peaks["gradsafe"].items():
        assert peak <= peaks["upstream"][order], (order, peaks)


@pytest.mark.cuda
def test_memory_of_a_cuda_model_is_refused_not_undercounted() -> None:
    # The dispatch-mode count sees the calling thread; a CUDA backward runs on
    # autograd's device thread.
    module = nn.Linear(4, 4).cuda()
    with pytest.raises(ValueError, match="device thread of its own"):
        verify(module, [torch.randn(2, 4, device="cuda")], memory=True)
