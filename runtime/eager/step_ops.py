"""The step's collectives, issued eagerly — stage: runtime (what the step boundary runs).

Input: the units (their trainable flat groups, groups/flat_group.py). Output: `EagerStepOps`, the
executor `StepBoundary` (step/boundary.py) runs the step's sync, update and zeroing through:
each unit's sync issued as its own collectives (so a plan pass can issue it early, during
the last backward), completed and averaged at the step, the update all-gathers issued after
opt.step() as work the boundary may wait later (a deferred update). The whole-step mode's
executor runs the same steps as compiled graphs (graph/boundary.py `GraphStepOps`).
The sync issued at the end of the step's backward keeps at most the plan's
`SYNC_IN_FLIGHT` groups in flight (shardc.lowering [Note: syncs in flight]).
"""
from __future__ import annotations

from collections import deque

from shardc.lowering import SYNC_IN_FLIGHT


class EagerStepOps:
    """The step's collectives as eager work, unit by unit (see the module docstring)."""
    overlaps_sync = True                # a unit's sync can be issued before the step (plan passes)

    def __init__(self, units):
        self.units = units
        self._in_flight: deque = deque()   # groups whose bounded sync is issued, oldest first

    def _groups(self):
        return [g for u in self.units for g in u.trainables]

    def sync_unit(self, u, bounded: bool = False) -> None:
        """Issue unit u's sync; `bounded` (the end of the step's backward): first complete
        the oldest bounded syncs so that at most SYNC_IN_FLIGHT groups are in flight."""
        for g in u.trainables:
            if bounded:
                while len(self._in_flight) >= SYNC_IN_FLIGHT:
                    self._in_flight.popleft().sync_wait()
                self._in_flight.append(g)
            g.sync_issue()

    def advance_early(self, group) -> None:
        group.sync_advance_early()

    def complete(self) -> None:
        self._in_flight.clear()
        groups = self._groups()
        for g in groups:
            g.sync_advance()
        for g in groups:
            g.sync_wait()

    def update(self) -> list:
        """Every unit's update all-gather issued: [(unit index, work)]."""
        return [(u.index, g.update_issue()) for u in self.units for g in u.trainables]

    def zero(self) -> None:
        self._in_flight.clear()
        for g in self._groups():
            g.zero_grads()
