"""The whole-step mode's compile backend — stage: runtime (Inductor, with the plan's schedule).

Input: the FX graphs dynamo and AOTAutograd make of the micro-batch (forward and backward)
and of the step boundary, their funcol nodes tagged with the unit they gather
(`GATHER_TAG`, graph/step.py), the plan's `Schedule`, and the group -> levels map.
Output: `ScheduledInductor`, a torch.compile backend: Inductor's `compile_fx`, with one
post-grad pass of shardc's own (`follow_schedule`) and a record of every compiled graph's
collectives in the order they are issued (`graphs`: what `sm.runtime.collectives()` prints).

[Note: the schedule stays the language's]
Traced, each unit gathers right where its module starts (forward) and, recomputed by the
partitioner, right before its backward. `follow_schedule` then moves each gather's issue
(its first functional collective and the ops it needs, never its wait) to where the plan's
`Schedule` issues it: forward, the stage of unit i issues the gathers its `issue` lists
(G[i+k] for prefetch k; the root's stage G[0..k)), after unit i's own gather is in and
before its compute; backward, the same with the backward stages. A multi-stage
(hierarchical) gather issues its first stage there; its later stages follow its waits,
as in the eager runtime. Inductor's own collective passes (reordering, bucketing) stay off
(`reorder_for_compute_comm_overlap` is False), and so does its peak-memory reordering
(`reorder_for_peak_memory`): that pass re-sorts the scheduler's nodes by a memory heuristic
(the best of several topological sorts by estimated peak), which sinks each collective —
its output is a fresh buffer — down to just before its wait, after all the compute the
plan put between them (measured: every prefetch, every reduce-scatter in flight and the
early sync were issued right before their waits). So these and the passes below are the
only moves, and the recorded order is the generated code's: it issues and waits each
collective where the FX graph does. The cost is the FX order's transient memory, not the
re-sorted one's (Inductor's estimate: up to +40 % of a backward graph's buffers).

[Note: one reduce-scatter in flight]
Traced, each unit's gradient reduce-scatter is waited (and its later stages, its sum on
gloo, its decode) right where it is issued, so the next unit's backward waits for the
link. `overlap_reduce_scatters` follows the eager runtime's rule instead
(runtime/eager/engine.py [Note: schedule]: issuing a reduce-scatter waits the previous one):
the wait of a chain's first stage (and what it feeds, up to its next stage's issue) moves
to just before the next chain's first issue, so one full-size gradient is in flight while
the next unit's backward computes; a hierarchical chain's stage j waits j chains later,
one collective per stage in flight, a pipeline over the levels. Chains are the
reduce-scatters whose input no other one feeds, in graph order (an HO-Ring piece is its
own); what several chains feed (the pieces' `cat`) and what runs out of chains goes to
the graph's end. Only waits and their consumers move, never an issue ahead of its place.

[Note: the update waited where it is needed]
A forward that waits deferred updates (graph/step.py [Note: deferred update as graphs])
traces each wait (`shardc::await_update`) at its start, in forward order.
`wait_updates_where_needed` moves each unit's wait to just before the first node that
reads it — that unit's gather issue, wherever `follow_schedule` put it, or its
compute — so each update's
all-gather, issued at opt.step(), stays in flight over the compute of the units before
it, as the eager runtime waits a deferred update right before its unit is needed. A
unit's gather issue chain stops at its update (`_issue_chain`).
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
from torch._inductor import config as inductor_config

from shardc.lowering import Schedule

from .funcol import AS_TAG
from .secondary import resolve_secondary
from .update import AWAIT

GATHER_TAG = "shardc_gather"          # node.meta["custom"][GATHER_TAG] = the unit the node gathers
UPDATE_TAG = "shardc_update"          # node.meta["custom"][UPDATE_TAG] = the unit whose deferred update it runs
_C10D = torch.ops._c10d_functional
_AG = _C10D.all_gather_into_tensor.default
WAITS = (_C10D.wait_tensor.default,)
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
ISSUES = {_C10D.all_gather_into_tensor.default: "all_gather", _C10D.reduce_scatter_tensor.default: "reduce_scatter",
          _C10D.all_reduce.default: "all_reduce", _C10D.all_to_all_single.default: "all_to_all"}


def _unit(node) -> int | None:
    return (node.meta.get("custom") or {}).get(GATHER_TAG)


def _updating(node) -> int | None:
    return (node.meta.get("custom") or {}).get(UPDATE_TAG)


def _group(node) -> str:
    return node.args[-1] if isinstance(node.args[-1], str) else str(node.args[-1])


def _issue_chain(graph, unit: int) -> list:
    """The nodes that issue `unit`'s gather: its first all-gather and every node it depends
    on that is not yet computed at the graph's start (casts, quantization, a padding
    `cat`), in graph order."""
    first = next((n for n in graph.nodes if n.op == "call_function" and n.target is _AG and _unit(n) == unit),
                 None)
    if first is None:
        return []
    need, todo = {first}, [first]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a.op == "call_function" and a not in need and _updating(a) is None:
                need.add(a)
                todo.append(a)
    return [n for n in graph.nodes if n in need]


def _last_gather(graph, unit: int):
    """Where `unit`'s own gather is in: the wait of its last all-gather (later stages, casts
    and decoding follow before its compute, which is where the stage's issues go)."""
    gathers = [n for n in graph.nodes if n.target is _AG and _unit(n) == unit]
    waits = [u for u in gathers[-1].users if u.target in WAITS]
    return waits[0] if waits else gathers[-1]


