"""Unit and group states — stage: runtime. The enums the engine's objects move through.

Input: nothing (a leaf of the runtime). Output: `TrainingState` (a unit: idle, or running
its forward), `GradState` (a flat group: this backward's gradients pending, or reduced),
and `assert_in_states`, which each object's own transition methods call before they move
(FSDP2's `TrainingState` and `_assert_in_states`, torch/distributed/fsdp/_fully_shard/).

[Note: asserted transitions]
A unit's or a group's state is changed only through its own methods (groups/unit.py `UnitState`,
groups/flat_group.py `FlatGroup`); the engine calls them, it never writes the fields. Each
method names the states it may start from, so a transition out of order (a unit ending a
forward it never began, a module counted on an idle unit) raises `StateTransitionError`
at once, naming the object and both states, instead of leaving a flag wrong for a later
step to trip over. Such an error is shardc's bug, not the user's input.
"""
from __future__ import annotations

import enum


class TrainingState(enum.Enum):
    IDLE = "idle"              # not running: released, or held between its runs
    FORWARD = "forward"        # its forward runs (gathered, views set, counting its modules)


class GradState(enum.Enum):
    PENDING = "pending"        # this backward's gradients are not all in yet
    REDUCED = "reduced"        # reduced (a module run twice in a forward reduces twice)


class StateTransitionError(RuntimeError):
    """A runtime object was moved out of a state it cannot leave that way (shardc's bug)."""


def assert_in_states(owner: str, what: str, state: enum.Enum, *allowed: enum.Enum) -> None:
    """Raise unless `state` is one of `allowed` ([Note: asserted transitions])."""
    if state not in allowed:
        names = " or ".join(s.name for s in allowed)
        raise StateTransitionError(f"{owner}: cannot {what} in state {state.name} (expected {names})")
