"""Unit discovery — compiler stage between the Strategy and capture.

Input: an `nn.Module` (any device, `meta` included) and a `Strategy`.
Output: `list[UnitSpec]` — index 0 the root unit "<root>", then one unit per matched
module (or bucket), in module registration order (capture later reorders them into
forward execution order), each with its scopes resolved by `shardc.lowering.unit_scopes`
(overrides applied, dependency rule checked per unit).

[Note: which modules become units]
`units auto`: every child of an `nn.ModuleList`/`nn.Sequential` whose children are two
or more modules of one class holding parameters (the transformer blocks). `units
"pat", ...`: fnmatch over module FQNs. `units type Name`: class name. When matches
nest, the outermost wins. Parameters of no unit go to the root unit.

[Note: bucket]
`bucket SIZE` merges consecutive non-root units with equal scopes while their parameter
bytes stay <= SIZE (units of SIZE or more stay alone); `bucket 0` never merges. With no
`bucket` line the cost model picks SIZE (`resolve_bucket`, analysis/costmodel/
bucketing.py "[Note: when bucketing pays]") from the unbucketed units' sizes; the
compiler writes the resolved size into the strategy it emits, so the emitted module
shows it.

[Note: tied parameters]
A Parameter object reachable under several names (GPT-2's `lm_head.weight is
transformer.wte.weight`) has one canonical name, the first `named_parameters` yields
(`runtime.units.param_owners`, which the runtime reads too);
the others are aliases that no unit lists. It lands in the unit of its first
occurrence when every use lies inside that unit, otherwise in the root unit, so one
gather covers every module that reads it.
"""
from __future__ import annotations

import fnmatch

from torch import nn

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import Scopes, Strategy, UnitsKind
from shardc.lowering import unit_scopes, unused_override
from shardc.runtime.units import param_owners

__all__ = ["find_units", "resolve_bucket", "unit_spec_class", "param_owners", "ROOT"]

ROOT = "<root>"


def unit_spec_class():
    """`shardc.runtime.UnitSpec` (imported lazily: the runtime may load torch.distributed)."""
    import shardc.runtime as rt
    if hasattr(rt, "UnitSpec"):
        return rt.UnitSpec
    from shardc.runtime.units import UnitSpec
    return UnitSpec


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
    return kept


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


def _nbytes(model: nn.Module, names) -> int:
    params = dict(model.named_parameters())
    return sum(params[n].numel() * params[n].element_size() for n in names)


def _bucket(units: list, model: nn.Module, size: int) -> list:
    """Merge consecutive non-root units with equal scopes while the total stays <= size
    (the merge rule is the cost model's `bucket_runs`, which also sizes the buckets)."""
    from shardc.analysis.costmodel.bucketing import bucket_runs
    UnitSpec = unit_spec_class()
    rest = units[1:]
    out = [units[0]]
    for idx in bucket_runs([_nbytes(model, u.params) for u in rest], size, [u.scopes for u in rest]):
        run = [rest[i] for i in idx]
        if len(run) == 1:
            out.append(run[0])
        else:
            name = f"{run[0].name}..{run[-1].name.split('.')[-1]}"
            out.append(UnitSpec(name, sum((u.params for u in run), ()), run[0].scopes,
                                sum((u.modules for u in run), ())))
    return out


def resolve_bucket(model: nn.Module, strategy: Strategy) -> Strategy:
    """`strategy` with its bucket size decided: no `bucket` line (None) -> the cost
    model's size for this model's units, 0 when bucketing does not pay (see Note)."""
    if strategy.bucket is not None:
        return strategy
    return _with_bucket(model, strategy, _unbucketed(model, strategy))


def _with_bucket(model: nn.Module, strategy: Strategy, units: list) -> Strategy:
    from dataclasses import replace

    from shardc.analysis.costmodel.bucketing import bucket_bytes
    return replace(strategy, bucket=bucket_bytes(strategy, [_nbytes(model, u.params) for u in units]))


def find_units(model: nn.Module, strategy: Strategy) -> list:
    """The unit table of `model` under `strategy` (root first, registration order),
    bucketed by the strategy's (or the cost model's) bucket size."""
    units = _unbucketed(model, strategy)
    size = strategy.bucket if strategy.bucket is not None else _with_bucket(model, strategy, units).bucket
    return _bucket(units, model, size) if size else units


def _unbucketed(model: nn.Module, strategy: Strategy) -> list:
    UnitSpec = unit_spec_class()
    modules = _matched_modules(model, strategy)
    params = _assign(model, modules)
    used: set[int] = set()
    units = [UnitSpec(ROOT, tuple(params[ROOT]), _scopes_for(ROOT, (), strategy, used), ())]
    for m in modules:
        units.append(UnitSpec(m, tuple(params[m]), _scopes_for(m, (m,), strategy, used), (m,)))
    unused_override(strategy, used, [u.name for u in units])
    return units


def reorder(units: list, first_run: list[str]) -> list:
    """Root first, then units in the order their modules first run (unrun units last)."""
    rank = {m: i for i, m in enumerate(first_run)}
    rest = units[1:]
    key = lambda u: min((rank.get(m, len(rank)) for m in u.modules), default=len(rank))  # noqa: E731
    return [units[0]] + sorted(rest, key=key)