def follow_schedule(graph, stages) -> None:
    """[Note: the schedule stays the language's] for one graph and its stages. An issue
    that depends on a collective (it cannot start before that one's wait) stays where it is."""
    present = {_unit(n) for n in graph.nodes if n.target is _AG} - {None}
    for st in stages:
        if st.unit not in present:
            continue
        after = _last_gather(graph, st.unit)
        for j in st.issue:
            if j == st.unit or j not in present:
                continue
            chain = _issue_chain(graph, j)
            order = {n: i for i, n in enumerate(graph.nodes)}
            if any(n.target in WAITS for n in chain) or order[chain[-1]] < order[after]:
                continue
            for n in chain:
                after.append(n)
                after = n


def wait_updates_where_needed(graph) -> None:
    """[Note: the update waited where it is needed] for a forward graph."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for wait in [n for n in graph.nodes if n.target is AWAIT]:
        min(wait.users, key=order.__getitem__).prepend(wait)


_REDUCES = (_C10D.reduce_scatter_tensor.default, _C10D.all_to_all_single.default)


def overlap_reduce_scatters(graph) -> None:
    """[Note: one reduce-scatter in flight] for a backward graph."""
    reduces = [n for n in graph.nodes if n.op == "call_function" and n.target in _REDUCES]
    later = set().union(*[_downstream(_waits(r)) for r in reduces]) if reduces else set()
    starts = [r for r in reduces if r not in later]
    reach = {s: _downstream([s]) for s in starts}
    shared = {n for s in starts for n in reach[s] if sum(n in reach[t] for t in starts) > 1}
    out = next(iter(graph.find_nodes(op="output")))
    for k, s in enumerate(starts):
        chain = [r for r in reduces if r in reach[s]]
        for j, r in enumerate(chain):
            stop = _downstream(_waits(chain[j + 1])) if j + 1 < len(chain) else set()
            seg = _downstream(_waits(r)) - stop - shared
            anchor = starts[k + j + 1] if k + j + 1 < len(starts) else out
            for n in [n for n in graph.nodes if n in seg]:
                anchor.prepend(n)
    for n in [n for n in graph.nodes if n in shared]:
        out.prepend(n)
    graph.lint()


def _waits(node) -> list:
    return [u for u in node.users if u.target in WAITS]


def _downstream(nodes) -> set:
    """`nodes` and everything computed from them, but the graph's output."""
    out, todo = set(), list(nodes)
    while todo:
        n = todo.pop()
        if n.op != "output" and n not in out:
            out.add(n)
            todo.extend(n.users)
    return out


