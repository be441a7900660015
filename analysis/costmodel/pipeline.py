"""The pass pipeline — part of the cost model (analysis): one micro-batch's forward and
backward replayed on the plan's schedule, compute against links.

Input: the lowered plan (`shardc.lowering`: its units' rows and its `Schedule`), a
bandwidth model, the compute seconds of one micro-batch and each unit's share of it.
Output: the seconds one micro-batch's forward and backward take, their compute included,
which `timing.step_time` adds up ([Note: step time] there).

[Note: pass pipeline]
The engine (runtime/engine.py, [Note: schedule]) issues what the `Schedule` names, so
the micro-batch is replayed event by event on two resources: the cores, which run the
units' compute in order, and the links, which run the issued collectives one at a time
in issue order (a collective's link wait only: the seconds it occupies the cores are
added by `step_time`). A collective goes out when the cores reach the point that issues
it, or when the links come free. Forward, a unit's compute (a third of the micro-batch,
split by its share) starts once its gather is in: the root's stage issues first, each
stage issues its prefetches, and the root's own compute (its head: the embedding lookup
costs no FLOPs) runs after the last block. Backward (two thirds): the root's head first,
with nothing on the links, since the first backward stage is issued by the hook on the
last block's outputs; then each block in backward order issues its stage's re-gathers,
waits its own, computes, and issues its reduction (the non-gather backward rows), which
first waits the previous unit's (at most one in flight); the root's goes out when the
backward ends, and the final callback waits it. So a link-bound pass shows the compute
that runs while the links are idle (the forward's last block and head, the backward's
head), and a compute-bound one the first gather and the last two reductions.
"""
from __future__ import annotations

from shardc.dsl.ir import Collectives, Mesh
from shardc.lowering import Op, Phase

from shardc.analysis.costmodel.overlap import unit_waits


class _Links:
    """The links as one server: collectives in issue order, one at a time."""

    def __init__(self) -> None:
        self.free = 0.0
        self.done: dict[int, float] = {}

    def issue(self, at: float, seconds: float) -> float:
        self.free = max(at, self.free) + seconds
        return self.free


def _waits(plan, phase: Phase, mesh: Mesh, bw, algo: Collectives, costs, gather: bool) -> list[float]:
    """Per unit: the link waits of its `phase` rows that are gathers (`gather`) or not."""
    out = []
    for i in range(len(plan.units)):
        total = unit_waits(plan, i, phase, mesh, bw, algo, costs)
        ag = unit_waits(plan, i, phase, mesh, bw, algo, costs, Op.ALL_GATHER)
        out.append(ag if gather else total - ag)
    return out


def _run(stage, waits, links: _Links, t: float) -> float:
    """Issue `stage`'s gathers at `t` (and the unit's own, when no stage did); return
    when the unit's gather is in."""
    for j in stage.issue:
        links.done[j] = links.issue(t, waits[j])
    if waits[stage.unit] > 0 and stage.unit not in links.done:
        links.done[stage.unit] = links.issue(t, waits[stage.unit])
    return max(t, links.done.pop(stage.unit, t))


def micro_batch(plan, mesh: Mesh, bw, algo: Collectives, costs, *, compute: float, shares) -> float:
    """Seconds of one micro-batch's forward and backward; see [Note: pass pipeline].
    `costs` = timing.phase_costs; `shares[i]`: unit i's share of the compute, root first."""
    fwd, bwd = compute / 3, 2 * compute / 3
    gf = _waits(plan, Phase.FORWARD, mesh, bw, algo, costs, gather=True)
    gb = _waits(plan, Phase.BACKWARD, mesh, bw, algo, costs, gather=True)
    rb = _waits(plan, Phase.BACKWARD, mesh, bw, algo, costs, gather=False)
    links, t = _Links(), 0.0
    for st in plan.schedule.forward:
        t = _run(st, gf, links, t)
        t += fwd * shares[st.unit] if st.unit != 0 else 0.0
    t += fwd * shares[0] + bwd * shares[0]          # the head, forward then backward
    links.done.clear()
    reduced = 0.0                                   # when the previous unit's reduction is in
    for st in plan.schedule.backward:
        t = _run(st, gb, links, t) + bwd * shares[st.unit]
        if rb[st.unit] > 0:
            t = max(t, reduced)
            reduced = links.issue(t, rb[st.unit])
    t = max(t, reduced)
    return max(t, links.issue(t, rb[0]) if rb[0] > 0 else t, links.free)
