"""The step boundary — stage: runtime. The accumulation state machine of the engine.

Input: the units (their flat groups), the plan's `Schedule`, the strategy's accumulate,
the engine's event record and reduce workspace; the loop's sync switches
(`no_sync_depth`, `requires_sync`, changed through methods); the executor of the step's
collectives (`ops`: eagerly, eager/step_ops.py; or as compiled graphs in the whole-step mode,
graph/boundary.py) — one state machine for both. Output: `StepPhase`, and `StepBoundary`, the object
the engine (eager/engine.py) composes that owns the step's state: it decides when the step's
gradient sync is issued and completed (`wait_sync`, called by opt.step() and
clip_grad_norm_), folds micro-batches run past it, issues the update all-gathers after
opt.step() and waits the deferred ones (`complete_update`), and resets for the next step
(`zero_grad`).

[Note: accumulation]
The loop decides how many micro-batches make a step; `accumulate N` is the plan. At the
end of a backward the step's sync is issued early (to overlap whatever runs before
opt.step()) when gradient sync is on (outside `no_sync()`, `set_requires_gradient_sync`
not False) and either this is the N-th micro-batch, or the loop took charge: it called
`set_requires_gradient_sync` (FSDP2: every backward with sync on issues it), or an
earlier backward this step ran inside `no_sync()` (DDP: the next one outside is the
last). opt.step()/clip_grad_norm_ with the sync not issued (k < N) issues and completes
it then. A backward after the sync was issued (k > N) first completes it, moves the
synced OS slices into a carry and zeroes the grad shards; the later micro-batches
accumulate from zero and their own sync, at the step, adds the carry back (both halves
are divided by the world size, so the sum is the step's mean). Either deviation costs
the planned overlap (k > N also a second sync) and warns once per run. A forward with
gradients after opt.step() without zero_grad() is an error (shardc does not accumulate
across optimizer steps).

[Note: one step, several optimizers]
A step may run several optimizers over one model (Muon for the matrices, AdamW for the
rest). The update all-gathers go out once per step, after the last of them: each
optimizer's step records the parameters it stepped (`optimizer_stepped`, keyed by their
names), and the step ends when every parameter holding a gradient shardc gave it this
step has been stepped (the caller, runtime/step/optimizer.py, knows the parameters; an
optimizer built by the user is known only from its first step, so the rule counts
parameters, not optimizers). A parameter no optimizer steps does not stall the model:
the owed update goes out at the next forward or zero_grad().
"""
from __future__ import annotations

import enum
import warnings

from shardc.lowering import Schedule

from ..errors import AccumulationWarning, RuntimeUsageError
from ..groups.flat_group import FlatGroup
from ..eager.step_ops import EagerStepOps
from ..groups.unit import UnitState
from ..groups.workspace import Workspace


class StepPhase(enum.Enum):
    FRESH = "fresh"            # grads zero, nothing accumulated
    ACCUMULATING = "accumulating"
    SYNCING = "syncing"        # sync issued, waiting in step/clip
    SYNCED = "synced"          # gradients ready for the optimizer
    STEPPED = "stepped"        # optimizer ran; zero_grad() due

    def __repr__(self) -> str:
        return f"StepPhase.{self.name}"


def check_forward(phase: StepPhase, grad_enabled: bool) -> None:
    """A forward with gradients after opt.step() without zero_grad() is an error (shardc
    does not accumulate gradients across optimizer steps)."""
    if grad_enabled and phase is StepPhase.STEPPED:
        raise RuntimeUsageError(
            "forward with gradients after opt.step() without opt.zero_grad(); "
            "shardc does not accumulate gradients across optimizer steps")


