"""Unit specs — the compiler's unit table as the runtime receives it (docs/internals.md).

Input: produced by `shardc.compiler.units.find_units`. Output: consumed by
`shard_module(model, strategy, units)`. Index 0 is the root unit ("<root>"); units 1..
are in forward execution order. Also the one owner of a parameter's canonical name
(`param_owners`), which the compiler's unit finder and the runtime both read.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shardc.dsl.ir import Scopes


def param_owners(model: nn.Module) -> dict[int, list[str]]:
    """id(Parameter) -> every FQN it is reachable under; the first, in registration order,
    is its canonical name (a tied parameter's other names are aliases that no unit lists)."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    return owners


@dataclass(frozen=True, slots=True)
class UnitSpec:
    name: str                         # "<root>" for the root unit, else a module FQN (or a bucket name)
    params: tuple[str, ...]           # canonical parameter FQNs in this unit (tied aliases excluded)
    scopes: Scopes                    # resolved per unit (overrides applied)
    modules: tuple[str, ...] = ()     # module FQNs whose forward runs this unit (empty for root)
