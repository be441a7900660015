"""Unit sizes — the cost model's view of the model.

Input: a model (any device, `meta` included) and its units (`UnitSpec`s from
`find_units`, root first). Output: one `shardc.lowering.UnitSize` per unit (trainable
and frozen element counts plus the unit's resolved scopes), the input of
`shardc.lowering.lower`, which owns padding, factors and rows. Nothing here allocates
or touches parameter data.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from shardc.lowering import Over, UnitSize, kind_for, unit_sizes
from shardc.lowering.placements import kinds as registered
from shardc.units import local_params

__all__ = ["UnitSize", "model_unit_sizes", "model_params", "dense_flops", "placed_params"]


def model_params(units) -> tuple[int, dict[Over, int]]:
    """(the model's parameters, those of each placement kind besides the units' own), global:
    a kind's count is one rank's part times the ranks it is split over (`parts`: the
    experts' ep; a registered kind's are whole)."""
    placed: dict[Over, int] = {}
    for u in units:
        for k, t, f in u.placed:
            placed[k.over] = placed.get(k.over, 0) + (t + f) * k.parts
    return sum(u.trainable + u.frozen for u in units) + sum(placed.values()), placed


def dense_flops(units, tokens: int) -> int:
    """The 6·Φ·tokens rule (forward + backward of every parameter once per token): the
    FLOPs of one micro-batch when the model's graph was not traced (`flops.py` otherwise)."""
    return 6 * sum(u.trainable + u.frozen for u in units) * tokens


def model_unit_sizes(model, units, kinds=None) -> list[UnitSize]:
    """Sizes of `units` (UnitSpecs, root first) read from `model`'s parameters.

    Parameters are looked up by canonical FQN (tied aliases are excluded by the unit
    finder, so each element is counted once); only `numel()` and `requires_grad` are
    read, so a meta-device model works. (`shardc.lowering.unit_sizes` does the counting,
    from a name -> parameter mapping.) `kinds`: the placement kinds
    (`shardc.lowering.kinds_of(strategy)`; None: the registered ones); a parameter a kind
    splits before placing it (an expert, with ep > 1) counts as one rank's part
    (`placed_params`).
    """
    kinds = registered() if kinds is None else tuple(kinds)
    return unit_sizes(placed_params(model, kinds), units, kinds)


def placed_params(model, kinds) -> dict:
    """Each parameter as one rank holds it once the model is placed: `local_params` (a
    DTensor's local shard), and each parameter of a kind not yet placed (a plain tensor, as
    in a model built for `explain`, `plan` or `shardc compile`) as a meta tensor of that
    kind's `local_shape` (an expert: dim 0 divided by ep), so every stage sizes the units
    the runtime will shard."""
    local = local_params(model)
    placed = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
    out = {}
    for n, t in local.items():
        k = kind_for(kinds, n, t) if n not in placed else None
        shape = tuple(t.shape) if k is None else k.local_shape(n, tuple(t.shape))
        out[n] = t if shape == tuple(t.shape) else torch.empty(shape, device="meta").requires_grad_(t.requires_grad)
    return out