class StepBoundary:
    """The step's state and its transitions (see [Note: accumulation])."""

    def __init__(self, units: list[UnitState], accumulate: int, schedule: Schedule,
                 events: list, workspace: Workspace | None, ops=None):
        self.units = units
        self.ops = ops if ops is not None else EagerStepOps(units)   # eagerly, or as graphs
        self.accumulate = max(1, accumulate)
        self.schedule = schedule
        self.events = events
        self.workspace = workspace
        self.phase = StepPhase.FRESH
        self.micro = 0
        self.no_sync_depth = 0
        self.requires_sync: bool | None = None   # set_requires_gradient_sync; None: the plan
        self._loop_decides = False         # a backward this step ran with sync off
        self._carry: dict = {}             # unit -> synced OS grads before a fold
        self._warned = False
        self._synced: set[int] = set()     # units whose sync this step is already issued
        self._sync_prev: FlatGroup | None = None   # the last unit synced early, not yet advanced
        self._updates: dict = {}           # unit -> its groups' deferred update all-gathers (in flight)
        self._stepped: set[str] = set()    # the parameters an optimizer stepped this step
        self._update_owed = False          # an optimizer stepped, the step's update not issued yet
        self.generation = 0                # bumped when the gradients change under a reader (sync, zero)
        self.backward_listeners: list = []
        self.zero_listeners: list = []     # called by zero_grad() (the fp32 gradient copies are freed)
        self.forward_checks: list = []     # called before every forward (the parameters have values) # called at the end of every backward (the parameters' grads)

    # -- the loop's switches (ShardedModule.set_requires_gradient_sync, no_sync) ----------------
    def set_requires_sync(self, flag: bool) -> None:
        self.requires_sync = bool(flag)

    def enter_no_sync(self) -> None:
        self.no_sync_depth += 1

    def exit_no_sync(self) -> None:
        self.no_sync_depth -= 1

    def trainable_groups(self) -> list[FlatGroup]:
        return [g for u in self.units for g in u.trainables]

    def pending_updates(self) -> list[int]:
        """Units whose deferred update all-gather is still in flight."""
        return sorted(self._updates)

    # -- the backward's view -----------------------------------------------------------
    def check_forward(self, grad_enabled: bool) -> None:
        if self._update_owed:              # [Note: one step, several optimizers]
            self.after_step()
        for check in self.forward_checks:
            check("a forward")
        check_forward(self.phase, grad_enabled)

    def begin_backward(self) -> bool:
        """A backward starts; True when it ends the step (its sync is due, so `sync_early`
        applies). A backward after the step's sync was issued folds it first."""
        if self.phase in (StepPhase.SYNCING, StepPhase.SYNCED):
            self._fold()
        return self._sync_due(self.micro + 1)

    def backward_ends_step(self) -> bool:
        """Would a backward that starts now end the step (the rule `begin_backward` applies)?
        The whole-step mode asks when a forward runs, to compile its sync into that
        backward (graph/sync.py)."""
        return self._sync_due(self.micro + 1)

    def sync_early(self, u: UnitState) -> None:
        """On the backward that ends the step, unit u's reduce-scatter is in: issue its sync;
        the unit synced before it had a unit's backward for its reduce-scatter to land, so
        its all-reduce over the replicas goes out now ([Note: early sync])."""
        self._sync_unit(u)
        earlier, self._sync_prev = self._sync_prev, u.trainables
        for g in earlier or ():
            self.ops.advance_early(g)

    def end_backward(self) -> None:
        """A backward is done: count it; issue the step's sync when it is due."""
        self.micro += 1
        self.phase = StepPhase.ACCUMULATING
        if self.no_sync_depth > 0 or self.requires_sync is False:
            self._loop_decides = True
        elif self._sync_due(self.micro):
            self._issue_sync()
            self.clear_workspace()
        for listener in self.backward_listeners:
            listener()

    def clear_workspace(self) -> None:
        """The step's backwards are over: the reduce workspace holds nothing until the next
        (runtime/groups/workspace.py)."""
        if self.workspace is not None:
            self.workspace.clear()

    # -- the sync --------------------------------------------------------------------------
    def _sync_due(self, micro: int) -> bool:
        """Does the backward that makes `micro` micro-batches issue the step's sync?"""
        if self.no_sync_depth > 0 or self.requires_sync is False:
            return False
        return bool(self.requires_sync or self._loop_decides or micro == self.accumulate)

    def _sync_unit(self, u: UnitState, bounded: bool = False) -> None:
        if u.index not in self._synced:
            self._synced.add(u.index)
            self.ops.sync_unit(u, bounded)
            self.events.append(("issue_sync", u.index))

    def _issue_sync(self) -> None:
        for u in self.units:          # at most SYNC_IN_FLIGHT groups at once (lowering [Note: syncs in flight])
            if u.trainables:
                self._sync_unit(u, bounded=True)
        self._synced.clear()
        self._sync_prev = None
        self.phase = StepPhase.SYNCING

    def _complete_sync(self) -> None:
        self.ops.complete()
        self.phase = StepPhase.SYNCED
        self.generation += 1
        self.events.append(("sync_done", -1))

    def _fold(self) -> None:
        """A backward after the sync was issued: keep the synced grads aside (see Note)."""
        self._warn(f"micro-batch {self.micro + 1} ran after the step's gradient sync was issued "
                   f"(the strategy plans accumulate {self.accumulate}); it is folded in exactly "
                   f"with a second sync at the step")
        if self.phase is StepPhase.SYNCING:
            self._complete_sync()
        for u in self.units:
            for k, g in enumerate(u.trainables):
                done = self._carry.get((u.index, k))
                self._carry[(u.index, k)] = (g.storage.os_grad.clone() if done is None
                                              else done.add_(g.storage.os_grad))
        self.ops.zero()
        self.phase = StepPhase.ACCUMULATING

    def _warn(self, what: str) -> None:
        import torch.distributed as dist       # once per run: on the job's first rank only
        if not self.ops.overlaps_sync:         # no sync is issued before the step: nothing is lost
            return
        if not self._warned and dist.get_rank() == 0:
            self._warned = True
            warnings.warn(f"{what}; the overlap the plan gives that sync is lost (warned once per run)",
                          AccumulationWarning, stacklevel=4)

    def wait_sync(self, what: str) -> None:
        self.complete_updates()
        if self.phase is StepPhase.ACCUMULATING:
            if not self._carry:
                why = (f"after {self.micro} micro-batch(es) while the strategy plans accumulate "
                       f"{self.accumulate}" if self.micro != self.accumulate else
                       "with every backward of the step run with gradient sync off")
                self._warn(f"{what} {why}: the gradient sync runs now, exact")
            self._issue_sync()
        if self.phase is StepPhase.SYNCING:
            self._complete_sync()
            for u in self.units:
                for k, g in enumerate(u.trainables):
                    if (u.index, k) in self._carry:
                        g.storage.os_grad.add_(self._carry.pop((u.index, k)))

    def stepped(self) -> set[str]:
        """The parameters an optimizer stepped this step (read-only to callers)."""
        return self._stepped

    def optimizer_stepped(self, names, others_due) -> None:
        """An optimizer stepped these parameters on this step's gradients; the step ends
        now unless `others_due(stepped)` ([Note: one step, several optimizers])."""
        self._stepped.update(names)
        if others_due(self._stepped):
            self._update_owed = True
        else:
            self.after_step()

    def after_step(self) -> None:
        """Issue every unit's update all-gather; wait those the schedule does not defer."""
        self._update_owed = False
        self._stepped.clear()
        self.complete_updates()
        works = self.ops.update()
        deferred = set(self.schedule.update_deferred)
        for i, w in works:
            if i in deferred:
                self._updates.setdefault(i, []).append(w)
            else:
                w.wait()
        self.phase = StepPhase.STEPPED

    def complete_update(self, i: int) -> None:
        """Unit i's parameters are needed: wait its deferred update all-gather, if any."""
        works = self._updates.pop(i, None)
        if works is not None:
            for work in works:
                work.wait()
            self.events.append(("wait_update", i))

    def complete_updates(self) -> None:
        for i in list(self._updates):
            self.complete_update(i)

    def updates_ran(self, units) -> None:
        """A forward's graph ran these units' deferred updates itself (the whole-step mode:
        graph/step.py [Note: deferred update as graphs]): nothing of theirs is owed."""
        for i in units:
            del self._updates[i]
            self.events.append(("wait_update", i))

    def zero_grad(self) -> None:
        if self._update_owed:              # [Note: one step, several optimizers]
            self.after_step()
        self._stepped.clear()
        self.ops.zero()
        self.clear_workspace()
        self.micro = 0
        self._loop_decides = False
        self._carry.clear()
        self.generation += 1
        self.phase = StepPhase.FRESH
        for listener in self.zero_listeners:
            listener()
