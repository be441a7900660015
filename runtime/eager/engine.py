"""The step engine — stage: runtime. Drives gathers, releases and gradient reduction.

Input: the units (`UnitState`: a spec, its flat groups, where each parameter is
referenced in the module), the strategy's accumulate and the plan's `Schedule`
(`shardc.lowering`: which gathers are issued before each unit runs, both directions).
Output: the explicit primitives of docs/internals.md (begin_forward, issue_gather,
wait_gather, run_unit, end_forward), the backward hooks that call the same
machinery and the `events` schedule record; the accumulation state machine at the step
boundary is the `StepBoundary` it composes (`engine.boundary`, step/boundary.py, [Note:
accumulation]).

[Note: schedule]
The engine has no ordering logic of its own: it issues what the plan's `Schedule`
names. Forward: begin_forward issues the root's stage (the root is kept gathered until
its grads are reduced); before unit i runs, its stage's gathers are issued — by the
engine on the hooks path (`hooks=True`), by the emitted forward's `rt.issue_gather`
calls (generated from the same stages) otherwise — then its gather is waited; after
its last module ran it is released. Backward: a multi-grad hook on unit i's outputs
issues unit i's backward stage (its own re-gather, primary or secondary, and the
prefetches) and waits its gather. A wait for a gather no stage issued issues it then
(a unit run out of the compiled order). When its parameter gradients are all in (the
backward of its views, groups/storage.py) it reduce-scatters them (async) and releases the full
params; before laying them out flat it waits the previous unit's reduce-scatter, so at
most one full-size gradient is in flight and the next reuses its workspace (shardc.lowering
[Note: reductions in flight]); on the backward that ends the step, that
previous unit's sync is issued right then when the schedule lists it in `sync_early`
(the `early_sync` plan pass). opt.step() issues the update all-gathers; those the
schedule lists in `update_deferred` (the `defer_update` pass) are waited right before
their unit is next needed (its gather issued or it runs), or by anything that reads the
parameters outside a forward (`complete_updates`). A final callback (queued on the autograd engine) flushes
groups that got no gradient, waits the reduce-scatters, releases what is still held
and, on the last micro-batch, issues the per-step sync, waited in opt.step() or
clip_grad_norm_.

[Note: recomputation]
Activation checkpointing re-runs a unit's forward inside the backward (after its
pre-backward re-gather). Such a call only re-sets the views; the unit is released by
its gradients arriving as usual, not after the recomputed forward.
"""
from __future__ import annotations

import functools

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from shardc.lowering import REDUCE_IN_FLIGHT, Phase, Schedule

from ..step.boundary import StepBoundary
from ..compile import eager, eager_frame
from ..groups.flat_group import FlatGroup
from ..groups.unit import UnitState


def _setters(u: UnitState) -> list[list[list[tuple]]]:
    """Where each view of unit u goes, as (set, attr) with set(attr, view): the module's
    __dict__ when it keeps nn.Module's own __setattr__ (a parameter removed from
    `_parameters` is then a plain attribute, so that is what setattr does), else setattr."""
    def setter(mod):
        if type(mod).__setattr__ is torch.nn.Module.__setattr__:
            return mod.__dict__.__setitem__
        return functools.partial(setattr, mod)
    return [[[(setter(m), a) for m, a in slot] for slot in group] for group in u.targets]


def _grad_tensors(out) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


