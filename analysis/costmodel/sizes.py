"""Unit sizes — the cost model's view of the model.

Input: a model (any device, `meta` included) and its units (`UnitSpec`s from
`find_units`, root first). Output: one `shardc.lowering.UnitSize` per unit (trainable
and frozen element counts plus the unit's resolved scopes), the input of
`shardc.lowering.lower`, which owns padding, factors and rows. Nothing here allocates
or touches parameter data.
"""
from __future__ import annotations

from shardc.lowering import UnitSize, padded
from shardc.lowering import unit_sizes as count_units

__all__ = ["UnitSize", "padded", "unit_sizes"]


def unit_sizes(model, units) -> list[UnitSize]:
    """Sizes of `units` (UnitSpecs, root first) read from `model`'s parameters.

    Parameters are looked up by canonical FQN (tied aliases are excluded by the unit
    finder, so each element is counted once); only `numel()` and `requires_grad` are
    read, so a meta-device model works.
    """
    return count_units(dict(model.named_parameters()), units)
