"""Lower — stage 3 of the pipeline (Strategy + unit sizes -> **Lowering**).

Input: the strategy's mesh and `prefetch`, and its units in forward order (root first), each a
`UnitSize` (name, element counts, resolved scopes). Output: the `Lowering` every later
stage reads — per unit its factors and padded flat groups with their rows and bytes,
the clip rows and the forward/backward schedule, then the plan passes (`passes/`).
"""
from __future__ import annotations

from dataclasses import dataclass

from shardc.dsl.ir import Mesh, Scopes

from .ir import Lowering, Over, Placement, UnitPlan
from .layout import pad_multiple, padded
from .passes import run_plan_passes
from .rows import clip_rows, group_plan
from .placements import PlacementKind, kinds as registered_kinds, placement
from .scopes import kind_for
from .schedule import schedule

__all__ = ["UnitSize", "lower", "lower_unit", "placement", "unit_sizes"]


@dataclass(frozen=True, slots=True)
class UnitSize:
    """Element counts of one unit (before padding) and its resolved scopes: its own (dense)
    parameters', and apart those of each other placement kind that takes some of them
    (`placed`: (kind, trainable, frozen) per kind, lowering/placements.py): the `experts`
    statement's, a registered kind's."""
    name: str
    trainable: int
    frozen: int
    scopes: Scopes
    root: bool = False
    placed: tuple[tuple[PlacementKind, int, int], ...] = ()
    single: bool = False              # its dense trainable elements are one tensor (GroupPlan.whole_grad)
    # its dense trainable tensors in layout order, each (its index in the model's parameter
    # order, its elements); () where not known (sizes given without parameters)
    tensors: tuple[tuple[int, int], ...] = ()

    def counts(self, over: Over) -> tuple[int, int]:
        """(trainable, frozen) elements placed by kind `over`."""
        if over == Over.DENSE:
            return self.trainable, self.frozen
        return next(((t, f) for k, t, f in self.placed if k.over == over), (0, 0))


def unit_sizes(params, units, kinds=None) -> list[UnitSize]:
    """Sizes of `units` (name, params, scopes; root first): `params` maps each canonical
    FQN to a tensor-like object (`numel()`, `requires_grad`; a meta tensor will do), each as
    one rank holds it (an expert's local shard); `kinds`: the placement kinds besides the
    unit's own, in precedence order (lowering/scopes.py `kinds_of(strategy)`; None: the
    registered ones)."""
    kinds = registered_kinds() if kinds is None else tuple(kinds)
    order = {n: k for k, n in enumerate(params)}       # the model's parameter order (the optimizer's)
    out = []
    for i, u in enumerate(units):
        kind = {n: kind_for(kinds, n, params[n]) for n in u.params}
        of = lambda k: [n for n in u.params if kind[n] is k]
        count = lambda names, t: sum(params[n].numel() for n in names if params[n].requires_grad == t)
        dense = of(None)
        placed = tuple((k, count(of(k), True), count(of(k), False)) for k in kinds if of(k))
        single = sum(1 for n in dense if params[n].requires_grad) == 1
        tensors = tuple((order[n], params[n].numel()) for n in dense if params[n].requires_grad)
        out.append(UnitSize(u.name, count(dense, True), count(dense, False), u.scopes, root=(i == 0),
                            placed=placed, single=single, tensors=tensors))
    return out


def _groups(pl: Placement, counts, root: bool, single: bool = False, tensors=()):
    out = []
    for phi, trainable in counts:
        if phi:
            n = padded(phi, pad_multiple(pl.factors, trainable))
            out.append(group_plan(pl, phi, n, trainable, root, single and trainable, tensors if trainable else ()))
    return out


def lower_unit(mesh: Mesh, u: UnitSize) -> UnitPlan:
    """Unit `u`'s groups: its own parameters' on `mesh` with its scopes, then each kind's with
    that kind's placement (lowering/placements.py [Note: placement kinds])."""
    dense = placement(Over.DENSE, mesh, u.scopes)
    groups = _groups(dense, ((u.trainable, True), (u.frozen, False)), u.root, u.single, u.tensors)
    for k, trainable, frozen in u.placed:
        groups += _groups(k.placement(mesh, u.scopes), ((trainable, True), (frozen, False)), u.root)
    return UnitPlan(u.name, u.scopes, dense.factors, tuple(groups), u.root)


def lower(mesh: Mesh, units, prefetch: int = 1, passes=None) -> Lowering:
    """The plan over `units` (UnitSizes, forward order, root first) on `mesh` with `prefetch`,
    rewritten by the plan passes named in `passes` (None: all of `passes.PLAN_PASSES`)."""
    plans = tuple(lower_unit(mesh, u) for u in units)
    clip = clip_rows(mesh, [g.placement.clip_levels for p in plans for g in p.groups if g.trainable])
    sched = schedule([p.gathered and bool(p.groups) for p in plans], prefetch)
    return run_plan_passes(Lowering(plans, clip, sched), passes)
