"""Lower — stage 3 of the pipeline (Strategy + unit sizes -> **Lowering**).

Input: the strategy's mesh and `prefetch`, and its units in forward order (root first), each a
`UnitSize` (name, element counts, resolved scopes). Output: the `Lowering` every later
stage reads — per unit its factors and padded flat groups with their rows and bytes,
the clip rows and the forward/backward schedule, then the plan passes (`passes/`).
"""
from __future__ import annotations

from dataclasses import dataclass

from shardc.dsl.ir import Mesh, Scopes

from .ir import ExpertGroup, Lowering, Over, Placement, UnitPlan
from .layout import factors, pad_multiple, padded
from .passes import run_plan_passes
from .rows import clip_rows, group_plan
from .placements import get as get_kind, kinds
from .scopes import expert_clip_levels, over_of
from .schedule import schedule


@dataclass(frozen=True, slots=True)
class UnitSize:
    """Element counts of one unit (before padding) and its resolved scopes; with an
    `experts` statement, the counts of its expert parameters apart (`experts` says where
    they go), and those of a registered placement kind's (`placed`: (Over, trainable,
    frozen) per kind, lowering/placements.py) — the dense counts then leave them out."""
    name: str
    trainable: int
    frozen: int
    scopes: Scopes
    root: bool = False
    expert_trainable: int = 0
    expert_frozen: int = 0
    experts: ExpertGroup | None = None
    placed: tuple[tuple[Over, int, int], ...] = ()


def unit_sizes(params, units, experts: ExpertGroup | None = None) -> list[UnitSize]:
    """Sizes of `units` (name, params, scopes; root first): `params` maps each canonical
    FQN to a tensor-like object (`numel()`, `requires_grad`; a meta tensor will do), each
    an expert's local shard where `experts` names it (`is_expert`)."""
    out = []
    for i, u in enumerate(units):
        over = {n: over_of(experts, n, params[n]) for n in u.params}
        of = lambda o: [n for n in u.params if over[n] == o]
        count = lambda names, t: sum(params[n].numel() for n in names if params[n].requires_grad == t)
        dense, mine = of(Over.DENSE), of(Over.EXPERTS)
        placed = tuple((k.over, count(of(k.over), True), count(of(k.over), False)) for k in kinds()
                       if of(k.over))
        out.append(UnitSize(u.name, count(dense, True), count(dense, False), u.scopes, root=(i == 0),
                            expert_trainable=count(mine, True), expert_frozen=count(mine, False),
                            experts=experts if mine else None, placed=placed))
    return out


def placement(over: Over, mesh: Mesh, sc: Scopes) -> Placement:
    """The placement of a group over `mesh` (named `over`) with scopes `sc`."""
    return Placement(over, mesh, sc, factors(sc, mesh))


def _groups(pl: Placement, counts, root: bool):
    out = []
    for phi, trainable in counts:
        if phi:
            n = padded(phi, pad_multiple(pl.factors, trainable))
            out.append(group_plan(pl, phi, n, trainable, root))
    return out


def lower_unit(mesh: Mesh, u: UnitSize) -> UnitPlan:
    dense = placement(Over.DENSE, mesh, u.scopes)
    groups = _groups(dense, ((u.trainable, True), (u.frozen, False)), u.root)
    if u.experts is not None:
        e = u.experts
        groups += _groups(placement(Over.EXPERTS, e.mesh, e.scopes),
                          ((u.expert_trainable, True), (u.expert_frozen, False)), u.root)
    for over, trainable, frozen in u.placed:            # registered kinds (lowering/placements.py)
        k = get_kind(over)
        groups += _groups(placement(over, k.mesh(mesh), k.scopes(u.scopes)), ((trainable, True), (frozen, False)),
                          u.root)
    return UnitPlan(u.name, u.scopes, dense.factors, tuple(groups), u.root)


def _clip_levels(mesh: Mesh, p: UnitPlan, experts: ExpertGroup | None):
    """The level sets of the strategy's mesh whose clip all-reduce adds this unit's
    squared norms ([Note: clip rows of experts])."""
    overs = {g.placement.over: g.placement for g in p.groups if g.trainable}
    for over, pl in overs.items():
        if over != Over.EXPERTS:
            yield pl.scopes.optim.levels
    if experts is not None and Over.EXPERTS in overs:
        yield expert_clip_levels(mesh, experts)


def lower(mesh: Mesh, units, prefetch: int = 1, passes=None) -> Lowering:
    """The plan over `units` (UnitSizes, forward order, root first) on `mesh` with `prefetch`,
    rewritten by the plan passes named in `passes` (None: all of `passes.PLAN_PASSES`)."""
    plans = tuple(lower_unit(mesh, u) for u in units)
    clip = clip_rows(mesh, [lv for p, u in zip(plans, units) for lv in _clip_levels(mesh, p, u.experts)])
    sched = schedule([p.gathered and bool(p.groups) for p in plans], prefetch)
    return run_plan_passes(Lowering(plans, clip, sched), passes)
