"""Unit sizes — the cost model's view of the model.

Input: a model (any device, `meta` included) and its units (`UnitSpec`s from
`find_units`, root first). Output: one `shardc.lowering.UnitSize` per unit (trainable
and frozen element counts plus the unit's resolved scopes), the input of
`shardc.lowering.lower`, which owns padding, factors and rows. Nothing here allocates
or touches parameter data.
"""
from __future__ import annotations

from shardc.lowering import UnitSize, unit_sizes

__all__ = ["UnitSize", "model_unit_sizes", "dense_flops"]


def dense_flops(units, tokens: int) -> int:
    """The 6·Φ·tokens rule (forward + backward of every parameter once per token): the
    FLOPs of one micro-batch when the model's graph was not traced (`flops.py` otherwise)."""
    return 6 * sum(u.trainable + u.frozen for u in units) * tokens


def model_unit_sizes(model, units) -> list[UnitSize]:
    """Sizes of `units` (UnitSpecs, root first) read from `model`'s parameters.

    Parameters are looked up by canonical FQN (tied aliases are excluded by the unit
    finder, so each element is counted once); only `numel()` and `requires_grad` are
    read, so a meta-device model works. (`shardc.lowering.unit_sizes` does the counting,
    from a name -> parameter mapping.)
    """
    return unit_sizes(dict(model.named_parameters()), units)
