"""Mixed precision across units — stage: runtime. Where units of different `params dtype`
meet, the activations are cast.

Input: the units (`UnitSpec`s, each with its resolved scopes) and the model. Output:
forward hooks on the modules of every unit whose params dtype differs from its caller's
(`install_casts`), and `unit_casts`, the (compute dtype, caller dtype) per unit that the
simulation's dtype check and the tests read. The rule and the hooks are units/casts.py's
([Note: casts at unit boundaries]), shared with explain's activation trace.
"""
from __future__ import annotations

import torch
from torch import nn

from shardc.units import UnitSpec
from shardc.units.casts import boundary_casts, caller_of, cast_floats, install_boundary_casts

from .dtypes import torch_dtype

__all__ = ["cast_floats", "caller_of", "install_casts", "unit_casts"]


def _dtypes(units: list[UnitSpec]) -> list[torch.dtype]:
    return [torch_dtype(u.scopes.params.dtype) for u in units]


def unit_casts(units: list[UnitSpec]) -> list[tuple[torch.dtype, torch.dtype] | None]:
    """Per unit, (its compute dtype, its caller's) where they differ, else None."""
    return boundary_casts(units, _dtypes(units))


def install_casts(model: nn.Module, units: list[UnitSpec]) -> list:
    """Forward hooks casting each boundary of units of different dtypes; returns the handles."""
    return install_boundary_casts(model, units, _dtypes(units))
