"""The step pipeline — part of the cost model (analysis): one optimizer step replayed on
the plan's schedule, compute against links.

Input: the lowered plan (`shardc.lowering`: its units' rows and its `Schedule`), a
bandwidth model with its cost function (`timing.phase_costs`), the compute seconds of
one micro-batch, each unit's share of it and the micro-batches per step. Output: the
seconds of the step's micro-batches with the forward's, backward's and sync's link
waits placed where the engine waits them (`step`), and the update phase's exposed waits
(`update_wait`), which `timing.step_time` adds to the seconds collectives occupy the
cores ([Note: step time] there).

[Note: pass pipeline]
The engine (runtime/eager/engine.py, [Note: schedule]) issues what the `Schedule` names, so
each micro-batch is replayed event by event: the cores run the units' compute in order;
each link runs the collectives issued on it one at a time, in issue order (a
collective's link wait only), and different links run at once. A collective's link is
the outermost level its group spans (`node`: the NICs; `gpu`: within a node), the one
that bounds it, or the level whose links that level shares ([Note: shared links] in
network.py). A collective goes out when the cores reach the point that issues it, or
when its link comes free. Forward, a unit's compute
(a third of the micro-batch, split by its share) starts once its gather is in: the
root's stage issues first, each stage issues its prefetches, and the root's own compute
(its head: the embedding lookup costs no FLOPs) runs after the last block. Backward (two
thirds): the root's head first, with nothing new on the links, since the first backward
stage is issued by the hook on the last block's outputs; then each block in backward
order issues its stage's re-gathers, waits its own, computes, issues its reduction (the
non-gather backward rows) and waits the previous unit's (at most one in flight); the
root's gradients are in when the backward ends, and the final callback waits its
reduction. So a link-bound pass shows the compute that runs while the links are idle
(the forward's last block and head, the backward's head), and a compute-bound one its
first gathers, the backward's first re-gather and the last two reductions.

[Note: sync overlap]
On the backward that ends the step, with the `early_sync` plan pass, unit i's step sync
(the SYNC rows) goes out when the next unit's gradients are in, right after the engine
has waited unit i's reduction; the root's, when the backward ends. A sync's first stage
is its reduce-scatter, or its all-reduce when it has none (runtime/groups/flat_group.py
`sync_issue`); an all-reduce after a reduce-scatter goes out when the next unit's sync
is issued, the last two units' at opt.step() (runtime/eager/engine.py `_bound_reductions`), which
waits them all; the cores wait the reduce-scatter before issuing it (`sync_advance`).
Without the pass every sync is issued when the backward ends, their all-reduces at
opt.step().

[Note: deferred update overlap]
With the `defer_update` plan pass (lowering/passes/defer_update.py) opt.step() only
issues the update all-gathers; unit i's is waited right before unit i is next needed in
the next forward. Their link waits therefore hide behind the next step's first forward
(1/3 of a micro-batch's compute, less that forward's own waits), except the first
deferred unit's share (w/d for d deferred units, issued in forward order), which the
forward needs before it can start. (Replaying each unit's update on the links, waited
before the unit runs, predicted PaRO-IIG's first micro-batch 1.2 s longer than the
others on the emulated cluster, where it measured 0.34 s longer: the time between
opt.step() and the next forward carries them, which the step model does not see; the
rule above comes closer.) Without the pass (or with `prefetch 0`) the update phase is
exposed whole.
"""
from __future__ import annotations

from typing import NamedTuple

from shardc.dsl.ir import Collectives, Mesh
from shardc.lowering import Op, Phase

Parts = dict[str, float]   # link (the outermost level a collective's group spans) -> link-wait seconds


class Waits(NamedTuple):
    """Per unit (root first), the link waits of one run of its rows, by link."""
    gather: list[Parts]          # forward all-gathers
    regather: list[Parts]        # backward all-gathers
    reduce: list[Parts]          # the other backward rows
    sync: list[tuple[Parts, Parts | None]]   # the step sync's stages (None: no second)


def waits_of(plan, mesh: Mesh, bw, algo: Collectives, costs, meshes=None) -> Waits:
    """Every unit's link waits, by the role the engine gives them (`costs` =
    timing.phase_costs; a row is over its placement's mesh in `meshes`)."""
    on = lambda level: bw.key(mesh, level)     # [Note: shared links] in network.py

    def w(i, phase, keep=lambda r: True) -> Parts:
        out: Parts = {}
        for r in (r for g in plan.units[i].groups for r in g.rows if r.phase is phase and keep(r)):
            cost, busy = costs([(r, 1)], mesh, bw, algo, meshes)
            out[on(r.levels[0])] = out.get(on(r.levels[0]), 0.0) + cost[phase.value] - busy[phase.value]
        return out

    def sync(i) -> tuple[Parts, Parts | None]:
        """The reduce-scatter, then the all-reduce; or the all-reduce alone (runtime/groups/flat_group.py
        `sync_issue`)."""
        ops = {r.op for g in plan.units[i].groups for r in g.rows if r.phase is Phase.SYNC}
        ar = w(i, Phase.SYNC, lambda r: r.op is Op.ALL_REDUCE)
        if Op.REDUCE_SCATTER not in ops:
            return ar, None
        return w(i, Phase.SYNC, lambda r: r.op is Op.REDUCE_SCATTER), ar if Op.ALL_REDUCE in ops else None

    n = range(len(plan.units))
    is_ag = lambda r: r.op is Op.ALL_GATHER
    return Waits([w(i, Phase.FORWARD) for i in n], [w(i, Phase.BACKWARD, is_ag) for i in n],
                 [w(i, Phase.BACKWARD, lambda r: not is_ag(r)) for i in n], [sync(i) for i in n])


