"""Shared vocabulary of the graph passes (compiler stage `graph passes`: captured graph ->
scheduled graph).

Input/output: `torch.fx` nodes. Every pass writes its result into `node.meta["shardc"]`
as a `NodeInfo`; the runtime calls the passes insert are `call_function` nodes whose
targets are the marker functions below (they only name a runtime primitive; the graph
is never executed, codegen turns each into `rt.<name>(...)`).

[Note: unit calls and unit regions]
With fx capture a unit is one `call_module` node (op RUN_UNIT: codegen emits
`rt.run_unit(i, module, ...)`, which also releases the unit after its forward and arms
its backward re-gather/reduce-scatter). With export capture a unit is a region of aten
nodes; its gather is placed before the region and a RELEASE marker after it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from shardc.dsl.errors import ShardcError
from shardc.lowering import factors

__all__ = ["Call", "NodeInfo", "MARKERS", "info", "units_of", "capture_mode", "sharded", "PassError"]


class PassError(ShardcError):
    """An invariant of the pass pipeline does not hold (a compiler bug or an unsupported graph)."""


class Call(enum.Enum):
    """What a graph node calls: model code (COMPUTE) or a runtime primitive that codegen
    emits as `rt.<value>(...)` (not the lowering's collective kind, `shardc.lowering.Op`)."""
    COMPUTE = "compute"
    BEGIN_FORWARD = "begin_forward"
    ISSUE_GATHER = "issue_gather"
    WAIT_GATHER = "wait_gather"
    RUN_UNIT = "run_unit"
    RELEASE = "release"
    END_FORWARD = "end_forward"

    def __repr__(self) -> str:
        return f"Call.{self.name}"


@dataclass(frozen=True, slots=True)
class NodeInfo:
    unit: int                 # index into the unit table (0 = root)
    op: Call = Call.COMPUTE
    line: int = 0             # strategy line that caused this node (0: none)


def begin_forward():
    """Marker: gather the root unit, arm the backward callback."""


def issue_gather(unit: int):
    """Marker: start the async all-gather of a unit's parameters."""


def wait_gather(unit: int):
    """Marker: block until the unit's full parameters are in place."""


def release(unit: int):
    """Marker: free a unit's gathered parameters after its region (export capture)."""


def end_forward(out):
    """Marker: release the root unit when no gradient is needed."""
    return out


MARKERS = {begin_forward: Call.BEGIN_FORWARD, issue_gather: Call.ISSUE_GATHER, wait_gather: Call.WAIT_GATHER,
           release: Call.RELEASE, end_forward: Call.END_FORWARD}
TARGET = {op: fn for fn, op in MARKERS.items()}


def info(node) -> NodeInfo | None:
    return node.meta.get("shardc")


def capture_info(gm):
    try:
        return gm.meta["shardc"]
    except KeyError:
        raise PassError("the graph carries no capture info (gm.meta['shardc']); capture it first") from None


def units_of(gm) -> tuple:
    return capture_info(gm).units


def capture_mode(gm) -> str:
    return capture_info(gm).mode


def sharded(unit, strategy) -> bool:
    """Does this unit's forward need a parameter all-gather (s_P > 1, the lowering's factor)?"""
    return bool(unit.params) and factors(unit.scopes, strategy.mesh).p > 1


def marker_nodes(graph, op: Call) -> list:
    return [n for n in graph.nodes if info(n) is not None and info(n).op is op]
