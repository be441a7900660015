"""Placement kinds — part of stage 3 (lowering): which parameters a kind places, over which
mesh and with which scopes.

Input: a parameter (its canonical FQN and a tensor-like object: `shape`,
`requires_grad`; a meta tensor will do) and a unit's resolved `Scopes` on the strategy's
mesh. Output: the registered kinds (`kinds`; the one that places a parameter:
lowering/scopes.py `kind_for`, None: the unit's own, `Over.DENSE`), and a kind's
`Placement` of the unit's parameters it takes (mesh, scopes, factors, clip).

[Note: placement kinds]
A group is keyed by its placement (lowering/ir.py [Note: a group is keyed by its
placement]). The unit's own placement is `Over.DENSE` (its scopes on the strategy's mesh);
every other is a `PlacementKind`: its `Over` value, which parameters it takes (`takes`),
their `placement` (default: `scopes` on the strategy's mesh; the experts': their own mesh,
scopes and clip, lowering/experts.py), how one rank holds such a parameter before it is
placed (`local_shape`, `parts`: the experts' dim 0 split over ep), the strategy statement
that makes it (`line`, `statement`; none for a registered kind) and how a sentence names it
(`named`). The kinds under a strategy are its statements' (the `experts` statement's) and
the registered ones (lowering/scopes.py `kinds_of`). Every stage reads a kind or a group's
placement and nothing else: the lowering makes its groups (`unit_sizes`, `lower_unit`), the
runtime places their flat chunks on its mesh's Comm (runtime/groups/placed.py), the clip
adds their squares over their clip levels, the ledger and cost model count their rows under
their `Over`, codegen names the statement behind them. So a kind on the strategy's mesh is
one value and the file defining it; a kind on a mesh of its own adds its runtime file (its
process groups and DTensor parameters, as runtime/transport/experts.py) and one entry in
runtime/groups/placed.py's `OWN_MESH`.

[Note: a read-only kind registry]
As for collective algorithms (algorithms/base.py [Note: a read-only registry]), no kind is
registered after import; a test's kind is registered for a scope, `with registered(kind):`,
and leaves with it, so no model outside the block sees it. A parameter the experts'
statement names is the experts'; of the others, the first registered kind that takes it
places it.
"""
from __future__ import annotations

from contextlib import contextmanager

from shardc.dsl.ir import Mesh, Scopes

from .ir import Over, Placement
from .layout import factors

__all__ = ["PlacementKind", "kinds", "placement", "rank", "registered"]


def placement(over: Over, mesh: Mesh, sc: Scopes, clip: tuple | None = None, weight: int = 1) -> Placement:
    """The placement of a group over `mesh` (named `over`) with scopes `sc`; its clip
    all-reduce is over `clip` (default: its optim levels, `mesh` being the strategy's)."""
    return Placement(over, mesh, sc, factors(sc, mesh), mesh.ordered(sc.optim.levels) if clip is None else clip,
                     weight)


class PlacementKind:
    """A kind of placement (see [Note: placement kinds]); subclass it and set `over`."""
    over: Over
    parts: int = 1                    # ranks one parameter is split over before it is placed (ep)
    line: int | None = None           # the strategy statement that makes it (None: registered)

    def takes(self, fqn: str, tensor) -> bool:
        """Whether this kind places parameter `fqn`."""
        raise NotImplementedError

    def scopes(self, unit: Scopes) -> Scopes:
        """The scopes of its parameters in a unit whose own scopes are `unit`."""
        return unit

    def placement(self, mesh: Mesh, unit: Scopes) -> Placement:
        """The placement of its parameters in a unit whose own scopes on the strategy's mesh
        `mesh` are `unit` (default: `scopes(unit)` on `mesh`)."""
        return placement(self.over, mesh, self.scopes(unit))

    def local_shape(self, fqn: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of parameter `fqn` (whole: `shape`) on one rank before the model places it."""
        return tuple(shape)

    def statement(self) -> str | None:
        """The strategy statement that makes this kind, as codegen names it (None: registered)."""
        return None

    @property
    def named(self) -> str:
        """How a sentence names it."""
        return f"the placement kind {self.over.value!r}"


_BUILTIN = (Over.DENSE, Over.EXPERTS)       # the language's: the unit's own and the `experts` statement's
_KINDS: dict[Over, PlacementKind] = {}      # empty outside `registered` ([Note: a read-only kind registry])


@contextmanager
def registered(*added: PlacementKind):
    """Within the block, `added` are placement kinds too ([Note: a read-only kind registry])."""
    for k in added:
        if k.over in _BUILTIN or k.over in _KINDS:
            raise ValueError(f"placement kind {k.over.value!r} is already registered")
    try:
        for k in added:
            _KINDS[k.over] = k
        yield
    finally:
        for k in added:
            _KINDS.pop(k.over, None)


def kinds() -> tuple[PlacementKind, ...]:
    """The registered kinds, in registration order."""
    return tuple(_KINDS.values())


def rank(value: str) -> int:
    """Ledger order of the kind named `value`: dense, experts, then registration order."""
    order = [o.value for o in _BUILTIN + tuple(_KINDS)]
    return order.index(value) if value in order else len(order)
