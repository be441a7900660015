"""A test-only placement kind, `vectors`: every trainable 1-D parameter (a bias, a norm's
weight) placed whole on every rank — params, grads and optimizer states replicated over
the strategy's mesh, its gradient all-reduced once per step — whatever its unit's scopes.
What adding a placement kind takes: its `Over` value and this one file
(tests/test_placement_kinds.py), registered for a scope: `with registered(VECTORS):` (the
kind registry is read-only after import, lowering/placements.py)."""
from dataclasses import replace

from shardc.lowering import Over
from shardc.lowering.placements import PlacementKind


class Vectors(PlacementKind):
    over = Over("vectors")

    def takes(self, fqn, tensor):
        return bool(tensor.requires_grad) and len(tensor.shape) == 1

    def scopes(self, unit):
        return replace(unit, params=replace(unit.params, levels=(), secondary=None),
                       grads=replace(unit.grads, levels=()), optim=replace(unit.optim, levels=()))


VECTORS = Vectors()
