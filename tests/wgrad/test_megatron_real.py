"""The docs/wgrad.md Megatron recipe under megatron-core's real DistributedDataParallel (optional).

Runs where megatron-core imports (it needs Python >= 3.12; CI's ``megatron``
nox session installs 0.19.2), skips with the reason elsewhere. Each gloo rank
(world size 1 and 2, ``_megatron_real_worker.py``) builds the example's
delayed ``FusedLinear`` (used twice per microbatch) plus a plain Linear, and
runs it side by side under real ``DistributedDataParallel``, under
:class:`gradsafe.testing.MegatronStyleDDP` (same switches, its ``main_grad``
reduced the way Megatron reduces) and under plain fp64 autograd, for two
steps of 1–4 microbatches with each W one microbatch behind
(B0 B1 W0 B2 W1 ... ; every pass but the last microbatch's inside
``no_sync``), over ``overlap_grad_reduce`` on/off, fp32/bf16 parameters,
``grad_reduce_in_fp32`` on/off and fused/unfused W; plus a weight tied across
two modules, and the recipe without ``delay_wgrad_compute``. Then the two
stages one ZBV rank holds (an embedding tied to the delayed head), three steps
of 3 microbatches in which the first stage's backward runs after the head's W.

CPU stand-ins the worker installs (Megatron's DDP is written for CUDA):
``torch.cuda.current_device`` returns ``"cpu"`` (the gradient buffers'
device) and ``torch.cuda.current_stream`` returns an object whose
``wait_event``/``wait_stream`` do nothing (``start_grad_sync`` waits on
CUDA-graph events, of which there are none). ``parallel_state`` is
initialised with tensor and pipeline parallel size 1 over the gloo world.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from _ranks import run_ranks

WORKER = Path(__file__).with_name("_megatron_real_worker.py")
pytestmark = pytest.mark.distributed

if importlib.util.find_spec("megatron") is None:
    pytest.skip(
        "megatron-core is not installed (it needs Python >= 3.12; the nox session `megatron` installs it)",
        allow_module_level=True,
    )

# Relative max error of main_grad against fp64 autograd. bf16 parameters compute
# forward and backward in bf16; the bug this guards against was 0.39.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    world = int(request.param)
    out = tmp_path_factory.mktemp(f"megatron{world}")
    results = run_ranks(WORKER, [str(world)], world, out, "megatron-core DDP", timeout=300)
    if "import_error" in results[0]:
        pytest.skip(f"megatron-core cannot be imported: {results[0]['import_error']}")
    for result in results:
        assert "crash" not in result, result["crash"]
    return results


def _cases(
    ranks: list[dict[str, Any]], *, delay: bool
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [
        (key, found) for result in ranks for key, found in result["cases"] if key["delay"] is delay
    ]


def test_recipe_is_exact_under_real_megatron_and_the_emulation_matches_it_bit_for_bit(
    ranks,
) -> None:  # type: ignore[no-untyped-def]
    cases = _cases(ranks, delay=True)
    assert len(cases) == len(ranks) * 68
    for key, found in cases:
        assert found["outcome"] == [("ok", "ok")] * 2, key
        assert max(found["real"]) <= TOLERANCE[key["dtype"]], (key, found["real"])
        assert found["real_vs_emu"] == [0.0, 0.0], key
        if not key["fused"]:  # the same arithmetic as plain autograd's wgrad, only later
            assert found["real_vs_undelayed"] == [0.0, 0.0], key
        want = torch.float32 if key["fp32_reduce"] else key["dtype"]
        assert found["dtypes"] == (want, want), key


def test_without_delay_wgrad_compute_both_refuse_alike(ranks) -> None:  # type: ignore[no-untyped-def]
    """Megatron then hooks AccumulateGrad: it asserts in B (overlap) or gradsafe's W refuses (unfused)."""
    for key, found in _cases(ranks, delay=False):
        real, emu = found["outcome"][0]
        if key["overlap"]:
            assert real.startswith("AssertionError: param.grad being None is not safe"), key
        elif not key["fused"]:
            assert real.startswith("RuntimeError: PendingWeightGrads.run: a delayed parameter"), key
        else:  # W adds into main_grad itself and B's hook sees nothing: still exact
            assert found["outcome"] == [("ok", "ok")] * 2 and max(found["real"]) <= 1e-5, key
        assert real.split(":")[0] == emu.split(":")[0] and real == emu, key


def test_zero_grad_buffer_and_zero_out_wgrad_match(ranks) -> None:  # type: ignore[no-untyped-def]
    for result in ranks:
        probes = result["probes"]
        assert probes["stale .grad kept"] == (True, True)
        real, emu = probes["zero_out_wgrad adds"]
        assert real == emu and real > 0
        # gradsafe's hook for an undelayed gradient no W awaits, inside Megatron's
        # CUDA-graph capture window: Megatron's hook returns at once, .grad stays.
        assert probes["capture window"] == (("ok", True, True), ("ok", True, True))


