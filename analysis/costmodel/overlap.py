"""Overlap rules of the time model — part of the cost model (analysis): which link waits
a step hides behind its compute.

Input: the lowered plan (`shardc.lowering`: its units' rows and its `Schedule`), the rows
counted per step, a bandwidth model, the compute seconds of one micro-batch and each
unit's share of it. Output: exposed seconds of the sync and update phases, which
`timing.step_time` adds up ([Note: step time] there); `unit_waits`, read by pipeline.py.

[Note: sync overlap]
The engine (runtime/engine.py) keeps one gradient reduce-scatter in flight: unit i's is
issued when its gradients are in and waited when the next unit's are. With the
`early_sync` plan pass unit i's step sync (the SYNC rows) is issued at that same moment,
on the backward that ends the step; the root's, when that backward ends. So the sync is
simulated on the backward's timeline: in backward order the root's compute comes first
(its head runs last in the forward), then each block's; a unit's gradients are in when
its own backward is done, the root's when the whole backward is (its embedding is the
last thing the backward reaches). Sync i is issued when the next unit's gradients are
in; the links run one sync at a time, starting once the backward's own reduce-scatter
waits are through; whatever finishes after the backward is exposed. A sync's first
stage is its reduce-scatter, or its all-reduce when it has none (runtime/flat.py
`sync_issue`); an all-reduce after a reduce-scatter goes out when the next unit's sync
is issued, the last two units' at opt.step() (engine.py `_bound_reductions`). Without
the pass every sync is issued when the backward ends and the whole sync phase is exposed.
(The backward's own collectives are replayed by [Note: pass pipeline], pipeline.py.)

[Note: deferred update overlap]
With the `defer_update` plan pass (lowering/passes/defer_update.py) opt.step() only
issues the update all-gathers; unit i's is waited right before unit i is next needed in
the next forward. Their link waits therefore hide behind the next step's first forward
(1/3 of a micro-batch's compute, less that forward's own waits), except the first
deferred unit's share (w/d for d deferred units, issued in forward order), which the
forward needs before it can start. The cores they occupy (k) are never hidden. Without
the pass (or with `prefetch 0`) the update phase is exposed whole.
"""
from __future__ import annotations

from shardc.dsl.ir import Collectives, Mesh
from shardc.lowering import Op, Phase


def unit_waits(plan, i: int, phase: Phase, mesh: Mesh, bw, algo: Collectives, costs, op: Op | None = None) -> float:
    """Link-wait seconds of one run of unit i's rows of `phase` (of `op` only, when given;
    `costs` = timing.phase_costs)."""
    rows = [(r, 1) for g in plan.units[i].groups for r in g.rows if r.phase is phase and op in (None, r.op)]
    cost, busy = costs(rows, mesh, bw, algo)
    return cost[phase.value] - busy[phase.value]


def _sync_stages(plan, i: int, mesh: Mesh, bw, algo: Collectives, costs) -> tuple[float, float]:
    """(waits of what unit i's sync issues first, waits of what it issues at the step):
    the reduce-scatter then the all-reduce, or the all-reduce alone when there is no
    reduce-scatter (runtime/flat.py `sync_issue`)."""
    rs = unit_waits(plan, i, Phase.SYNC, mesh, bw, algo, costs, Op.REDUCE_SCATTER)
    ar = unit_waits(plan, i, Phase.SYNC, mesh, bw, algo, costs, Op.ALL_REDUCE)
    has_rs = any(r.phase is Phase.SYNC and r.op is Op.REDUCE_SCATTER for g in plan.units[i].groups for r in g.rows)
    return (rs, ar) if has_rs else (ar, 0.0)


def sync_wait(plan, mesh: Mesh, bw, algo: Collectives, costs, *, backward: float, shares, busy: float) -> float:
    """Exposed seconds of the sync phase's link waits; see [Note: sync overlap].
    `backward`: compute seconds of the last backward; `shares[i]`: unit i's share of the
    model's compute; `busy`: seconds the links spend on that backward's own waits first."""
    order = plan.backward_order()
    stages = [_sync_stages(plan, i, mesh, bw, algo, costs) for i in order]
    if not plan.schedule.sync_early:
        return sum(a + b for a, b in stages)
    t, ready = backward * shares[0], []
    for i in order[:-1]:
        t += backward * shares[i]
        ready.append(t)
    ready.append(backward)                          # the root: when the backward ends
    issue = ready[1:] + [backward]
    jobs = []                                       # (issued at, link wait), in issue order
    for j, (first, _) in enumerate(stages):
        jobs.append((issue[j], first))
        if 1 <= j < len(stages) - 1:                # unit j's sync advances unit j-1's
            jobs.append((issue[j], stages[j - 1][1]))
    jobs += [(backward, b) for _, b in stages[-2:]]   # the last two advance at opt.step()
    link = busy
    for at, w in jobs:
        link = max(at, link) + w
    return max(0.0, link - max(backward, busy))    # waits past the backward count once, there


def update_wait(w: float, deferred: int, free: float) -> float:
    """Exposed seconds of the update phase's link waits `w`; see [Note: deferred update
    overlap]. `deferred`: units whose update all-gather the schedule defers; `free`: the
    first forward's compute its own waits leave free."""
    if not deferred:
        return w
    return max(w / deferred, w - max(0.0, free))
