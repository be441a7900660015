"""Pass 3: schedule overlap (graph with markers -> graph with gathers issued early).

Input: a graph from `insert_collectives` (each gather's issue right before its wait).
Output: the same graph with the `issue_gather` of the k-th gathered unit call moved
right before the wait of call k - prefetch (or right after `begin_forward` for the
first `prefetch` calls), so `prefetch` gathers are in flight while a unit computes.
Waits stay at first use. `prefetch 0` leaves the graph unchanged.
"""
from __future__ import annotations

from shardc.compiler.passes.meta import Op, marker_nodes


def schedule_overlap(gm, strategy):
    p = strategy.prefetch
    if p <= 0:
        return gm
    graph = gm.graph
    issues = marker_nodes(graph, Op.ISSUE_GATHER)
    waits = marker_nodes(graph, Op.WAIT_GATHER)
    begin = marker_nodes(graph, Op.BEGIN_FORWARD)[0]
    anchor = begin
    for k, issue in enumerate(issues):
        if k - p >= 0:
            waits[k - p].prepend(issue)
        else:
            anchor.append(issue)
            anchor = issue
    gm.recompile()
    return gm