def test_a_tied_embedding_backward_after_the_heads_last_w_is_exact_under_real_megatron(
    ranks,
) -> None:  # type: ignore[no-untyped-def]
    """ZBV's order (last stage B, W, then the first stage's backward per microbatch) and W/F one behind.

    The last microbatch's embedding gradient reaches .grad after the head's
    last W: gradsafe fires DDP's hook for it, in the same place every step, so
    overlap_grad_reduce's ready counts (recorded in the first step) start the
    reduction after it in the next steps.
    """
    for result in ranks:
        assert len(result["tied_cases"]) == 8
        for key, found in result["tied_cases"]:
            assert found["outcome"] == [("ok", "ok")] * 3, key
            assert max(found["real"]) <= 1e-5, (key, found["real"])
            assert found["real_vs_emu"] == [0.0] * 3, key


def test_every_w_lifecycle_misuse_is_refused_before_main_grad_changes_under_real_megatron(
    ranks,
) -> None:  # type: ignore[no-untyped-def]
    """Issue 30, items 1-4, under guard_ddp_step, real DDP and MegatronStyleDDP alike.

    A W left for after finish_grad_sync, zero_grad_buffer() between the last B
    and its W, the last W forgotten (held) or dropped unrun: each refused by the
    reduction or zero_grad_buffer before it changes main_grad; running the W
    first then lets the reduction through.
    """
    for result in ranks:
        cases = result["lifecycle"]["items"]
        assert len(cases) == 5 * 8
        for key, found in cases:
            if key["item"] == "unguarded":
                continue
            where = (
                "zero_grad_buffer" if key["item"] == "zero_between_b_and_w" else "finish_grad_sync"
            )
            assert found["refusal"].startswith(f"RuntimeError: DDP.{where}(): delayed weight"), (
                key,
                found,
            )
            assert found["unchanged"], key
            if key["item"] != "dropped_w":
                assert found["after_fix"] == "ok", (key, found)


def test_a_w_after_the_reduction_is_what_the_guard_prevents(ranks) -> None:  # type: ignore[no-untyped-def]
    """Without the guard, the last W after finish_grad_sync: main_grad off and, at world 2, the ranks disagree."""
    for result in ranks:
        world = len(ranks)
        for key, found in result["lifecycle"]["items"]:
            if key["item"] != "unguarded":
                continue
            assert found["refusal"] == "ok", key
            if world == 1:  # nothing to reduce: the late W is still exact
                assert found["error"] < 1e-5, (key, found)
            else:
                assert found["error"] > 0.05 and found["ranks_disagree"] > 0.05, (key, found)


def test_a_module_with_two_delayed_parameters_is_refused_before_any_main_grad_changes(
    ranks,
) -> None:  # type: ignore[no-untyped-def]
    """Item 5: guard_ddp_step refuses the module; unguarded, the W pass refuses it before writing anything."""
    for result in ranks:
        cases = result["lifecycle"]["two_delayed"]
        assert len(cases) == 4
        for key, (guarded, at_w, untouched) in cases.items():
            assert guarded.startswith(
                "ValueError: guard_ddp_step: module (the model) (_TwoDelayed)"
            )
            assert at_w.startswith("RuntimeError: PendingWeightGrads.run: the delayed parameter"), (
                key,
                at_w,
            )
            assert untouched, key


def test_every_w_in_a_finalize_model_grads_func_wrapper_is_exact_in_megatrons_schedules(
    ranks,
) -> None:  # type: ignore[no-untyped-def]
    """docs/wgrad.md's recipe in forward_backward_no_pipelining and _without_interleaving; W after the schedule refused."""
    for result in ranks:
        cases = result["lifecycle"]["schedules"]
        assert len(cases) == 2 * 2 * 2 * 2
        for key, found in cases:
            if key["w_where"] == "finalize":
                assert found["outcome"] == ["ok", "ok"], (key, found)
                assert max(found["real"]) <= 1e-5, (key, found)
            else:
                assert found["outcome"][0].startswith(
                    "RuntimeError: DDP.finish_grad_sync(): delayed weight"
                ), (key, found)


def test_abandoning_a_step_with_a_dropped_w_recovers_under_real_megatron(ranks) -> None:  # type: ignore[no-untyped-def]
    """Issue 36 item 4: the documented recovery works with overlap_grad_reduce too (first step or later).

    Megatron's zero_grad_buffer() asserted on the first step's partial readiness
    counts, and the guard then refused every later reduction.
    """
    for result in ranks:
        cases = result["lifecycle"]["abandon"]
        assert len(cases) == 10
        for key, found in cases:
            assert found["refused"].startswith("RuntimeError: DDP.finish_grad_sync()"), (key, found)
            assert found["recovery"] == "ok", (key, found)
            # Each clean step (those before the abandoned one, and two after) exact.
            assert len(found["errors"]) == key["at_step"] + 2, (key, found)
            assert max(found["errors"]) <= 1e-5, (key, found)
