"""The step pipeline (analysis/costmodel/pipeline.py) worked by hand on strategies written
as `.shard` text: the step time of one micro-batch replayed on the engine's schedule.

[Note: pass pipeline] with ZeRO-3 on node(2) > gpu(4), prefetch 1, flat rings, alpha-beta links with no latency:
the forward all-gathers every unit (root included), the backward re-gathers every block
(the root stays gathered) and reduce-scatters every unit; nothing in sync or update, so
the step is the pipeline alone. Units: root 2e6 parameters, three blocks of 8e6 each;
compute shares by parameters (root 2/26, each block 8/26), a third of a micro-batch's
compute forward and two thirds backward, the root's (its head) after the last block.
g0, g: the root's and a block's all-gather; r0, r: their reduce-scatters. [Note: sync
overlap] and [Note: deferred update overlap] with ZeRO-1 on the same units. And a
hypothesis property on random meshes, scopes and units: a step lies between its busiest
link and everything in turn.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardc.analysis.costmodel import AlphaBeta, UnitSize
from shardc.dsl import load_strategy
from shardc.dsl.ir import Collectives
from shardc.lowering import Op

ZERO3 = """strategy z3
mesh node(2) > gpu(4)
params shard over world
grads  shard over world
optim  shard over world
accumulate 1
collectives ring
"""
AB = AlphaBeta(intra=1e9, inter=1e8, intra_lat=0.0, inter_lat=0.0)
SIZES = (2_000_000, 8_000_000, 8_000_000, 8_000_000)
S0, S = 2 / 26, 8 / 26


def _setup(text=ZERO3):
    s = load_strategy(text)
    us = [UnitSize("<root>" if i == 0 else f"b{i}", n, 0, s.scopes, root=i == 0) for i, n in enumerate(SIZES)]
    sec = lambda op, n: AB.seconds(op, ("node", "gpu"), 4 * n, s.mesh, Collectives.RING)
    return s, us, {"g0": sec(Op.ALL_GATHER, SIZES[0]), "g": sec(Op.ALL_GATHER, SIZES[1]),
                   "r0": sec(Op.REDUCE_SCATTER, SIZES[0]), "r": sec(Op.REDUCE_SCATTER, SIZES[1])}


def _step(s, us, c, check=True, passes=None):
    from shardc.analysis.costmodel.timing import step_time
    t = step_time(s, us, AB, micro_batches=1, flops=1.0, mb_flops=c, passes=passes)
    if check:                                                    # the passes alone
        assert t.comm["sync"] == 0 and t.comm["update"] == 0
    return t.total


def test_compute_bound_pass_shows_its_first_gathers_and_last_reductions():
    # Forward: the root's stage issues the root's gather and b1's; b1 waits both (g0 + g),
    # every later gather is prefetched behind a block. Backward: b3's stage issues b3's
    # and b2's re-gathers and waits b3's (g); each reduce-scatter hides behind the next
    # block, but b1's is waited when the root's gradients are in (r) and the root's goes
    # out when the backward ends (r0).
    s, us, x = _setup()
    c = 1000.0
    assert _step(s, us, c) == pytest.approx(c + x["g0"] + x["g"] + x["g"] + x["r"] + x["r0"], rel=1e-12)


def test_link_bound_pass_shows_the_compute_the_links_wait_for():
    # c chosen so a block's backward takes half a gather (B·S = g/2, so F·S = g/4) and
    # both are shorter than a collective: every link wait is on the critical path, plus
    # the compute that runs with the links idle: b3's forward after the last gather, the
    # head's forward and backward before the backward's first stage issues anything.
    s, us, x = _setup()
    assert x["r"] == pytest.approx(x["g"])                       # same bytes, same ring
    c = 3 * x["g"] / (4 * S)
    waits = x["g0"] + 3 * x["g"] + 3 * x["g"] + 3 * x["r"] + x["r0"]
    assert _step(s, us, c) == pytest.approx(waits + c / 3 * S + c * S0, rel=1e-12)


def test_prefetch_zero_overlaps_nothing():
    s, us, x = _setup(ZERO3 + "prefetch 0\n")
    c = 1.0
    assert _step(s, us, c) == pytest.approx(c + x["g0"] + 6 * x["g"] + 3 * x["r"] + x["r0"], rel=1e-12)



ZERO1 = ZERO3.replace("params shard over world", "params replicate").replace(
    "grads  shard over world", "grads  replicate")


def test_update_and_sync_on_a_compute_bound_step():
    # ZeRO-1: nothing in forward or backward; the step's sync reduce-scatters each unit
    # over the world (r_i) and opt.step() all-gathers each unit's update (u_i).
    # [Note: deferred update overlap]: the update all-gathers hide behind the next
    # forward but the first deferred unit's share: (u0 + u1 + u2 + u3) / 4. [Note: sync overlap]: the backward runs the head,
    # b3, b2, b1; b3's sync goes out when b2's gradients are in, while b1 still computes;
    # b2's when b1's are in and b1's when the root's are — both at the backward's end,
    # since the root's compute came first — and the root's after them: r2 + r1 + r0 show.
    s, us, _ = _setup(ZERO1)
    sec = lambda op, n: AB.seconds(op, ("node", "gpu"), 4 * n, s.mesh, Collectives.RING)
    u = [sec(Op.ALL_GATHER, n) for n in SIZES]
    r = [sec(Op.REDUCE_SCATTER, n) for n in SIZES]
    c = 1000.0
    assert _step(s, us, c, check=False) == pytest.approx(c + sum(u) / 4 + r[2] + r[1] + r[0], rel=1e-12)
    # without the plan passes every sync goes out after the backward and opt.step() waits
    # every update all-gather
    assert _step(s, us, c, check=False, passes=()) == pytest.approx(c + sum(u) + sum(r), rel=1e-12)


def test_a_sync_all_reduce_goes_out_one_unit_late():
    # Lins' 7B layout: optimizer states over the node's GPUs only. A unit's sync is a
    # reduce-scatter over gpu (rs_i), then an all-reduce of its shard over node (ar_i),
    # which goes out when the next unit's sync is issued, once its own reduce-scatter is
    # in. b3's reduce-scatter goes out while b1 computes; the rest at the backward's end
    # (b1's and the root's gradients come in then). The two stages run on different
    # links: the node link carries ar3, ar2, ar0, ar1 back to back from the backward's
    # end, each one's reduce-scatter in on the gpu link before the node link needs it
    # (rs2 at 0.024 s, rs1 at 0.048 s, rs0 at 0.054 s; the node link frees at 0.08 s
    # first), so the sync shows sum(ar) and no rs.
    text = ZERO1.replace("optim  shard over world", "optim  shard over gpu")
    s, us, _ = _setup(text)
    sec = lambda op, lv, n: AB.seconds(op, lv, n, s.mesh, Collectives.RING)
    rs = [sec(Op.REDUCE_SCATTER, ("gpu",), 4 * n) for n in SIZES]
    ar = [sec(Op.ALL_REDUCE, ("node",), n) for n in SIZES]
    u = [sec(Op.ALL_GATHER, ("gpu",), 4 * n) for n in SIZES]
    assert (rs[2], rs[2] + rs[1], rs[2] + rs[1] + rs[0], ar[3]) == pytest.approx((0.024, 0.048, 0.054, 0.08))
    c = 1000.0
    assert _step(s, us, c, check=False) == pytest.approx(c + sum(u) / 4 + sum(ar), rel=1e-12)


@st.composite
def _random_steps(draw):
    """A random mesh (2–3 levels), valid scopes (params ⊆ grads ⊆ optim), 2–6 units,
    prefetch, micro-batches, compute and plan passes."""
    from shardc.dsl.ir import GradsSpec, Level, Mesh, OptimSpec, ParamsSpec, Scopes, Strategy
    names = ("node", "gpu", "gcd")[:draw(st.integers(2, 3))]
    mesh = Mesh(tuple(Level(n, draw(st.integers(2, 4))) for n in names))
    sub = lambda lv: tuple(l for l in lv if draw(st.booleans()))
    o = sub(names)
    g = sub(o)
    p = sub(g)
    scopes = Scopes(ParamsSpec(p), GradsSpec(g), OptimSpec(o))
    s = Strategy("h", mesh, scopes, accumulate=draw(st.integers(1, 4)), prefetch=draw(st.integers(1, 2)),
                 collectives=draw(st.sampled_from([Collectives.RING, Collectives.HIERARCHICAL])))
    sizes = draw(st.lists(st.integers(0, 4_000_000), min_size=2, max_size=6))
    us = [UnitSize("<root>" if i == 0 else f"b{i}", n, 0, scopes, root=i == 0) for i, n in enumerate(sizes)]
    return s, us, draw(st.floats(1e-3, 10.0)), draw(st.sampled_from([None, ()]))


@settings(max_examples=60, deadline=None)
@given(_random_steps())
def test_the_step_lies_between_its_busiest_link_and_everything_in_turn(case):
    # Whatever the schedule, a step can be no shorter than its compute or than the waits
    # its busiest link carries in forward, backward and sync (each micro-batch ends once
    # its links are through), and no longer than compute and every collective in turn
    # (at any moment the cores compute or wait for a link that is busy).
    from shardc.analysis.costmodel.ledger import counted_rows
    from shardc.analysis.costmodel.timing import step_time
    from shardc.lowering import lower
    s, us, c, passes = case
    ab = AlphaBeta(intra=1e9, inter=1e8, intra_lat=5e-6, inter_lat=2e-5)
    t = step_time(s, us, ab, flops=1.0, mb_flops=c, passes=passes)
    rows = counted_rows(lower(s.mesh, us, s.prefetch, passes), forwards=s.accumulate, backwards=s.accumulate)
    per_link: dict[str, float] = {}
    for r, n in rows:
        if r.phase.value != "update":
            sec = ab.seconds(r.op, r.levels, r.bytes, s.mesh, s.collectives)
            per_link[r.levels[0]] = per_link.get(r.levels[0], 0.0) + n * sec
    lower_bound = max([s.accumulate * c] + list(per_link.values()))
    assert lower_bound * (1 - 1e-9) <= t.total <= (s.accumulate * c + sum(t.comm.values())) * (1 + 1e-9)
