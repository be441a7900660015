"""Graph pass 2: insert collectives (annotated graph -> graph with runtime marker nodes).

Input: a graph annotated by `annotate_units`. Output: the same graph with
- `begin_forward()` after the inputs (gathers the root unit) and `end_forward(out)`
  around the output;
- before every unit call/region whose params are sharded (s_P > 1): `issue_gather(i)`
  then `wait_gather(i)` (adjacent; `schedule_overlap` moves the issue earlier); a unit
  called several times in one forward (a bucket of modules) only before its first call;
- export capture only: `release(i)` after each unit region (with fx capture the
  RUN_UNIT call itself releases and arms the backward collectives).
Each marker's `NodeInfo.line` is the strategy line of the `params` statement that
scopes the unit (the `grads` line for RUN_UNIT when grads are sharded).
"""
from __future__ import annotations

from shardc.compiler.passes.meta import TARGET, Call, NodeInfo, capture_mode, info, sharded, units_of


def _marker(graph, op: Call, unit: int, line: int, args=()):
    node = graph.call_function(TARGET[op], tuple(args))
    node.meta["shardc"] = NodeInfo(unit, op, line)
    return node


def _regions(graph) -> list[tuple[int, object, object]]:
    """(unit, first node, last node) of every maximal run of nodes of one non-root unit."""
    out, cur = [], None
    for node in graph.nodes:
        u = info(node).unit if info(node) else 0
        if cur is not None and u == cur[0]:
            cur[2] = node
            continue
        if cur is not None:
            out.append(tuple(cur))
            cur = None
        if u:
            cur = [u, node, node]
    if cur is not None:
        out.append(tuple(cur))
    return out


def _gather_before(graph, node, unit, strategy, units):
    spec = units[unit]
    if not sharded(spec, strategy):
        return
    line = spec.scopes.params.line
    with graph.inserting_before(node):
        _marker(graph, Call.ISSUE_GATHER, unit, line, (unit,))
        _marker(graph, Call.WAIT_GATHER, unit, line, (unit,))


def insert_collectives(gm, strategy):
    graph, units = gm.graph, units_of(gm)
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    root_line = units[0].scopes.params.line if sharded(units[0], strategy) else 0
    anchor = placeholders[-1] if placeholders else None
    ctx = graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(nodes[0])
    with ctx:
        _marker(graph, Call.BEGIN_FORWARD, 0, root_line)
    if capture_mode(gm) == "fx":
        seen: set[int] = set()
        for node in nodes:
            if info(node) is not None and info(node).op is Call.RUN_UNIT:
                spec = units[info(node).unit]
                g_line = spec.scopes.grads.line if strategy.mesh.factor(spec.scopes.grads.levels) > 1 else 0
                node.meta["shardc"] = NodeInfo(info(node).unit, Call.RUN_UNIT, g_line or (
                    spec.scopes.params.line if sharded(spec, strategy) else 0))
                if info(node).unit not in seen:          # a multi-call unit is gathered once
                    _gather_before(graph, node, info(node).unit, strategy, units)
                    seen.add(info(node).unit)
    else:
        for unit, first, last in _regions(graph):
            _gather_before(graph, first, unit, strategy, units)
            with graph.inserting_after(last):
                _marker(graph, Call.RELEASE, unit, units[unit].scopes.params.line, (unit,))
    with graph.inserting_before(output):
        end = _marker(graph, Call.END_FORWARD, 0, root_line, (output.args[0],))
    output.args = (end,)
    graph.lint()
    gm.recompile()
    return gm