class _Links:
    """One server per link: the collectives on it in issue order, one at a time; `done[j]`
    when unit j's pending gather is in."""

    def __init__(self) -> None:
        self.free: dict[str, float] = {}
        self.done: dict[int, float] = {}

    def issue(self, at: float, parts: Parts) -> float:
        """Issue a collective at `at`; when it is in on every link it uses."""
        end = at
        for link, sec in parts.items():
            if sec > 0:
                self.free[link] = max(at, self.free.get(link, 0.0)) + sec
                end = max(end, self.free[link])
        return end

    @property
    def last(self) -> float:
        return max(self.free.values(), default=0.0)


def _run(stage, waits: list[Parts], links: _Links, t: float) -> float:
    """Issue `stage`'s gathers at `t` (and the unit's own, when no stage did); return when
    the unit's gather is in."""
    for j in stage.issue:
        links.done[j] = links.issue(t, waits[j])
    if stage.unit not in links.done and any(v > 0 for v in waits[stage.unit].values()):
        links.done[stage.unit] = links.issue(t, waits[stage.unit])
    return max(t, links.done.pop(stage.unit, t))


def _forward(plan, w: Waits, links: _Links, t: float, fwd: float, shares) -> float:
    """When the forward that starts at `t` ends ([Note: pass pipeline])."""
    for st in plan.schedule.forward:
        t = _run(st, w.gather, links, t)
        t += fwd * shares[st.unit] if st.unit != 0 else 0.0
    return t + fwd * shares[0]                      # the head


class _Sync:
    """The step sync's stages on `links`: the second waits (on the cores) for the first."""

    def __init__(self, w: Waits, links: _Links) -> None:
        self.w, self.links, self.first_in = w, links, {}

    def first(self, i: int, t: float) -> None:
        self.first_in[i] = self.links.issue(t, self.w.sync[i][0])

    def second(self, i: int, t: float) -> float:
        if self.w.sync[i][1] is None:
            return t
        t = max(t, self.first_in[i])
        self.links.issue(t, self.w.sync[i][1])
        return t


def _backward(plan, w: Waits, links: _Links, t: float, bwd: float, shares, early: bool) -> float:
    """When the backward that starts at `t` ends, its syncs issued when `early`
    ([Note: pass pipeline], [Note: sync overlap])."""
    t += bwd * shares[0]                            # the head's backward
    stages = {st.unit: st for st in plan.schedule.backward}
    chain = set(plan.backward_order())             # units whose gradients the engine reduces
    sync, reduced, prev, earlier = _Sync(w, links), t, None, None
    for u in [st.unit for st in plan.schedule.backward] + [0]:
        if u != 0:
            t = _run(stages[u], w.regather, links, t) + bwd * shares[u]
        if u not in chain:
            continue
        mine = links.issue(t, w.reduce[u])
        t, reduced = max(t, reduced), mine          # wait the previous unit's reduction
        if early:                                   # the previous unit's sync goes out
            if prev is not None:
                sync.first(prev, t)
                if earlier is not None:             # and the one before advances
                    t = sync.second(earlier, t)
            prev, earlier = u, prev
    t = max(t, reduced)                             # the final callback
    if early:                                       # the last unit's sync, then opt.step()'s
        sync.first(prev, t)
        for i in sorted(i for i in (earlier, prev) if i is not None):
            t = sync.second(i, t)
    return t


def micro_batch(plan, w: Waits, *, compute: float, shares, last: bool) -> float:
    """Seconds of one micro-batch's forward and backward, up to the step's sync waited
    when it is the `last`; see [Note: pass pipeline] and [Note: sync overlap]."""
    links = _Links()
    t = _forward(plan, w, links, 0.0, compute / 3, shares)
    early = last and bool(plan.schedule.sync_early)
    t = _backward(plan, w, links, t, 2 * compute / 3, shares, early)
    if last and not early:                          # every sync issued when the backward ends
        sync = _Sync(w, links)
        for i in range(len(plan.units)):
            sync.first(i, t)
        for i in range(len(plan.units)):
            t = sync.second(i, t)
    return max(t, links.last)


def step(plan, w: Waits, *, compute: float, shares, micro_batches: int) -> float:
    """Seconds of one step's `micro_batches` micro-batches ([Note: pass pipeline])."""
    one = micro_batch(plan, w, compute=compute, shares=shares, last=False)
    return (max(1, micro_batches) - 1) * one + micro_batch(plan, w, compute=compute, shares=shares, last=True)


def update_wait(w: float, deferred: int, free: float) -> float:
    """Exposed seconds of the update phase's link waits `w`; see [Note: deferred update
    overlap]. `deferred`: units whose update all-gather the schedule defers; `free`: the
    first forward's compute its own waits leave free."""
    if not deferred:
        return w
    return max(w / deferred, w - max(0.0, free))
