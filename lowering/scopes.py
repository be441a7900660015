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

from .ir import ExpertGroup, Over
from .placements import kind_of, kinds


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


# -- experts ----------------------------------------------------------------------------------
# [Note: clip rows of experts]
# clip_grad_norm_ adds every element's square once. An expert's optimizer slices differ
# across its OS levels on the experts' mesh and across the ep ranks, and repeat over the
# rest. On the strategy's mesh those ranks are the OS levels plus the level ep borrows
# from, which also counts its ranks outside ep when the OS levels leave it out: then each
# rank weights its experts' squares by 1 / (that level's size on the experts' mesh), the
# number of times the sum meets each slice (runtime/step/clip.py), and one all-reduce over
# `expert_clip_levels` adds them, as for any OS level set.

def expert_group(strategy: Strategy) -> ExpertGroup | None:
    """The lowering's view of the strategy's `experts` statement (None without one)."""
    e = strategy.experts
    if e is None:
        return None
    return ExpertGroup(e.pattern, strategy.expert_mesh, strategy.expert_scopes, e.ep, e.level)


def is_expert(experts: ExpertGroup, fqn: str) -> bool:
    """Whether parameter `fqn` is an expert: the pattern matches it or a module holding it."""
    parts = fqn.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:k]), experts.pattern) for k in range(1, len(parts) + 1))


def over_of(experts: ExpertGroup | None, fqn: str, tensor=None) -> Over:
    """The placement of parameter `fqn`: the experts' when `experts` names it, else a
    registered kind's that takes it (lowering/placements.py), else the unit's own."""
    if experts is not None and is_expert(experts, fqn):
        return Over.EXPERTS
    kind = kind_of(fqn, tensor) if tensor is not None else None
    return kind.over if kind is not None else Over.DENSE


def placement_meshes(strategy: Strategy) -> dict[Over, Mesh]:
    """The mesh of each placement (`Over`) under `strategy`: the one owner of that map."""
    return {Over.DENSE: strategy.mesh, Over.EXPERTS: strategy.expert_mesh} | \
        {k.over: strategy.mesh for k in kinds()}


def row_mesh(row, mesh: Mesh, meshes=None) -> Mesh:
    """The mesh `row`'s levels are on (a `Row` or a ledger record with `over`): its
    placement's in `meshes` (`placement_meshes`), else `mesh`."""
    over = getattr(row, "over", Over.DENSE)
    on = (meshes or {}).get(over if isinstance(over, Over) else Over(over))
    return mesh if on is None else on


def expert_clip_levels(mesh, experts: ExpertGroup) -> tuple[str, ...]:
    """The strategy-mesh levels of the experts' clip all-reduce ([Note: clip rows of experts])."""
    levels = set(experts.scopes.optim.levels) | ({experts.level} if experts.ep > 1 else set())
    return mesh.ordered(levels)


def expert_clip_weight(experts: ExpertGroup) -> int:
    """How many times the experts' clip all-reduce meets each expert slice (1 unless the
    experts' optimizer scope leaves out the level ep borrows from)."""
    if experts.ep == 1 or experts.level in experts.scopes.optim.levels:
        return 1
    return experts.mesh.size(experts.level)
