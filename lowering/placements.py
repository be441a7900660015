"""Placement kinds — part of stage 3 (lowering): which parameters a kind places, over which
mesh and with which scopes.

Input: a parameter (its canonical FQN and a tensor-like object: `shape`,
`requires_grad`; a meta tensor will do) and a unit's resolved `Scopes` on the strategy's
mesh. Output: the kind that places it (`kind_of`; None: the unit's own, `Over.DENSE`), and
that kind's scopes, from which `lower` makes the group's `Placement`.

[Note: placement kinds]
A group is keyed by its placement (lowering/ir.py [Note: a group is keyed by its
placement]). Two kinds come with the language: `Over.DENSE` (the unit's scopes on the
strategy's mesh) and `Over.EXPERTS` (the `experts` statement's parameters on the experts'
mesh, with their own runtime: runtime/transport/experts.py). Any other kind is a `PlacementKind`: its
`Over` value, which parameters it takes, and its scopes on the strategy's mesh (a kind on
a mesh of its own, as the experts', needs that mesh's Comm in runtime/build.py). Every
stage reads a group's placement and nothing else, so such a kind is that one value and the
file defining it: the lowering makes its groups (`unit_sizes`, `lower_unit`), the runtime
places their flat chunks (runtime/build.py), the clip adds their squares over their
optimizer levels and the ledger and cost model count their rows under their `Over`.

[Note: a read-only kind registry]
As for collective algorithms (algorithms/base.py [Note: a read-only registry]), no kind is
registered after import; a test's kind is registered for a scope, `with registered(kind):`,
and leaves with it, so no model outside the block sees it. A parameter the experts'
statement names is the experts'; of the others, the first registered kind that takes it
places it.
"""
from __future__ import annotations

from contextlib import contextmanager

from shardc.dsl.ir import Scopes

from .ir import Over

__all__ = ["PlacementKind", "kind_of", "kinds", "rank", "registered"]


class PlacementKind:
    """A kind of placement (see [Note: placement kinds]); subclass it and set `over`."""
    over: Over

    def takes(self, fqn: str, tensor) -> bool:
        """Whether this kind places parameter `fqn`."""
        raise NotImplementedError

    def scopes(self, unit: Scopes) -> Scopes:
        """The scopes of its parameters in a unit whose own scopes are `unit`."""
        return unit


_BUILTIN = (Over.DENSE, Over.EXPERTS)
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


def get(over: Over) -> PlacementKind:
    return _KINDS[over]


def kind_of(fqn: str, tensor) -> PlacementKind | None:
    """The registered kind that places `fqn` (None: none does)."""
    return next((k for k in _KINDS.values() if k.takes(fqn, tensor)), None)


def rank(value: str) -> int:
    """Ledger order of the kind named `value`: dense, experts, then registration order."""
    order = [o.value for o in _BUILTIN + tuple(_KINDS)]
    return order.index(value) if value in order else len(order)
