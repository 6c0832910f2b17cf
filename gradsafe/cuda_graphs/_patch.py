"""The ``cuda_graphs`` patch: every slot it replaces, listed in one place."""

from __future__ import annotations

from gradsafe.patching import AttrTarget, Patch, Target


def _plan() -> list[Target]:
    from gradsafe.cuda_graphs import make_graphed_callables

    # torch.cuda re-exports the function from torch.cuda.graphs; users call
    # either name, so both point at gradsafe's while patched.
    return [
        AttrTarget("torch.cuda", "make_graphed_callables", make_graphed_callables),
        AttrTarget("torch.cuda.graphs", "make_graphed_callables", make_graphed_callables),
    ]


PATCH = Patch(
    name="cuda_graphs",
    summary="make_graphed_callables returns owned gradients instead of CUDA-graph static buffers (H3)",
    plan=_plan,
)
