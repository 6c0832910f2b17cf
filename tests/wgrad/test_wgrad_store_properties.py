"""Property: any mix of uses, fusion, existing gradients and W order accumulates exactly."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsafe.wgrad import WeightGradStore

N_PARAMS = 3


@st.composite
def scenarios(draw):  # type: ignore[no-untyped-def]
    fused = [draw(st.booleans()) for _ in range(N_PARAMS)]
    preexisting_grad = [draw(st.booleans()) for _ in range(N_PARAMS)]
    # Each B pass: a list of param indices, one entry per use (repeats = tied weight).
    passes = draw(
        st.lists(st.lists(st.integers(0, N_PARAMS - 1), max_size=4), min_size=1, max_size=4)
    )
    run_order = draw(st.permutations(range(len(passes))))
    return fused, preexisting_grad, passes, run_order


@settings(max_examples=40, deadline=None)
@given(scenarios())
def test_store_accumulates_every_use_exactly_once(scenario) -> None:  # type: ignore[no-untyped-def]
    fused, preexisting_grad, passes, run_order = scenario
    store = WeightGradStore()
    params = [torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64)) for _ in range(N_PARAMS)]
    # What each parameter's gradient destination (main_grad if fused, else .grad) must hold.
    expected = [torch.zeros(2, 2, dtype=torch.float64) for _ in range(N_PARAMS)]
    fired: list[tuple[int, int]] = []  # (param index, pass index)
    running: list[int] = []
    for i, p in enumerate(params):
        p.main_grad = torch.zeros(2, 2, dtype=torch.float64)
        if preexisting_grad[i]:
            p.grad = torch.full((2, 2), 1.0, dtype=torch.float64)
            if not fused[i]:
                expected[i] += 1.0
        store.register_grad_ready_hook(p, lambda _p, i=i: fired.append((i, running[-1])))

    pending = []
    value = 1.0
    for uses in passes:
        for i in uses:
            contribution = torch.full((2, 2), value, dtype=torch.float64)
            value *= 2  # distinct powers of two: a lost or doubled use shows in the sum
            expected[i] += contribution

            def compute(main_grad, contribution=contribution):  # type: ignore[no-untyped-def]
                if main_grad is None:
                    return contribution.clone()
                main_grad.add_(contribution)
                return None

            store.record(params[i], compute, accumulate_into_main_grad=fused[i])
        pending.append(store.seal())
    for k in run_order:
        running.append(k)
        pending[k].run()

    zeros = torch.zeros(2, 2, dtype=torch.float64)
    for i, p in enumerate(params):
        grad = p.grad if p.grad is not None else zeros
        if fused[i]:
            torch.testing.assert_close(p.main_grad, expected[i])
            # .grad untouched (or the fresh zero W gives hooks): nothing added twice.
            torch.testing.assert_close(grad, zeros + (1.0 if preexisting_grad[i] else 0.0))
        else:
            torch.testing.assert_close(grad, expected[i])
            torch.testing.assert_close(p.main_grad, zeros)
    want_fired = sorted({(i, k) for k, uses in enumerate(passes) for i in uses})
    assert sorted(fired) == want_fired  # once per parameter per pass that used it
    assert len(fired) == len(set(fired))