class Engine:
    def __init__(self, units: list[UnitState], accumulate: int, schedule: Schedule, drive_forward: bool):
        self.units = units
        self.schedule = schedule
        self._issues = {d: {st.unit: st.issue for st in getattr(schedule, d.value)}
                        for d in (Phase.FORWARD, Phase.BACKWARD)}
        self.drive_forward = drive_forward      # hooks path: the engine issues the forward stages
        self.events: list[tuple[str, int]] = []
        self.workspace = next((g.workspace for u in units for g in u.groups), None)
        self.boundary = StepBoundary(units, accumulate, schedule, self.events, self.workspace)
        self._queued = False
        self._bwd_seen: set[int] = set()
        self._in_flight: list[FlatGroup] = []     # backward reduce-scatters issued, oldest first
        self._early = False                # this backward ends the step: sync_early applies
        self._unit_of = {id(g): u for u in units for g in u.trainables}
        self._setters = [_setters(u) for u in units]     # made once: per group, per slot

    # -- forward primitives ----------------------------------------------------------
    @eager
    def begin_forward(self) -> None:
        self.boundary.check_forward(torch.is_grad_enabled())
        for u in self.units:
            u.reset_forward()
        self.issue_gather(0)
        self.wait_gather(0)
        self.set_views(self.units[0])
        if self.drive_forward:
            self._issue_stage(Phase.FORWARD, 0)

    def _issue_stage(self, direction: Phase, i: int) -> None:
        """Issue the gathers the plan's `direction` stage of unit i names."""
        for j in self._issues[direction].get(i, ()):      # one lookup per unit (built once)
            self.issue_gather(j, direction)

    @eager
    def issue_gather(self, i: int, phase: Phase = Phase.FORWARD) -> None:
        self.boundary.complete_update(i)
        issued = [g.issue_gather(phase) for g in self.units[i].groups]
        if any(issued):
            self.events.append(("issue_gather", i))

    @eager
    def wait_gather(self, i: int, phase: Phase = Phase.FORWARD) -> None:
        u = self.units[i]
        if any(not g.held and g.gathering is None for g in u.groups):
            self.issue_gather(i, phase)
        if any(g.gathering is not None for g in u.groups):
            for g in u.groups:
                g.wait_gather()
            self.events.append(("wait_gather", i))

    @eager
    def release(self, i: int) -> None:
        if any([g.release() for g in self.units[i].groups]):
            self.events.append(("release", i))

    @eager
    def pre_forward(self, i: int) -> None:
        u = self.units[i]
        if self._queued:                 # activation recomputation inside the backward
            self.wait_gather(i, Phase.BACKWARD)
            self.set_views(u)
            u.start_forward()
            self.events.append(("recompute", i))
            return
        self.boundary.complete_update(i)
        if self.drive_forward:
            self._issue_stage(Phase.FORWARD, i)
        self.wait_gather(i)
        if i != 0:
            self.set_views(u)
        u.start_forward()
        self.events.append(("run", i))

    def watch_backward(self, i: int, out) -> None:
        """Re-gather unit i when the first gradient w.r.t. `out` arrives in the backward."""
        tensors = _grad_tensors(out) if torch.is_grad_enabled() and not self._queued else []
        if tensors and i != 0:
            register_multi_grad_hook(tensors, lambda grads, i=i: self._pre_backward(i), mode="any")

    def finish_forward(self, i: int) -> None:
        self.units[i].end_forward()
        if self._queued:                 # recomputed in the backward: its grads are still due
            return
        if i != 0:
            self.release(i)

    @eager_frame
    def run_unit(self, i: int, fn, *args, **kwargs):
        """Run one module of unit i (the emitted forward's call)."""
        if not self.units[i].running:
            self.pre_forward(i)
        return self.module_done(i, fn(*args, **kwargs))

    @eager
    def module_done(self, i: int, out):
        """One module of unit i ran (emitted call or forward hook): arm its backward; a unit
        of k modules (a bucket) is gathered on its first call and released after its k-th."""
        self.watch_backward(i, out)
        if self.units[i].module_ran():
            self.finish_forward(i)
        return out

    @eager
    def end_forward(self, out):
        tensors = _grad_tensors(out) if torch.is_grad_enabled() else []
        if tensors:
            register_multi_grad_hook(tensors, lambda grads: self._arm(), mode="any")
        else:
            self.release(0)
        return out

    def set_views(self, u: UnitState) -> None:
        """Point every module attribute of unit u's parameters at its views of the full buffer."""
        for g, setters, wrappers in zip(u.groups, self._setters[u.index], u.wrappers):
            for view, slot_setters, wrap in zip(g.views(), setters, wrappers):
                if wrap is not None:               # a DTensor parameter (runtime/state/dtensor_params.py)
                    view = wrap(view)
                for set_, attr in slot_setters:
                    set_(attr, view)

    # -- backward ------------------------------------------------------------------
    def _arm(self) -> None:
        if self._queued:
            return
        self._early = self.boundary.begin_backward()
        self._queued = True
        self._bwd_seen = set()
        torch.autograd.Variable._execution_engine.queue_callback(self._final_callback)

    def _pre_backward(self, i: int) -> None:
        self._arm()
        if i in self._bwd_seen:
            return
        self._bwd_seen.add(i)
        self._issue_stage(Phase.BACKWARD, i)
        self.wait_gather(i, Phase.BACKWARD)
        self.events.append(("backward", i))

    def unit_grads(self, i: int, grads, group: FlatGroup) -> None:
        """The gradients of unit i's trainable `group` of this backward are all in (its
        views' backward); the unit is reduced once all of its trainable groups are."""
        self._arm()
        waited = self._bound_reductions(group)
        if group.release():            # its full buffer first: the reduction does not read it (FSDP2's order)
            self.events.append(("release", i))
        group.reduce_slot_grads(grads)
        group.mark_reduced()
        self.events.append(("issue_reduce", i))
        self._in_flight.append(group)
        for prev in waited:
            j = self._unit_of[id(prev)].index
            if self._early and j in self.schedule.sync_early and self.units[j].reduced:
                self.boundary.sync_early(self.units[j])     # once all of the unit's groups are reduced

    def _bound_reductions(self, newest: FlatGroup) -> list[FlatGroup]:
        """Before `newest`'s gradients are laid out flat: wait the reduce-scatters issued
        before it until fewer than REDUCE_IN_FLIGHT remain, so their flat inputs go back
        to the workspace first and `newest` reuses them (FSDP2's order; shardc.lowering
        [Note: reductions in flight]). The groups waited, oldest first."""
        waited = []
        while self._in_flight and len(self._in_flight) >= REDUCE_IN_FLIGHT:
            prev = self._in_flight.pop(0)
            if prev is newest:
                continue
            if prev.reducing:
                prev.finish_grads()
                self.events.append(("wait_reduce", self._unit_of[id(prev)].index))
            waited.append(prev)
        return waited

    def _final_callback(self) -> None:
        self._queued = False
        self._in_flight = []
        for u in self.units:
            for g in u.trainables:
                if not g.reduced:
                    g.reduce_grad(None)
                    self.events.append(("issue_reduce", u.index))
                g.end_backward()
        for u in self.units:
            for g in u.trainables:
                g.finish_grads()
            self.release(u.index)
        self._early = False
        self.boundary.end_backward()
