"""The graph passes — compiler stage `graph passes` (captured graph -> scheduled graph), in
the order they run.

Each pass is `(graph_module, strategy) -> graph_module`, writes `node.meta["shardc"]`,
and lives in its own file. `GRAPH_PASSES` is the one place the order is fixed.
"""
from __future__ import annotations

from shardc.compiler.passes.annotate_units import annotate_units
from shardc.compiler.passes.check import check
from shardc.compiler.passes.insert_collectives import insert_collectives
from shardc.compiler.passes.schedule_overlap import schedule_overlap

__all__ = ["GRAPH_PASSES", "run_passes", "annotate_units", "insert_collectives", "schedule_overlap", "check"]

GRAPH_PASSES = (annotate_units, insert_collectives, schedule_overlap, check)


def run_passes(gm, strategy, passes=GRAPH_PASSES):
    for p in passes:
        gm = p(gm, strategy)
    return gm
