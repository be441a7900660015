"""Per-unit scopes — part of stage 3 (lowering): overrides applied, dependency checked.

Input: a `Strategy` (top-level scopes and its partial `override` blocks), a unit's name
and the module FQNs it runs. Output: the unit's resolved `Scopes` and the indices of
the override blocks that matched it.

[Note: several matching overrides]
A block matches a unit when its glob matches the unit's name or one of its modules.
Blocks apply in file order, and each sets only the states it mentions, so for every
state the *last* matching block that mentions it wins; a state no matching block
mentions keeps the top-level statement. Example: `override "blocks.0" { params ...;
grads ... }` then `override "blocks.*" { optim ... }` gives blocks.0 the first block's
params and grads and the second block's optim.

[Note: dependency rule per unit]
The DSL checks each block merged over the top level (located diagnostics); a unit whose
stacked result still breaks params ⊆ grads ⊆ optim is an error naming the unit and the
blocks that shaped it.
"""
from __future__ import annotations

import fnmatch
from dataclasses import replace

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import DEPENDENCY, Mesh, Scopes, Strategy

from .experts import expert_group
from .ir import Over
from .placements import PlacementKind, kinds


def _matches(pattern: str, unit: str, modules: tuple[str, ...]) -> bool:
    return fnmatch.fnmatchcase(unit, pattern) or any(fnmatch.fnmatchcase(m, pattern) for m in modules)


def unit_scopes(strategy: Strategy, unit: str, modules: tuple[str, ...] = ()) -> tuple[Scopes, tuple[int, ...]]:
    """`unit`'s scopes (see [Note: several matching overrides]) and the matching blocks' indices."""
    scopes, used = strategy.scopes, []
    for i, ov in enumerate(strategy.overrides):
        if _matches(ov.pattern, unit, modules):
            scopes = replace(scopes, **{k: getattr(ov, k) for k in ov.sets()})
            used.append(i)
    check_dependency(strategy, unit, scopes, used)
    return scopes, tuple(used)


def check_dependency(strategy: Strategy, unit: str, scopes: Scopes, used) -> None:
    for inner, outer in DEPENDENCY:
        missing = scopes.missing(inner, outer)
        if missing:
            lines = [strategy.overrides[i].line for i in used]
            where = f"{strategy.file}:{lines[-1]}" if lines and lines[-1] else strategy.file
            blocks = f" (override blocks on lines {', '.join(map(str, lines))})" if lines else ""
            raise ShardcError(f"{where}: unit {unit} breaks the dependency rule{blocks}: {inner} shard over "
                              f"{', '.join(missing)} but {outer} does not")


def unused_override(strategy: Strategy, used: set[int], units: list[str]) -> None:
    """An override block that matched no unit is an error naming its line."""
    for i, ov in enumerate(strategy.overrides):
        if i not in used:
            where = f"{strategy.file}:{ov.line}" if ov.line else strategy.file
            raise ShardcError(f'{where}: override pattern "{ov.pattern}" matches no unit (units: {", ".join(units)})')


# -- placement kinds -------------------------------------------------------------------------
def kinds_of(strategy: Strategy) -> tuple[PlacementKind, ...]:
    """The placement kinds under `strategy` besides the unit's own, in precedence order: its
    statements' (the `experts` statement's, lowering/experts.py), then the registered ones
    (lowering/placements.py [Note: a read-only kind registry])."""
    e = expert_group(strategy)
    return ((e,) if e is not None else ()) + kinds()


def kind_for(kinds, fqn: str, tensor=None) -> PlacementKind | None:
    """The first of `kinds` that takes parameter `fqn` (None: the unit's own placement)."""
    return next((k for k in kinds if k.takes(fqn, tensor)), None)


def over_of(kinds, fqn: str, tensor=None) -> Over:
    """The placement of parameter `fqn` among `kinds` (`kinds_of`): the first that takes it,
    else the unit's own (`Over.DENSE`)."""
    k = kind_for(kinds, fqn, tensor)
    return Over.DENSE if k is None else k.over


def placement_meshes(strategy: Strategy) -> dict[Over, Mesh]:
    """The mesh of each placement (`Over`) under `strategy`: the one owner of that map."""
    return {Over.DENSE: strategy.mesh} | {k.over: k.placement(strategy.mesh, strategy.scopes).mesh
                                          for k in kinds_of(strategy)}


def row_mesh(row, mesh: Mesh, meshes=None) -> Mesh:
    """The mesh `row`'s levels are on (a `Row` or a ledger record with `over`): its
    placement's in `meshes` (`placement_meshes`), else `mesh`."""
    over = getattr(row, "over", Over.DENSE)
    on = (meshes or {}).get(over if isinstance(over, Over) else Over(over))
    return mesh if on is None else on
