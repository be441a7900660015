"""Lower — stage 3 of the pipeline (Strategy + unit sizes -> **Lowering**).

Input: the strategy's mesh and `prefetch`, and its units in forward order (root first), each a
`UnitSize` (name, element counts, resolved scopes). Output: the `Lowering` every later
stage reads — per unit its factors and padded flat groups with their rows and bytes,
the clip rows and the forward/backward schedule, then the plan passes (`passes/`).
"""
from __future__ import annotations

from dataclasses import dataclass

from shardc.dsl.ir import Mesh, Scopes

from .ir import Lowering, UnitPlan
from .layout import factors, pad_multiple, padded
from .passes import run_plan_passes
from .rows import clip_rows, group_plan
from .schedule import schedule


@dataclass(frozen=True, slots=True)
class UnitSize:
    """Element counts of one unit (before padding) and its resolved scopes."""
    name: str
    trainable: int
    frozen: int
    scopes: Scopes
    root: bool = False


def unit_sizes(params, units) -> list[UnitSize]:
    """Sizes of `units` (name, params, scopes; root first): `params` maps each canonical
    FQN to a tensor-like object (`numel()`, `requires_grad`; a meta tensor will do)."""
    out = []
    for i, u in enumerate(units):
        trainable = sum(params[n].numel() for n in u.params if params[n].requires_grad)
        frozen = sum(params[n].numel() for n in u.params if not params[n].requires_grad)
        out.append(UnitSize(u.name, trainable, frozen, u.scopes, root=(i == 0)))
    return out


def lower_unit(mesh: Mesh, u: UnitSize) -> UnitPlan:
    sc = u.scopes
    f = factors(sc, mesh)
    groups = []
    for phi, trainable in ((u.trainable, True), (u.frozen, False)):
        if phi:
            n = padded(phi, pad_multiple(f, trainable))
            groups.append(group_plan(sc, f, mesh, phi, n, trainable, u.root))
    return UnitPlan(u.name, sc, f, tuple(groups), u.root)


def lower(mesh: Mesh, units, prefetch: int = 1, passes=None) -> Lowering:
    """The plan over `units` (UnitSizes, forward order, root first) on `mesh` with `prefetch`,
    rewritten by the plan passes named in `passes` (None: all of `passes.PLAN_PASSES`)."""
    plans = tuple(lower_unit(mesh, u) for u in units)
    clip = clip_rows(mesh, [p.scopes.optim.levels for p in plans
                                     if any(g.trainable for g in p.groups)])
    sched = schedule([p.gathered and bool(p.groups) for p in plans], prefetch)
    return run_plan_passes(Lowering(plans, clip, sched), passes)
