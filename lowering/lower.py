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
from .scopes import expert_clip_levels, expert_clip_weight, over_of
from .schedule import schedule


@dataclass(frozen=True, slots=True)
class UnitSize:
    """Element counts of one unit (before padding) and its resolved scopes: its own (dense)
    parameters', and apart those of each other placement (`placed`: (Over, trainable,
    frozen) per kind): with an `experts` statement its expert parameters' (`experts` says
    where they go), and a registered kind's (lowering/placements.py)."""
    name: str
    trainable: int
    frozen: int
    scopes: Scopes
    root: bool = False
    experts: ExpertGroup | None = None
    placed: tuple[tuple[Over, int, int], ...] = ()
    single: bool = False              # its dense trainable elements are one tensor (GroupPlan.whole_grad)

    def counts(self, over: Over) -> tuple[int, int]:
        """(trainable, frozen) elements placed by kind `over`."""
        if over == Over.DENSE:
            return self.trainable, self.frozen
        return next(((t, f) for o, t, f in self.placed if o == over), (0, 0))


def unit_sizes(params, units, experts: ExpertGroup | None = None) -> list[UnitSize]:
    """Sizes of `units` (name, params, scopes; root first): `params` maps each canonical
    FQN to a tensor-like object (`numel()`, `requires_grad`; a meta tensor will do), each
    an expert's local shard where `experts` names it (`is_expert`)."""
    out = []
    for i, u in enumerate(units):
        over = {n: over_of(experts, n, params[n]) for n in u.params}
        of = lambda o: [n for n in u.params if over[n] == o]
        count = lambda names, t: sum(params[n].numel() for n in names if params[n].requires_grad == t)
        dense = of(Over.DENSE)
        placed = tuple((o, count(of(o), True), count(of(o), False))
                       for o in (Over.EXPERTS, *(k.over for k in kinds())) if of(o))
        single = sum(1 for n in dense if params[n].requires_grad) == 1
        out.append(UnitSize(u.name, count(dense, True), count(dense, False), u.scopes, root=(i == 0),
                            experts=experts if of(Over.EXPERTS) else None, placed=placed, single=single))
    return out


def placement(over: Over, mesh: Mesh, sc: Scopes, clip: tuple | None = None, weight: int = 1) -> Placement:
    """The placement of a group over `mesh` (named `over`) with scopes `sc`; its clip
    all-reduce is over `clip` (default: its optim levels, `mesh` being the strategy's)."""
    return Placement(over, mesh, sc, factors(sc, mesh), mesh.ordered(sc.optim.levels) if clip is None else clip,
                     weight)


def _groups(pl: Placement, counts, root: bool, single: bool = False):
    out = []
    for phi, trainable in counts:
        if phi:
            n = padded(phi, pad_multiple(pl.factors, trainable))
            out.append(group_plan(pl, phi, n, trainable, root, single and trainable))
    return out


def _placement(mesh: Mesh, u: UnitSize, over: Over) -> Placement:
    """The placement of unit `u`'s parameters of kind `over` (lowering/placements.py [Note: placement kinds])."""
    if over == Over.DENSE:
        return placement(over, mesh, u.scopes)
    if over == Over.EXPERTS:
        e = u.experts
        return placement(over, e.mesh, e.scopes, expert_clip_levels(mesh, e), expert_clip_weight(e))
    k = get_kind(over)
    return placement(over, mesh, k.scopes(u.scopes))


def lower_unit(mesh: Mesh, u: UnitSize) -> UnitPlan:
    groups, dense = [], placement(Over.DENSE, mesh, u.scopes)
    for over in (Over.DENSE, *(o for o, _, _ in u.placed)):
        trainable, frozen = u.counts(over)
        groups += _groups(dense if over == Over.DENSE else _placement(mesh, u, over),
                          ((trainable, True), (frozen, False)), u.root, u.single and over == Over.DENSE)
    return UnitPlan(u.name, u.scopes, dense.factors, tuple(groups), u.root)




def lower(mesh: Mesh, units, prefetch: int = 1, passes=None) -> Lowering:
    """The plan over `units` (UnitSizes, forward order, root first) on `mesh` with `prefetch`,
    rewritten by the plan passes named in `passes` (None: all of `passes.PLAN_PASSES`)."""
    plans = tuple(lower_unit(mesh, u) for u in units)
    clip = clip_rows(mesh, [g.placement.clip_levels for p in plans for g in p.groups if g.trainable])
    sched = schedule([p.gathered and bool(p.groups) for p in plans], prefetch)
    return run_plan_passes(Lowering(plans, clip, sched), passes)
