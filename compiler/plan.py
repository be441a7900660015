"""Plan IR — compiler stage `plan` (scheduled graph + the lowering -> **Plan**).

Input: a GraphModule that went through every pass, the Strategy, the model.
Output: a `Plan`: the strategy, the unit table in forward order with each unit's
element counts, the lowered plan (`shardc.lowering.Lowering`, built here by stage 3 of
the pipeline, `lower`: groups, rows, the schedule the runtime follows; `shardc.compile`
hands this very object to the runtime), the graph's runtime calls (one `Step` per call, in
program order, each naming the strategy line that caused it) and the model's parameter
structure. Codegen reads only this.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shardc.compiler.passes.meta import Call, capture_info, info
from shardc.dsl.ir import Strategy
from shardc.lowering import Lowering, kinds_of, lower
from shardc.lowering.passes import pass_names
from shardc.analysis.costmodel.sizes import model_unit_sizes

__all__ = ["Step", "Plan", "build_plan"]


@dataclass(frozen=True, slots=True)
class Step:
    op: Call                 # BEGIN_FORWARD | ISSUE_GATHER | WAIT_GATHER | RUN_UNIT | RELEASE | END_FORWARD
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
    lowering: Lowering
    notes: tuple[str, ...] = ()
    passes: tuple[str, ...] = ()              # the plan passes that rewrote `lowering`
    backend: str = "eager"                    # the runtime: "eager" or "inductor" (whole-step compiled)

    @property
    def unit_numels(self) -> tuple[int, ...]:
        return tuple(t + f for t, f in zip(self.trainable_numels, self.frozen_numels))


def build_plan(gm, strategy: Strategy, model: nn.Module, passes=None, backend: str = "eager") -> Plan:
    ci = capture_info(gm)
    steps = tuple(Step(info(n).op, info(n).unit, info(n).line) for n in gm.graph.nodes
                  if info(n) is not None and info(n).op is not Call.COMPUTE)
    sizes = model_unit_sizes(model, ci.units, kinds_of(strategy))
    lowering = lower(strategy.mesh, sizes, strategy.prefetch, passes)
    structure = tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
    return Plan(strategy, tuple(ci.units), tuple(u.trainable for u in sizes), tuple(u.frozen for u in sizes),
                steps, ci.mode, structure, lowering, tuple(ci.notes), pass_names(passes), backend)
