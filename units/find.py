"""Unit discovery — stage: units (Strategy + model -> the unit table).

Input: an `nn.Module` (any device, `meta` included) and a `Strategy` whose bucket size is
decided (a `bucket` line, or the cost model's answer:
`shardc.analysis.costmodel.bucketing.resolve_bucket`).
Output: `list[UnitSpec]` — index 0 the root unit "<root>", then one unit per matched
module (or bucket, units/bucket.py), in module registration order (capture later
reorders them into forward execution order), each with its scopes resolved by
`shardc.lowering.unit_scopes` (overrides applied, dependency rule checked per unit).

[Note: which modules become units]
`units auto`: every child of an `nn.ModuleList`/`nn.Sequential` whose children are two
or more modules of one class holding parameters (the transformer blocks). `units
"pat", ...`: fnmatch over module FQNs. `units type Name`: class name. When matches
nest, the outermost wins. Parameters of no unit go to the root unit.

[Note: an override names a module]
An `override` pattern that matches none of those units makes each module it matches a
unit of its own, as `units` would (FSDP2 users wrap the head and the embedding on their
own): a module holding parameters, inside no unit and holding none. So `override
"lm_head" { ... }` on a GPT whose units are its blocks cuts the head out of the root. A
pattern that matches no such module either is still the error naming the units.

[Note: tied parameters]
A Parameter object reachable under several names (GPT-2's `lm_head.weight is
transformer.wte.weight`) has one canonical name, the first `named_parameters` yields
(`param_owners`, units/spec.py, which the runtime reads too); the others are aliases
that no unit lists. It lands in the unit of its first occurrence when every use lies
inside that unit, otherwise in the root unit, so one gather covers every module that
reads it.
"""
from __future__ import annotations

import fnmatch

from torch import nn

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import Scopes, Strategy, UnitsKind
from shardc.lowering import unit_scopes, unused_override
from shardc.units.bucket import merge
from shardc.units.spec import ROOT, UnitSpec, local_params, param_owners

__all__ = ["find_units", "unit_bytes", "reorder"]


def _where(strategy: Strategy, line: int) -> str:
    return f"{strategy.file}:{line}" if line else strategy.file


def _inside(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def _auto_candidates(model: nn.Module) -> list[str]:
    out = []
    for fqn, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(mod.named_children())
        kinds = {type(c) for _, c in children}
        has_params = all(any(True for _ in c.parameters()) for _, c in children)
        if len(children) >= 2 and len(kinds) == 1 and has_params:
            out += [f"{fqn}.{n}" if fqn else n for n, _ in children]
    return out


def _matched_modules(model: nn.Module, strategy: Strategy) -> list[str]:
    spec = strategy.units
    names = [fqn for fqn, _ in model.named_modules() if fqn]
    if spec.kind is UnitsKind.AUTO:
        found = _auto_candidates(model)
    elif spec.kind is UnitsKind.PATTERNS:
        found = []
        for pat in spec.names:
            hits = [n for n in names if fnmatch.fnmatchcase(n, pat)]
            if not hits:
                raise ShardcError(f'{_where(strategy, spec.line)}: units pattern "{pat}" matches no module')
            found += hits
    else:
        types = {fqn: type(m).__name__ for fqn, m in model.named_modules() if fqn}
        found = []
        for tname in spec.names:
            hits = [n for n in names if types[n] == tname]
            if not hits:
                raise ShardcError(f"{_where(strategy, spec.line)}: units type {tname} matches no module")
            found += hits
    order = {n: i for i, n in enumerate(names)}
    found = sorted(set(found), key=order.__getitem__)
    # outermost wins: drop every match nested inside an earlier kept match
    kept: list[str] = []
    for n in found:
        if not any(_inside(n, k) for k in kept):
            kept.append(n)
    return sorted(kept + _override_modules(model, strategy, kept), key=order.__getitem__)


def _override_modules(model: nn.Module, strategy: Strategy, kept: list[str]) -> list[str]:
    """[Note: an override names a module]: the modules an override pattern matching no
    unit makes units of their own."""
    holds = {fqn for fqn, m in model.named_modules() if fqn and any(True for _ in m.parameters())}
    out: list[str] = []
    for ov in strategy.overrides:
        if any(fnmatch.fnmatchcase(k, ov.pattern) for k in kept):
            continue
        for n in sorted(holds):
            if (fnmatch.fnmatchcase(n, ov.pattern) and not any(_inside(n, k) or _inside(k, n) for k in kept + out)):
                out.append(n)
    return out


def _assign(model: nn.Module, modules: list[str]) -> dict[str, list[str]]:
    """Unit module -> canonical params; ROOT -> the rest (registration order)."""
    out: dict[str, list[str]] = {ROOT: [], **{m: [] for m in modules}}
    for names in param_owners(model).values():
        home = [next((m for m in modules if _inside(n, m)), ROOT) for n in names]
        unit = home[0] if all(h == home[0] for h in home) else ROOT
        out[unit].append(names[0])
    return out


def _scopes_for(unit: str, modules: tuple[str, ...], strategy: Strategy, used: set[int]) -> Scopes:
    scopes, hits = unit_scopes(strategy, unit, modules)
    used.update(hits)
    return scopes


def unit_bytes(model: nn.Module, units) -> list[int]:
    """Each unit's parameter bytes on this rank (in the model's dtypes; a meta model will do)."""
    params = local_params(model)
    return [sum(params[n].numel() * params[n].element_size() for n in u.params) for u in units]


def find_units(model: nn.Module, strategy: Strategy) -> list[UnitSpec]:
    """The unit table of `model` under `strategy` (root first, registration order),
    merged by the strategy's bucket size (0: no merging). The size must be decided: a
    strategy with no `bucket` line asks the cost model first (`resolve_bucket`)."""
    if strategy.bucket is None:
        raise ValueError("find_units needs the bucket size decided (the strategy has no `bucket` line): "
                         "resolve it first with shardc.analysis.costmodel.bucketing.resolve_bucket")
    units = _unbucketed(model, strategy)
    return merge(units, unit_bytes(model, units), strategy.bucket) if strategy.bucket else units


def _unbucketed(model: nn.Module, strategy: Strategy) -> list[UnitSpec]:
    modules = _matched_modules(model, strategy)
    params = _assign(model, modules)
    used: set[int] = set()
    units = [UnitSpec(ROOT, tuple(params[ROOT]), _scopes_for(ROOT, (), strategy, used), ())]
    for m in modules:
        units.append(UnitSpec(m, tuple(params[m]), _scopes_for(m, (m,), strategy, used), (m,)))
    unused_override(strategy, used, [u.name for u in units])
    return units


def reorder(units: list[UnitSpec], first_run: list[str]) -> list[UnitSpec]:
    """Root first, then units in the order their modules first run (unrun units last)."""
    rank = {m: i for i, m in enumerate(first_run)}
    rest = units[1:]
    key = lambda u: min((rank.get(m, len(rank)) for m in u.modules), default=len(rank))  # noqa: E731
    return [units[0]] + sorted(rest, key=key)
