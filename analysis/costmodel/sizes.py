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

from shardc.dsl.errors import ShardcError
from shardc.lowering import ExpertGroup, Over, UnitSize, is_expert, unit_sizes
from shardc.units import local_params

__all__ = ["UnitSize", "model_unit_sizes", "model_params", "dense_flops", "ep_local", "placed_params"]


def model_params(units) -> tuple[int, int]:
    """(the model's parameters, the experts among them), global: an expert parameter's
    count is one ep rank's part (`ep_local`) times ep; a registered kind's are whole."""
    experts = sum(sum(u.counts(Over.EXPERTS)) * (u.experts.ep if u.experts else 1) for u in units)
    placed = sum(t + f for u in units for o, t, f in u.placed if o != Over.EXPERTS)
    return sum(u.trainable + u.frozen for u in units) + placed + experts, experts


def dense_flops(units, tokens: int) -> int:
    """The 6·Φ·tokens rule (forward + backward of every parameter once per token): the
    FLOPs of one micro-batch when the model's graph was not traced (`flops.py` otherwise)."""
    return 6 * sum(u.trainable + u.frozen for u in units) * tokens


def model_unit_sizes(model, units, experts: ExpertGroup | None = None) -> list[UnitSize]:
    """Sizes of `units` (UnitSpecs, root first) read from `model`'s parameters.

    Parameters are looked up by canonical FQN (tied aliases are excluded by the unit
    finder, so each element is counted once); only `numel()` and `requires_grad` are
    read, so a meta-device model works. (`shardc.lowering.unit_sizes` does the counting,
    from a name -> parameter mapping.) With `experts` of ep > 1 each expert parameter
    counts as one ep rank's part: its dim 0 (the experts) split over the ep ranks, as
    DTensor `Shard(0)` on the ep dim places it (`ep_local`).
    """
    return unit_sizes(placed_params(model, experts), units, experts)


def placed_params(model, experts: ExpertGroup | None) -> dict:
    """Each parameter as one rank holds it once the experts are placed: `local_params` (a
    DTensor's local shard), and each expert parameter not yet placed (a plain tensor, as
    in a model built for `explain`, `plan` or `shardc compile`) cut to one ep rank's part
    (`ep_local`), so every stage sizes the units the runtime will shard."""
    local = local_params(model)
    if experts is None or experts.ep == 1:
        return local
    placed = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
    cut = ep_local({n: t for n, t in local.items() if n not in placed}, experts)
    return {n: cut.get(n, t) for n, t in local.items()}


def ep_local(params: dict, experts: ExpertGroup | None) -> dict:
    """`params` with each expert parameter (`is_expert`) replaced by a meta tensor of one ep
    rank's shape: dim 0 divided by ep; one sentence where it does not divide."""
    if experts is None or experts.ep == 1:
        return params
    out = dict(params)
    for name, p in params.items():
        if not is_expert(experts, name):
            continue
        if p.dim() == 0 or p.shape[0] % experts.ep:
            raise ShardcError(f"expert parameter {name!r} has shape {tuple(p.shape)}: ep {experts.ep} must divide "
                              f"its dim 0 (the experts), which DTensor Shard(0) on the ep dim splits")
        out[name] = torch.empty((p.shape[0] // experts.ep, *p.shape[1:]), device="meta").requires_grad_(
            p.requires_grad)
    return out
