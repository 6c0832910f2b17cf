"""Owning-clone make_graphed_callables (not implemented yet)."""
