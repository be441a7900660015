"""Experts — a placement kind, part of stage 3 (lowering): the `experts` statement's
parameters on the experts' mesh.

Input: a resolved `Strategy` (its `experts` statement, the experts' mesh and scopes). Output:
`ExpertGroup`, the kind (lowering/placements.py [Note: placement kinds]) that says which
parameters are experts (`takes`), their placement (the experts' mesh and scopes, and their
clip), how a rank holds one before it is placed (`local_shape`: dim 0 split over ep) and
the statement that makes them (codegen's comments). Its runtime is
runtime/transport/experts.py (the experts' process groups and DTensor parameters).

[Note: clip rows of experts]
clip_grad_norm_ adds every element's square once. An expert's optimizer slices differ
across its OS levels on the experts' mesh and across the ep ranks, and repeat over the
rest. On the strategy's mesh those ranks are the OS levels plus the level ep borrows
from, which also counts its ranks outside ep when the OS levels leave it out: then each
rank weights its experts' squares by 1 / (that level's size on the experts' mesh), the
number of times the sum meets each slice (runtime/step/clip.py), and one all-reduce over
the strategy-mesh levels `clip_levels` adds them, as for any OS level set.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import ClassVar

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import Mesh, Scopes, Strategy

from .ir import Over, Placement
from .placements import PlacementKind, placement

__all__ = ["ExpertGroup", "expert_group", "is_expert"]


@dataclass(frozen=True)
class ExpertGroup(PlacementKind):
    """The strategy's `experts` statement as the lowering reads it: which parameters are
    experts (`pattern`, a glob over parameter and module FQNs), the mesh they are
    data-parallel over and their scopes on it, and the ep degree and the level it borrows
    from (dsl/ir.py [Note: the experts' mesh]); `line`: the statement's. `expert_group(strategy)`
    makes it."""
    over: ClassVar[Over] = Over.EXPERTS
    pattern: str
    mesh: Mesh
    scopes: Scopes
    ep: int = 1
    level: str = ""
    line: int = 0

    @property
    def parts(self) -> int:
        return self.ep

    @property
    def named(self) -> str:
        return "an `experts` statement"

    def takes(self, fqn: str, tensor=None) -> bool:
        return is_expert(self, fqn)

    def placement(self, mesh: Mesh, unit: Scopes) -> Placement:
        """The experts' mesh and scopes, whatever the unit's; the clip of [Note: clip rows of experts]."""
        return placement(self.over, self.mesh, self.scopes, self.clip_levels(mesh), self.clip_weight())

    def clip_levels(self, mesh: Mesh) -> tuple[str, ...]:
        """The strategy-mesh levels of the experts' clip all-reduce ([Note: clip rows of experts])."""
        levels = set(self.scopes.optim.levels) | ({self.level} if self.ep > 1 else set())
        return mesh.ordered(levels)

    def clip_weight(self) -> int:
        """How many times the experts' clip all-reduce meets each expert slice (1 unless the
        experts' optimizer scope leaves out the level ep borrows from)."""
        if self.ep == 1 or self.level in self.scopes.optim.levels:
            return 1
        return self.mesh.size(self.level)

    def local_shape(self, fqn: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """One ep rank's part: dim 0 (the experts) divided by ep, as DTensor `Shard(0)` on
        the ep dim places it; one sentence where it does not divide."""
        if self.ep == 1:
            return tuple(shape)
        if not shape or shape[0] % self.ep:
            raise ShardcError(f"expert parameter {fqn!r} has shape {tuple(shape)}: ep {self.ep} must divide "
                              f"its dim 0 (the experts), which DTensor Shard(0) on the ep dim splits")
        return (shape[0] // self.ep, *shape[1:])

    def statement(self) -> str:
        ep = f" ep {self.ep}" if self.ep > 1 else ""
        return f'experts "{self.pattern}"{ep} (over {self.mesh})'


def expert_group(strategy: Strategy) -> ExpertGroup | None:
    """The lowering's view of the strategy's `experts` statement (None without one)."""
    e = strategy.experts
    if e is None:
        return None
    return ExpertGroup(e.pattern, strategy.expert_mesh, strategy.expert_scopes, e.ep, e.level, e.line)


def is_expert(experts: ExpertGroup, fqn: str) -> bool:
    """Whether parameter `fqn` is an expert: the pattern matches it or a module holding it."""
    parts = fqn.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:k]), experts.pattern) for k in range(1, len(parts) + 1))
