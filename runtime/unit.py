"""Unit state — stage: runtime. One unit as the engine and the step boundary see it.

Input: the compiler's `UnitSpec`, the unit's flat groups (flat_group.py) and where each of
its parameters is referenced in the module. Output: `UnitState`, with the engine's
per-forward flags (running, module calls) and per-backward flag (reduced).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardc.units import UnitSpec

from .flat_group import FlatGroup


@dataclass
class UnitState:
    index: int
    spec: UnitSpec
    groups: list[FlatGroup]
    targets: list[list[list[tuple[torch.nn.Module, str]]]]   # group -> slot -> (module, attr)
    wrappers: list[list]                  # group -> slot -> view -> parameter (DTensor), or None
    reduced: bool = False
    running: bool = False
    calls: int = 0

    @property
    def trainable(self) -> FlatGroup | None:
        return next((g for g in self.groups if g.trainable), None)
