"""Graph pass 1: annotate units (captured graph -> graph with `NodeInfo(unit)` on every node).

Input: a GraphModule from `capture` (its `meta["shardc"]` holds the unit table in forward
order). Output: the same graph, each node's `meta["shardc"] = NodeInfo(unit=i)`: the
unit whose module it calls (fx: `call_module` of a unit module, op RUN_UNIT) or whose
region it lies in (export: outermost unit on `nn_module_stack`); 0 for the root unit.
"""
from __future__ import annotations

from shardc.compiler.passes.meta import Call, NodeInfo, capture_mode, units_of


def _module_index(units) -> dict[str, int]:
    return {m: i for i, u in enumerate(units) if i > 0 for m in u.modules}


def annotate_units(gm, strategy):
    index = _module_index(units_of(gm))
    fx_mode = capture_mode(gm) == "fx"
    for node in gm.graph.nodes:
        if fx_mode:
            unit = index.get(node.target, 0) if node.op == "call_module" else 0
            node.meta["shardc"] = NodeInfo(unit, Call.RUN_UNIT if unit else Call.COMPUTE)
        else:
            unit = 0
            for path, _ in (node.meta.get("nn_module_stack") or {}).values():
                if path in index:
                    unit = index[path]
                    break
            node.meta["shardc"] = NodeInfo(unit)
    return gm
