"""The ``cuda_graphs`` patch: every slot it replaces, listed in one place (``plan()``)."""

from __future__ import annotations

from gradsafe.patching import AttrTarget, Target

__all__ = ["plan"]


def plan() -> list[Target]:
    from gradsafe.cuda_graphs import _te
    from gradsafe.cuda_graphs._graphed import make_graphed_callables

    # torch.cuda re-exports the function from torch.cuda.graphs; users call
    # either name, so both point at gradsafe's while patched. TransformerEngine's
    # own make_graphed_callables, where installed, is wrapped too (_te.py).
    return [
        AttrTarget("torch.cuda", "make_graphed_callables", make_graphed_callables),
        AttrTarget("torch.cuda.graphs", "make_graphed_callables", make_graphed_callables),
        *_te.plan(),
    ]