def compile_own(fn, backend):
    """`torch.compile(fn)` (a bound method), one graph, static shapes, on a copy of its code:
    dynamo keeps its compiled graphs per code object, so every ShardedModule's graphs are
    its own (no recompiles between modules, no recompile limit across many of them, never
    dynamic shapes from another module's sizes)."""
    func = fn.__func__
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    return torch.compile(types.MethodType(own, fn.__self__), backend=backend, fullgraph=True, dynamic=False)


@dataclass
class CompiledGraph:
    kind: str                                    # "forward" | "backward" (AOTAutograd's halves)
    collectives: list = field(default_factory=list)   # (op, levels, bytes, unit or None), issue order;
                                                      # ("matmul", (), 0, None) marks the compute between,
                                                      # ("wait", levels, bytes, None) a reduce-scatter's wait,
                                                      # ("wait", (), bytes, unit) a deferred update's
    code: str = ""                               # Inductor's generated code (what runs)


class ScheduledInductor:
    """torch.compile backend: Inductor following the plan's schedule (see Note)."""

    def __init__(self, schedule: Schedule, levels_of: dict[str, tuple[str, ...]], secondaries=None):
        self.schedule, self.levels_of, self.secondaries = schedule, levels_of, secondaries
        self.graphs: list[CompiledGraph] = []

    def __call__(self, gm, example_inputs):
        from torch._functorch import config as functorch_config
        from torch._inductor.compile_fx import compile_fx
        # AOTAutograd's cache keys on dynamo's graph and would skip `_inner` (this plan's
        # schedule pass and record); Inductor's own cache, inside it, keys on the moved graph
        with functorch_config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=self._inner)

    def _inner(self, gm, example_inputs, **kwargs):
        from torch._inductor.compile_fx import compile_fx_inner
        backward = bool(kwargs.get("is_backward"))
        stages = self.schedule.backward if backward else self.schedule.forward
        resolve_secondary(gm.graph, backward, self.secondaries, GATHER_TAG)
        follow_schedule(gm.graph, stages)
        if backward:
            overlap_reduce_scatters(gm.graph)
        else:
            wait_updates_where_needed(gm.graph)
        gm.recompile()
        record = self._record("backward" if backward else "forward", gm.graph)
        self.graphs.append(record)
        with inductor_config.patch(reorder_for_compute_comm_overlap=False, reorder_for_peak_memory=False):
            compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        record.code = getattr(compiled, "source_code", "")
        return compiled

    def _record(self, kind: str, graph) -> CompiledGraph:
        out = CompiledGraph(kind)
        for n in graph.nodes:
            if n.op == "call_function" and n.target in ISSUES:
                op = (n.meta.get("custom") or {}).get(AS_TAG, ISSUES[n.target])
                out.collectives.append((op, self.levels_of.get(_group(n), ()), _bytes(n), _unit(n)))
            elif n.op == "call_function" and n.target in MATMULS:
                out.collectives.append(("matmul", (), 0, None))
            elif n.op == "call_function" and n.target in WAITS and n.args[0].target in _REDUCES:
                r = n.args[0]
                out.collectives.append(("wait", self.levels_of.get(_group(r), ()), _bytes(r), None))
            elif n.op == "call_function" and n.target is AWAIT:        # a deferred update's all-gather
                t = n.args[0].meta["val"]
                out.collectives.append(("wait", (), t.numel() * t.element_size(), _updating(n)))
        return out


def _bytes(node) -> int:
    """A collective's logical bytes as the ledger counts them: an all-gather's output (its
    input times the group size), a reduce-scatter's, all-reduce's or all-to-all's input."""
    t = node.args[0].meta["val"]
    n = t.numel() * t.element_size()
    return n * node.args[1] if node.target is _AG else n
