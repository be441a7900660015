"""The whole-step compiled mode — stage: runtime (`shard_module(..., backend="inductor")`).

Input: the ShardedModule's units (flat storages and plan rows), model, mesh, ledger.
Output: `GraphRuntime`, what `sm.runtime` is in this mode: the compiled micro-batch
(graph/step.py) and the compiled step boundary (graph/boundary.py), both over the plan's
collectives as functional collectives (graph/funcol.py), compiled by Inductor. The eager
runtime's parts that run outside the step (state dicts, checkpoint loads, clipping's one
all-reduce) stay as they are.

[Note: what the mode refuses]
Each in one sentence naming the eager alternative, before anything is compiled: DTensor
parameters, a unit of several modules (a bucket), and a model dynamo cannot capture in
one graph. The plan passes run as in the eager runtime: `early_sync` in the backward that
ends the step (graph/sync.py), `defer_update` from opt.step() to the next forward
(graph/update.py, graph/step.py [Note: deferred update as graphs]). It never falls back to eager silently.
"""
from __future__ import annotations

import torch

from shardc.dsl.errors import ShardcError

from .funcol import FunctionalComm
from .backend import ScheduledInductor
from ..step.boundary import StepBoundary
from .boundary import GraphStepOps
from .secondary import Secondaries
from .step import GraphStep
from .sync import EarlySync
from .update import update_keys

BACKENDS = ("eager", "inductor")
EAGER = "use the eager runtime (backend='eager', the default)"


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ShardcError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")


def refuse(tp: dict) -> None:
    """[Note: what the mode refuses], for what the plan and the model show."""
    if tp:
        raise ShardcError(f"backend='inductor' does not take DTensor (tensor-parallel) parameters yet "
                          f"({next(iter(tp))!r} is one); {EAGER}")


class GraphRuntime:
    """`sm.runtime` in the whole-step mode (see the module note)."""

    def __init__(self, model, units, strategy, schedule, smesh, names_of, ledger, world: int):
        self.units = units
        self.events: list = []
        rows = [r for u in units for g in u.groups for r in g.gplan.rows]
        self.comm = FunctionalComm(smesh, strategy.collectives, rows)
        secondaries = Secondaries(self.comm)
        self.backend = ScheduledInductor(schedule, _levels_of(smesh, rows), secondaries)
        early = EarlySync(units, schedule, self.comm, world)
        keys = update_keys(schedule.update_deferred)
        ops = GraphStepOps(units, self.comm, ledger, world, self.backend, early, keys)
        self.boundary = StepBoundary(units, strategy.accumulate, schedule, self.events, None, ops=ops)
        self.step = GraphStep(model, units, self.comm, names_of, ledger, self.backend, self.boundary,
                              on_backward=self._backward_done, secondaries=secondaries, early=early,
                              keys=keys)

    def collectives(self) -> list:
        """Every compiled graph's collectives in the order they are issued (the schedule that
        runs; graph/backend.py): `CompiledGraph(kind, [(op, levels, bytes, unit)], code)`,
        `code` being Inductor's generated Python for the graph."""
        return list(self.backend.graphs)

    def forward(self, *args, **kwargs):
        self.boundary.check_forward(torch.is_grad_enabled())
        try:
            return self.step(*args, **kwargs)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UncapturedHigherOrderOpError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ShardcError(f"backend='inductor' cannot capture the model's forward in one graph "
                              f"({first}); {EAGER}") from None

    def _backward_done(self) -> None:
        self.step.hand_off()
        self.boundary.end_backward()

    def release(self, i: int) -> None:
        return None                     # nothing is held between graphs

    def set_views(self, u) -> None:
        return None


def _levels_of(smesh, rows) -> dict[str, tuple[str, ...]]:
    """A process group's name -> the mesh levels it spans, for every group the rows use."""
    out = {}
    for row in rows:
        key = smesh.digits(row.levels, row.order)
        for levels in (key, *((lvl,) for lvl in key)):
            pg = smesh.group(levels, levels)
            if pg is not None:
                out[pg.group_name] = smesh.mesh.ordered(levels)
    return out
