"""[Note: pass pipeline] (analysis/costmodel/pipeline.py) worked by hand on ZeRO-3 written
as a `.shard` file: the step time of one micro-batch replayed on the engine's schedule.

ZeRO-3 on node(2) > gpu(4), prefetch 1, flat rings, alpha-beta links with no latency:
the forward all-gathers every unit (root included), the backward re-gathers every block
(the root stays gathered) and reduce-scatters every unit; nothing in sync or update, so
the step is the pipeline alone. Units: root 2e6 parameters, three blocks of 8e6 each;
compute shares by parameters (root 2/26, each block 8/26), a third of a micro-batch's
compute forward and two thirds backward, the root's (its head) after the last block.
g0, g: the root's and a block's all-gather; r0, r: their reduce-scatters.
"""
from __future__ import annotations

import pytest

from shardc.analysis.costmodel import AlphaBeta, UnitSize
from shardc.dsl import load_strategy
from shardc.dsl.ir import Collectives

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
    return s, us, {"g0": sec("all_gather", SIZES[0]), "g": sec("all_gather", SIZES[1]),
                   "r0": sec("reduce_scatter", SIZES[0]), "r": sec("reduce_scatter", SIZES[1])}


def _step(s, us, c):
    from shardc.analysis.costmodel.timing import step_time
    t = step_time(s, us, AB, micro_batches=1, flops=1.0, mb_flops=c)
    assert t.comm["sync"] == 0 and t.comm["update"] == 0          # the pipeline alone
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

