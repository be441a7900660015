"""Graph pass 3: schedule overlap (graph with markers -> graph with gathers issued per the plan).

Input: a graph from `insert_collectives` (each gather's issue right before its wait).
Output: the same graph with every `issue_gather` moved to where the lowering's forward
`Schedule` issues it (`shardc.lowering.schedule`, the one the runtime follows): the
root stage's issues right after `begin_forward`, a unit's stage's issues right before
that unit's wait (or its first node when it has none). Waits stay at first use.
`prefetch 0` leaves the graph unchanged (every unit issues its own gather).
"""
from __future__ import annotations

from shardc.compiler.passes.meta import Call, info, marker_nodes, sharded, units_of
from shardc.lowering import schedule


def schedule_overlap(gm, strategy):
    units = units_of(gm)
    sched = schedule([sharded(u, strategy) for u in units], strategy.prefetch)
    graph = gm.graph
    issues = {info(n).unit: n for n in marker_nodes(graph, Call.ISSUE_GATHER)}
    waits = {info(n).unit: n for n in marker_nodes(graph, Call.WAIT_GATHER)}
    first = {}
    for n in graph.nodes:
        if info(n) is not None and info(n).op is Call.RUN_UNIT:
            first.setdefault(info(n).unit, n)
    anchor = marker_nodes(graph, Call.BEGIN_FORWARD)[0]
    for stage in sched.forward:
        for j in stage.issue:
            if j not in issues or j == stage.unit and stage.unit != 0:
                continue
            if stage.unit == 0:
                anchor.append(issues[j])
                anchor = issues[j]
            else:
                (waits.get(stage.unit) or first[stage.unit]).prepend(issues[j])
    gm.recompile()
    return gm
