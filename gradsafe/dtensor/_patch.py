"""The ``dtensor`` patch: every slot it replaces, listed in one place (``plan()``).

Targets, decided when ``gradsafe.patch("dtensor")`` is applied:

* ``op_strategy_funcs[aten.new_empty_strided.default]`` and
  ``op_strategy_funcs[aten.new_empty.default]`` get
  :func:`~gradsafe.dtensor.empty_factory_strategy`;
* where the single-dim table also holds either op (it is consulted first),
  that entry is removed for as long as the patch is active, so the
  propagator reaches the strategy above.

Nothing is installed when a probe of the live propagator shows that upstream
already keeps placements through ``new_empty_strided`` + ``copy_``; the skip
reason then starts with "verified: upstream already keeps placements".
"""

from __future__ import annotations

from collections.abc import Sequence

from gradsafe.patching import MISSING, ItemTarget, Skip, Target

__all__ = ["after_change", "plan"]


def plan() -> Sequence[Target] | Skip:
    from gradsafe.dtensor import _torch
    from gradsafe.dtensor._probe import probe_propagator
    from gradsafe.dtensor._strategy import empty_factory_strategy

    found = probe_propagator()
    if found.copy_failures:
        return Skip(
            "the installed torch's copy_ strategy redistributes a Partial source into a "
            f"Partial destination ({'; '.join(found.copy_failures)}); gradsafe's "
            "new_empty_strided strategy cannot remove that all-reduce on this torch"
        )
    if found.keeps_placements:
        return Skip(
            "verified: upstream already keeps placements "
            "(probed new_empty(_strided) + copy_, Partial and Shard, 1-D and 2-D meshes)"
        )
    targets: list[Target] = []
    single_dim = _torch.single_dim_strategy_table()
    for op in _torch.EMPTY_FACTORIES:
        targets.append(
            ItemTarget(
                f"DTensor sharding propagator op_strategy_funcs[{op}]",
                _torch.op_strategy_table,
                op,
                empty_factory_strategy,
            )
        )
        if single_dim is not None and op in single_dim:
            targets.append(
                ItemTarget(
                    f"DTensor sharding propagator op_single_dim_strategy_funcs[{op}] "
                    "(removed: consulted before op_strategy_funcs)",
                    _torch.single_dim_strategy_table,  # type: ignore[arg-type]
                    op,
                    MISSING,
                )
            )
    return targets


def after_change() -> None:
    """Forget cached sharding decisions after applying and after restoring."""
    from gradsafe.dtensor._torch import clear_sharding_caches

    clear_sharding_caches()
