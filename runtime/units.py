"""Unit specs — the compiler's unit table as the runtime receives it (docs/internals.md).

Input: produced by `shardc.compiler.units.find_units`. Output: consumed by
`shard_module(model, strategy, units)`. Index 0 is the root unit ("<root>"); units 1..
are in forward execution order.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardc.dsl.ir import Scopes


@dataclass(frozen=True, slots=True)
class UnitSpec:
    name: str                         # "<root>" for the root unit, else a module FQN (or a bucket name)
    params: tuple[str, ...]           # canonical parameter FQNs in this unit (tied aliases excluded)
    scopes: Scopes                    # resolved per unit (overrides applied)
    modules: tuple[str, ...] = ()     # module FQNs whose forward runs this unit (empty for root)
