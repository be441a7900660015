"""Plan IR — compiler stage 3 (scheduled graph -> **Plan**).

Input: a GraphModule that went through every pass, the Strategy, the model.
Output: a `Plan`: the strategy, the unit table in forward order with each unit's
element counts, the forward schedule (one `Step` per runtime call, in program order,
each naming the strategy line that caused it) and the model's parameter structure.
Codegen and the cost model read only this.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shardc.compiler.passes.meta import Op, capture_info, info
from shardc.dsl.ir import Strategy

__all__ = ["Step", "Plan", "build_plan"]


@dataclass(frozen=True, slots=True)
class Step:
    op: Op                 # BEGIN_FORWARD | ISSUE_GATHER | WAIT_GATHER | RUN_UNIT | RELEASE | END_FORWARD
    unit: int
    line: int = 0          # strategy line that caused it (0: none)


@dataclass(frozen=True, slots=True)
class Plan:
    strategy: Strategy
    units: tuple                              # UnitSpec, root first, forward execution order
    trainable_numels: tuple[int, ...]         # per unit: elements of requires_grad params
    frozen_numels: tuple[int, ...]            # per unit: elements of frozen params
    steps: tuple[Step, ...]
    capture: str                              # "fx" | "export"
    params: tuple[tuple[str, tuple[int, ...]], ...]   # model.named_parameters(): (name, shape)
    notes: tuple[str, ...] = ()

    @property
    def unit_numels(self) -> tuple[int, ...]:
        return tuple(t + f for t, f in zip(self.trainable_numels, self.frozen_numels))


def _numels(model: nn.Module, units) -> tuple[tuple[int, ...], tuple[int, ...]]:
    params = dict(model.named_parameters())
    train = tuple(sum(params[n].numel() for n in u.params if params[n].requires_grad) for u in units)
    frozen = tuple(sum(params[n].numel() for n in u.params if not params[n].requires_grad) for u in units)
    return train, frozen


def build_plan(gm, strategy: Strategy, model: nn.Module) -> Plan:
    ci = capture_info(gm)
    steps = tuple(Step(info(n).op, info(n).unit, info(n).line) for n in gm.graph.nodes
                  if info(n) is not None and info(n).op is not Op.COMPUTE)
    train, frozen = _numels(model, ci.units)
    structure = tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
    return Plan(strategy, tuple(ci.units), train, frozen, steps, ci.mode, structure, tuple(ci.notes))
