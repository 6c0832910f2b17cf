"""2.11 + gradsafe == 2.13 for new_empty / new_empty_strided, op by op (and what differs, on purpose).

``TORCH_2_13`` was recorded on torch 2.13.0 (``python tests/dtensor/dtensor_factory_ops.py``;
2.15.0 prints the same). With ``gradsafe.patch("dtensor")`` every placement
gradsafe keeps (Shard, Replicate, and Partial of the reduce ops the installed
torch can accumulate into) behaves exactly as recorded: same placements, same
collectives, same local values, same ops raising. Where gradsafe does not
keep a placement (Partial(max)/Partial(min) on torch 2.11), the behaviour is
the unpatched torch's. Note what 2.13 itself does: an empty tensor made from
a Partial one is Partial, so a value written into it (``fill_(1)``) is
reduced over ranks when read (``fill_(1)`` then reads world_size for sum),
and random fills raise.
"""

from __future__ import annotations

import pytest
from dtensor_factory_ops import FACTORIES, OPS, PLACEMENTS, behaviour
from dtensor_gradcases import kept_by

import gradsafe

# torch 2.13.0+cpu, rank 0 of a fake process group of 4 (placement, op) ->
# (empty tensor's placements, result's placements, collectives, result's local values)
TORCH_2_13 = {
    ("P(sum)", "fill_(1)"): (
        "[Partial(sum)]",
        "[Partial(sum)]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("P(sum)", "zero_()"): (
        "[Partial(sum)]",
        "[Partial(sum)]",
        0,
        (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
    ),
    ("P(sum)", "zero_().add_(R ones)"): (
        "[Partial(sum)]",
        "[Partial(sum)]",
        0,
        (0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25),
    ),
    ("P(sum)", "zero_().add_(x)"): (
        "[Partial(sum)]",
        "[Partial(sum)]",
        0,
        (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0),
    ),
    ("P(sum)", "normal_()"): "raises",
    ("P(sum)", "uniform_()"): "raises",
    ("P(sum)", "copy_(x)"): (
        "[Partial(sum)]",
        "[Partial(sum)]",
        0,
        (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0),
    ),
    ("P(sum)", "copy_(R ones)"): (
        "[Partial(sum)]",
        "[Partial(sum)]",
        0,
        (0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25),
    ),
    ("P(sum)", "copy_(x).mul_(2)"): (
        "[Partial(sum)]",
        "[Partial(sum)]",
        0,
        (2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0),
    ),
    ("P(sum)", "zero_() + 1"): (
        "[Partial(sum)]",
        "[Replicate()]",
        1,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("P(avg)", "fill_(1)"): (
        "[Partial(avg)]",
        "[Partial(avg)]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("P(avg)", "zero_()"): (
        "[Partial(avg)]",
        "[Partial(avg)]",
        0,
        (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
    ),
    ("P(avg)", "zero_().add_(R ones)"): (
        "[Partial(avg)]",
        "[Partial(avg)]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("P(avg)", "zero_().add_(x)"): (
        "[Partial(avg)]",
        "[Partial(avg)]",
        0,
        (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0),
    ),
    ("P(avg)", "normal_()"): "raises",
    ("P(avg)", "uniform_()"): "raises",
    ("P(avg)", "copy_(x)"): (
        "[Partial(avg)]",
        "[Partial(avg)]",
        0,
        (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0),
    ),
    ("P(avg)", "copy_(R ones)"): (
        "[Partial(avg)]",
        "[Partial(avg)]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("P(avg)", "copy_(x).mul_(2)"): (
        "[Partial(avg)]",
        "[Partial(avg)]",
        0,
        (2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0),
    ),
    ("P(avg)", "zero_() + 1"): (
        "[Partial(avg)]",
        "[Replicate()]",
        1,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("P(max)", "fill_(1)"): (
        "[Partial(max)]",
        "[Partial(max)]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("P(max)", "zero_()"): (
        "[Partial(max)]",
        "[Partial(max)]",
        0,
        (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
    ),
    ("P(max)", "zero_().add_(R ones)"): (
        "[Partial(max)]",
        "[Partial(max)]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("P(max)", "zero_().add_(x)"): (
        "[Partial(max)]",
        "[Partial(max)]",
        1,
        (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0),
    ),
    ("P(max)", "normal_()"): "raises",
    ("P(max)", "uniform_()"): "raises",
    ("P(max)", "copy_(x)"): (
        "[Partial(max)]",
        "[Partial(max)]",
        0,
        (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0),
    ),
    ("P(max)", "copy_(R ones)"): (
        "[Partial(max)]",
        "[Partial(max)]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("P(max)", "copy_(x).mul_(2)"): "raises",
    ("P(max)", "zero_() + 1"): (
        "[Partial(max)]",
        "[Replicate()]",
        1,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("P(min)", "fill_(1)"): (
        "[Partial(min)]",
        "[Partial(min)]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("P(min)", "zero_()"): (
        "[Partial(min)]",
        "[Partial(min)]",
        0,
        (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
    ),
    ("P(min)", "zero_().add_(R ones)"): (
        "[Partial(min)]",
        "[Partial(min)]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("P(min)", "zero_().add_(x)"): (
        "[Partial(min)]",
        "[Partial(min)]",
        1,
        (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0),
    ),
    ("P(min)", "normal_()"): "raises",
    ("P(min)", "uniform_()"): "raises",
    ("P(min)", "copy_(x)"): (
        "[Partial(min)]",
        "[Partial(min)]",
        0,
        (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0),
    ),
    ("P(min)", "copy_(R ones)"): (
        "[Partial(min)]",
        "[Partial(min)]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("P(min)", "copy_(x).mul_(2)"): "raises",
    ("P(min)", "zero_() + 1"): (
        "[Partial(min)]",
        "[Replicate()]",
        1,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("S(0)", "fill_(1)"): (
        "[Shard(dim=0)]",
        "[Shard(dim=0)]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("S(0)", "zero_()"): (
        "[Shard(dim=0)]",
        "[Shard(dim=0)]",
        0,
        (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
    ),
    ("S(0)", "zero_().add_(R ones)"): (
        "[Shard(dim=0)]",
        "[Shard(dim=0)]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("S(0)", "zero_().add_(x)"): (
        "[Shard(dim=0)]",
        "[Shard(dim=0)]",
        0,
        (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0),
    ),
    ("S(0)", "normal_()"): ("[Shard(dim=0)]", "[Shard(dim=0)]", 0, None),
    ("S(0)", "uniform_()"): ("[Shard(dim=0)]", "[Shard(dim=0)]", 0, None),
    ("S(0)", "copy_(x)"): (
        "[Shard(dim=0)]",
        "[Shard(dim=0)]",
        0,
        (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0),
    ),
    ("S(0)", "copy_(R ones)"): (
        "[Shard(dim=0)]",
        "[Shard(dim=0)]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("S(0)", "copy_(x).mul_(2)"): (
        "[Shard(dim=0)]",
        "[Shard(dim=0)]",
        0,
        (2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0),
    ),
    ("S(0)", "zero_() + 1"): (
        "[Shard(dim=0)]",
        "[Shard(dim=0)]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("R", "fill_(1)"): (
        "[Replicate()]",
        "[Replicate()]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("R", "zero_()"): (
        "[Replicate()]",
        "[Replicate()]",
        0,
        (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
    ),
    ("R", "zero_().add_(R ones)"): (
        "[Replicate()]",
        "[Replicate()]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("R", "zero_().add_(x)"): (
        "[Replicate()]",
        "[Replicate()]",
        0,
        (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0),
    ),
    ("R", "normal_()"): ("[Replicate()]", "[Replicate()]", 0, None),
    ("R", "uniform_()"): ("[Replicate()]", "[Replicate()]", 0, None),
    ("R", "copy_(x)"): (
        "[Replicate()]",
        "[Replicate()]",
        0,
        (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0),
    ),
    ("R", "copy_(R ones)"): (
        "[Replicate()]",
        "[Replicate()]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
    ("R", "copy_(x).mul_(2)"): (
        "[Replicate()]",
        "[Replicate()]",
        0,
        (2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0),
    ),
    ("R", "zero_() + 1"): (
        "[Replicate()]",
        "[Replicate()]",
        0,
        (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ),
}


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("factory", list(FACTORIES))
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_patched_factories_behave_as_recorded(
    fake_meshes, placement: str, factory: str, op: str
) -> None:
    mesh = fake_meshes[1]
    with gradsafe.patch("dtensor"):
        got = behaviour(mesh, placement, factory, op)
    if kept_by((PLACEMENTS[placement],)):
        assert got == TORCH_2_13[(placement, op)]
    else:
        assert got == behaviour(mesh, placement, factory, op)


def test_recorded_empties_take_their_inputs_placements() -> None:
    """2.13's rule, as recorded: the empty tensor has its input's placements, Partial included."""
    for (placement, _op), recorded in TORCH_2_13.items():
        if recorded == "raises":
            continue
        made = recorded[0]
        assert made == str([PLACEMENTS[placement]])
