"""Unit and group states move only through their own methods, and a wrong move raises at once
(runtime/groups/transitions.py [Note: asserted transitions]).

A unit of two modules (a bucket) runs its forward IDLE -> FORWARD -> IDLE, counting one
module run each; ending a forward it never began, counting a module on an idle unit or
starting a running one raises `StateTransitionError`. One real training step on one rank
leaves every unit idle and every group's gradients pending for the next backward.
"""
from __future__ import annotations

import copy

import pytest
import torch

from shardc.dsl.ir import Scopes
from shardc.runtime.groups.transitions import GradState, StateTransitionError, TrainingState
from shardc.runtime.groups.unit import UnitState
from shardc.units import UnitSpec


def _unit(modules=("a", "b")) -> UnitState:
    return UnitState(1, UnitSpec("u", (), Scopes(), modules), [], [], [])


def test_a_forward_moves_idle_forward_idle_and_counts_its_modules():
    u = _unit()
    assert u.state is TrainingState.IDLE and not u.running
    u.start_forward()
    assert u.running
    assert u.module_ran() is False          # 1 of 2 modules
    assert u.module_ran() is True           # its last
    u.end_forward()
    assert u.state is TrainingState.IDLE and u.calls == 0


@pytest.mark.parametrize("wrong", ["end_forward", "module_ran"])
def test_a_wrong_transition_on_an_idle_unit_raises(wrong):
    with pytest.raises(StateTransitionError, match="unit 1: cannot .* in state IDLE"):
        getattr(_unit(), wrong)()


def test_starting_a_running_unit_raises_and_reset_recovers():
    u = _unit()
    u.start_forward()
    with pytest.raises(StateTransitionError, match="in state FORWARD"):
        u.start_forward()
    u.reset_forward()                       # begin_forward after a forward that raised part-way
    u.start_forward()


def test_a_step_leaves_units_idle_and_grads_pending():
    from tests.harness import dist_run
    dist_run(2, _one_step)


def _one_step(rank, world):
    from shardc.runtime import shard_module
    from tests.test_runtime_util import Tiny, loss_fn, make_opt, strategy, units_for
    s = strategy("zero3", "node(1) > gpu(2)")
    model = Tiny()
    sm = shard_module(copy.deepcopy(model), s, units_for(model, s.scopes))
    opt = make_opt("sgd", sm)
    x = torch.randint(0, 11, (2, 8))
    loss_fn(sm(x), x).backward()
    units = sm.runtime.units
    assert all(u.state is TrainingState.IDLE for u in units)
    assert all(g.grad_state is GradState.PENDING for u in units for g in u.trainables)
    opt.step()
    with pytest.raises(StateTransitionError, match="routed once"):
        units[1].trainables[0].route_grads(print)
