"""Unit specs — stage: units (the unit table the compiler, the cost model and the runtime read).

Input: produced by `find_units` (units/find.py). Output: consumed by capture (reordered
into forward execution order), the lowering (`unit_sizes`), the cost model and
`shard_module(model, strategy, units)`. Index 0 is the root unit ("<root>"); units 1..
are in forward execution order once capture has run. Also the one owner of a
parameter's canonical name (`param_owners`, `canonical_names`), which the unit finder,
the membership rule and the runtime all read, and of what a parameter counts on this rank
(`local_params`: a DTensor's local shard).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardc.dsl.ir import Scopes

__all__ = ["ROOT", "UnitSpec", "param_owners", "canonical_names", "local_params"]

ROOT = "<root>"


def param_owners(model: nn.Module) -> dict[int, list[str]]:
    """id(Parameter) -> every FQN it is reachable under; the first, in registration order,
    is its canonical name (a tied parameter's other names are aliases that no unit lists)."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    return owners


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every FQN a parameter is reachable under -> its canonical name (registration order)."""
    return {n: names[0] for names in param_owners(model).values() for n in names}


@dataclass(frozen=True, slots=True)
class UnitSpec:
    name: str                         # "<root>" for the root unit, else a module FQN (or a bucket name)
    params: tuple[str, ...]           # canonical parameter FQNs in this unit (tied aliases excluded)
    scopes: Scopes                    # resolved per unit (overrides applied)
    modules: tuple[str, ...] = ()     # module FQNs whose forward runs this unit (empty for root)


def local_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter (canonical name) as this rank holds it, what unit sizes count: a
    DTensor's local shard (tensor parallelism: shardc shards the local shard), with the
    parameter's `requires_grad`; any other parameter itself."""
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            with torch.no_grad():
                p = p.to_local().detach().requires_grad_(p.requires_grad)
        out[name] = p
    return out
