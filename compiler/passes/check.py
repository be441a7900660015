"""Graph pass 4: check (scheduled graph -> the same graph, or a PassError).

Input: a graph after `schedule_overlap`. Output: the graph unchanged. Invariants:
- the unit table obeys the unit-membership rule (`shardc.units.unit_members`, [Note: unit
  membership], the rule `shard_module` applies too) over the model's parameters: every
  parameter lies in exactly one unit (tied aliases count once);
- every issued gather is waited and released (fx: the RUN_UNIT that follows it
  releases; export: a RELEASE marker), and `begin_forward` is closed by `end_forward`;
- no gather is issued after its first use: issue < wait < first node of the unit.
"""
from __future__ import annotations

from shardc.compiler.passes.meta import Call, PassError, capture_info, info, units_of
from shardc.units import unit_members


def _check_schedule(gm, units) -> None:
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    ops = [(info(n).op, info(n).unit, n) for n in nodes if info(n) is not None]
    begins = [n for op, _, n in ops if op is Call.BEGIN_FORWARD]
    ends = [n for op, _, n in ops if op is Call.END_FORWARD]
    if len(begins) != 1 or len(ends) != 1 or pos[begins[0]] > pos[ends[0]]:
        raise PassError("the forward must open with one begin_forward and close with one end_forward")
    releasing = Call.RUN_UNIT if capture_info(gm).mode == "fx" else Call.RELEASE
    pending: dict[int, list[str]] = {}
    for op, unit, n in ops:
        if op is Call.ISSUE_GATHER:
            if pending.get(unit):
                raise PassError(f"unit {units[unit].name}: gather issued twice before it is used")
            pending[unit] = ["issued"]
        elif op is Call.WAIT_GATHER:
            if pending.get(unit) != ["issued"]:
                raise PassError(f"unit {units[unit].name}: waited on a gather that was not issued before")
            pending[unit].append("waited")
        elif op is Call.RUN_UNIT or (op is Call.COMPUTE and unit):
            if unit in pending and pending[unit] == ["issued"]:
                raise PassError(f"unit {units[unit].name}: used before its gather was waited on")
        if op is releasing and unit in pending:
            if pending[unit] != ["issued", "waited"]:
                raise PassError(f"unit {units[unit].name}: released before its gather completed")
            del pending[unit]
    if pending:
        raise PassError(f"unit {units[min(pending)].name}: gather issued but never released")


def check(gm, strategy):
    units = units_of(gm)
    unit_members(units, capture_info(gm).canonical, PassError)
    _check_schedule(gm, units)
    return gm
