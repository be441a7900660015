"""Unit state — stage: runtime. One unit as the engine and the step boundary see it.

Input: the compiler's `UnitSpec`, the unit's flat groups (groups/flat_group.py) and where each of
its parameters is referenced in the module. Output: `UnitState`, with its forward's
`TrainingState` and module count, changed through its own methods (groups/transitions.py,
[Note: asserted transitions]; its groups' `reduced` is theirs, groups/flat_group.py); and
`holds_sharded`, whether a module's parameters (or those of a module inside it) were
taken by a unit.

[Note: sharded modules]
A unit takes its parameters out of their modules (module.py, [Note: parameters become
views]), so a module a ShardedModule wraps can never be sharded again: `shardc.compile`
asks `holds_sharded` and refuses it, a ShardedModule or a module inside one, in one
sentence. Each UnitState records on each module it takes from the attributes it holds
(`module._shardc_held`, a set in the module's own `__dict__`, as FSDP2 keeps its state
reachable from the module it shards: no process-global map, and the record goes with
the module); a module counts once an attribute recorded for it has really left its
`_parameters`, so a ShardedModule that failed before taking them leaves its model
compilable.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardc.units import UnitSpec

from .flat_group import FlatGroup
from .transitions import TrainingState, assert_in_states

HELD = "_shardc_held"                   # on a module: the attributes a unit took from it


def holds_sharded(module: torch.nn.Module) -> bool:
    """Whether a unit took the parameters of `module` or of a module inside it ([Note: sharded modules])."""
    return any(any(a not in m._parameters for a in m.__dict__.get(HELD, ())) for m in module.modules())


@dataclass
class UnitState:
    index: int
    spec: UnitSpec
    groups: list[FlatGroup]
    targets: list[list[list[tuple[torch.nn.Module, str]]]]   # group -> slot -> (module, attr)
    wrappers: list[list]                  # group -> slot -> view -> parameter (DTensor), or None
    state: TrainingState = TrainingState.IDLE
    calls: int = 0                        # its modules run in this forward (a bucket has several)

    def __post_init__(self) -> None:
        for slots in self.targets:
            for pairs in slots:
                for mod, attr in pairs:
                    mod.__dict__.setdefault(HELD, set()).add(attr)   # kept by the module itself

    # -- the forward's transitions ([Note: asserted transitions]) ---------------------------
    @property
    def running(self) -> bool:
        return self.state is TrainingState.FORWARD

    def reset_forward(self) -> None:
        """A forward begins: every unit is idle with no module run (a forward that raised
        part-way left some running)."""
        self.state, self.calls = TrainingState.IDLE, 0

    def start_forward(self) -> None:
        assert_in_states(f"unit {self.index}", "start its forward", self.state, TrainingState.IDLE)
        self.state = TrainingState.FORWARD

    def module_ran(self) -> bool:
        """One of its modules ran; True when that was its last (the forward is done)."""
        assert_in_states(f"unit {self.index}", "count a module run", self.state, TrainingState.FORWARD)
        self.calls += 1
        return self.calls >= max(1, len(self.spec.modules))

    def end_forward(self) -> None:
        assert_in_states(f"unit {self.index}", "end its forward", self.state, TrainingState.FORWARD)
        self.state, self.calls = TrainingState.IDLE, 0

    @property
    def reduced(self) -> bool:
        """This backward's gradients of all of its trainable groups are reduced."""
        return all(g.reduced for g in self.trainables)

    @property
    def trainables(self) -> list[FlatGroup]:
        """The unit's trainable flat groups: its dense parameters', then its experts' (each
        on its own data-parallel mesh with its own scopes, lowering/ir.py `GroupPlan`)."""
        return [g for g in self.groups if g.trainable]

    @property
    def trainable(self) -> FlatGroup | None:
        """The one trainable group of a unit that has at most one (the whole-step mode's)."""
        return next((g for g in self.groups if g.trainable), None)
