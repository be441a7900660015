"""The runtime's transient bounds (shardc.lowering [Note: reductions in flight], [Note: syncs
in flight], [Note: staging chunks], [Note: receive blocks]; runtime/groups/storage.py [Note: grad
shard lifetime]): the rule's numbers; staged hierarchical all-reduces, reduce-scatters and
all-gathers exact and within their staging bound (torch's MemTracker); a step-end sync with
at most SYNC_IN_FLIGHT groups in flight; a backward with at most REDUCE_IN_FLIGHT
reduce-scatters in flight, staged in blocks, and grad shards freed by zero_grad(), in
parity with one process."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from shardc.dsl.ir import Collectives
from shardc.lowering import REDUCE_IN_FLIGHT, RS_RECV_BYTES, RS_RECV_FLOOR, STAGING_OVER, SYNC_IN_FLIGHT, recv_block_bytes
from tests.harness import dist_run
from tests.test_runtime_util import Tiny, batches, max_rel_err, reference, strategy, train_sharded, units_for

MESH = "node(2) > gpu(2)"


def test_recv_block_rule():
    assert recv_block_bytes(4 << 20) == 4 << 20                    # the output chunk itself
    assert recv_block_bytes(1000) == RS_RECV_FLOOR                 # never under the floor
    assert recv_block_bytes(1 << 30) == RS_RECV_BYTES              # never over the cap
    assert recv_block_bytes(1 << 30, cap=4096) == 4096


def _staged_all_reduce(rank, world, staging, n):
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    from shardc.dsl.ir import Level, Mesh
    from shardc.runtime.eager import collectives as C
    from shardc.runtime.transport.mesh import ShardMesh
    sm, out, bound = ShardMesh(Mesh((Level("node", 2), Level("gpu", 2)))), [], C.STAGING_BYTES
    C.STAGING_BYTES = staging             # this pooled worker runs later tests: put it back
    try:
        for algo in (Collectives.HIERARCHICAL, Collectives.HO_RING):
            t = torch.arange(n, dtype=torch.float32) * (rank + 1)
            tracker = MemTracker()
            tracker.track_external(t)
            with tracker:
                base = sum(s[_TOTAL_KEY] for s in tracker._curr_mem_snap.values())
                C.all_reduce(t, sm, ("node", "gpu"), algo=algo).wait()
            peak = max(tracker._peak_mem.values()) - base
            exact = torch.equal(t, torch.arange(n, dtype=torch.float32) * sum(range(1, world + 1)))
            out.append((algo.value, exact, peak))
    finally:
        C.STAGING_BYTES = bound
    return out


@pytest.mark.distributed
def test_staged_all_reduce_exact_and_bounded():
    """n divisible by the inner level (no padded copy): the algorithm's pieces together hold
    at most STAGING_OVER blocks' worth of STAGING_BYTES at a time (the block, its scatter chunk,
    the gloo reduce-scatter's receive buffer, the stages' own buffers), never all n."""
    import shardc.algorithms as A
    n, staging = 4 * 8192, 4096
    for algo, exact, peak in dist_run(4, _staged_all_reduce, staging, n)[0]:
        pieces = A.resolve(algo, ("node", "gpu")).pieces
        assert exact, algo
        # the pieces' blocks together at most STAGING_BYTES (`staging_block`): per piece it was 4 x
        assert peak <= STAGING_OVER * staging, (algo, pieces, peak)
        assert peak < n * 4, (algo, peak)            # before: a copy of all n elements
        # over node(2) > gpu(2) the plan scatters over gpu, all-reduces over node, gathers
        # back: the block's copy b = staging / pieces, its scatter chunk b/2 and the gloo
        # reduce-scatter's receive buffer b (the block again), per piece
        b = staging // pieces
        assert peak == pieces * (b + b // 2 + b), (algo, pieces, peak)


def _bounded_sync(rank, world):
    from shardc.runtime import shard_module
    from shardc.runtime.groups.flat_group import FlatGroup
    data = batches(2, world, 1)
    model = Tiny()
    want, _ = reference(model, data, "adamw")
    s = strategy("mics", MESH)                      # a sync per group: all-reduce over node
    sm = shard_module(copy.deepcopy(model), s, units_for(model, s.scopes), passes=())   # no early sync
    groups = [g for u in sm.runtime.units for g in u.trainables]
    seen, issue = [], FlatGroup.sync_issue

    def counting(self):
        issue(self)
        seen.append(sum(g.syncing is not None for g in groups))
    FlatGroup.sync_issue = counting
    try:
        got, _, _ = train_sharded(sm, data, rank, world, 1, "adamw")
    finally:
        FlatGroup.sync_issue = issue
    return len(groups), max(seen), max_rel_err(got, want)


@pytest.mark.distributed
def test_step_sync_bounded_in_parity():
    for n_groups, most, err in dist_run(4, _bounded_sync):
        assert n_groups > SYNC_IN_FLIGHT            # the bound is exercised
        assert most == SYNC_IN_FLIGHT
        assert err < 1e-5


def _staged_scatter_gather(rank, world, staging, m):
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    from shardc.dsl.ir import Level, Mesh
    from shardc.runtime.eager import collectives as C
    from shardc.runtime.transport.mesh import ShardMesh
    sm, out, bound = ShardMesh(Mesh((Level("node", 2), Level("gpu", 2)))), [], C.STAGING_BYTES
    levels = ("node", "gpu")
    t = torch.arange(world * m, dtype=torch.float32) * (rank + 1)
    mine = torch.arange(m, dtype=torch.float32) + 1000 * rank
    flat_rs, flat_ag = torch.empty(m), torch.empty(world * m)       # the one flat stage: the reference
    C.reduce_scatter(flat_rs, t, sm, levels, algo=Collectives.RING).wait()
    C.all_gather(flat_ag, mine, sm, levels, algo=Collectives.RING).wait()
    C.STAGING_BYTES = staging             # this pooled worker runs later tests: put it back
    try:
        for algo in (Collectives.HIERARCHICAL, Collectives.HO_RING):
            rs, ag = torch.empty(m), torch.empty(world * m)
            for what, run in (("reduce_scatter", lambda: C.reduce_scatter(rs, t, sm, levels, algo=algo).wait()),
                              ("all_gather", lambda: C.all_gather(ag, mine, sm, levels, algo=algo).wait())):
                tracker = MemTracker()
                tracker.track_external(t, mine, rs, ag)
                with tracker:
                    base = sum(s[_TOTAL_KEY] for s in tracker._curr_mem_snap.values())
                    run()
                out.append((algo.value, what, max(tracker._peak_mem.values()) - base))
            out.append((algo.value, "exact", torch.equal(rs, flat_rs) and torch.equal(ag, flat_ag)))
    finally:
        C.STAGING_BYTES = bound
    return out


@pytest.mark.distributed
def test_staged_reduce_scatter_all_gather_exact_and_bounded():
    """A staged reduce-scatter copies its input out a block at a time, a staged all-gather
    gathers a block at a time ([Note: staging chunks]): the same chunks as the one flat
    stage, and the pieces together hold at most STAGING_OVER x STAGING_BYTES, never a copy of all n."""
    import shardc.algorithms as A
    m, staging, world = 8192, 4096, 4
    n = world * m
    got = dist_run(world, _staged_scatter_gather, staging, m)[0]
    for algo, what, value in got:
        if what == "exact":
            assert value, algo
            continue
        pieces = A.resolve(algo, ("node", "gpu")).pieces
        assert value <= STAGING_OVER * staging, (algo, pieces, what, value)   # over all pieces together
        assert value < n * 4, (algo, what, value)            # before: the pieces' copies, n elements
        # each piece's block b = staging / pieces bytes of the input (a reduce-scatter) or the
        # output (an all-gather), over two stages of 2 ranks each. A reduce-scatter holds the
        # block's copy b, the first stage's output b/2 and its all-to-all's receive buffer b
        # (the stage's input again; the second stage's, b/2, reuses it). An all-gather holds
        # its first stage's output b/2 and its second's b. Exactly that in every run: the
        # blocks reuse their buffers, whenever gloo lets the last block's go.
        b = staging // pieces
        want = {"reduce_scatter": b + b // 2 + b, "all_gather": b // 2 + b}[what]
        assert value == pieces * want, (algo, pieces, what, value)


def _backward_bounded(rank, world, staging):
    from shardc.runtime.eager import collectives as C
    from shardc.runtime import shard_module
    from shardc.runtime.groups.flat_group import FlatGroup
    data = batches(2, world, 1)
    model = Tiny()
    want, _ = reference(model, data, "adamw")
    s = dataclasses.replace(strategy("zero3", MESH), collectives=Collectives.HO_RING)   # staged, both ways
    sm = shard_module(copy.deepcopy(model), s, units_for(model, s.scopes))
    groups = [g for u in sm.runtime.units for g in u.trainables]
    seen, issue, bound, piece = [], FlatGroup.reduce_grad, C.STAGING_BYTES, C._rs_piece
    blocks = []

    def counting(self, flat, pooled=True):
        issue(self, flat, pooled)
        seen.append(sum(bool(g.reducing) for g in groups))

    def block(*args):                   # one staged block of a reduce-scatter's piece
        blocks.append(1)
        return piece(*args)
    FlatGroup.reduce_grad, C._rs_piece, C.STAGING_BYTES = counting, block, staging
    try:
        got, _, _ = train_sharded(sm, data, rank, world, 1, "adamw")
        freed = sum(g.storage.grad_shard.untyped_storage().size() == 0 for g in groups)
        sm(data[0][0].chunk(world)[rank])               # a forward after zero_grad(): still none held
        after_forward = sum(g.storage.grad_shard.untyped_storage().size() == 0 for g in groups)
    finally:
        FlatGroup.reduce_grad, C._rs_piece, C.STAGING_BYTES = issue, piece, bound
    return len(groups), max(seen), len(blocks) / len(seen), freed, after_forward, max_rel_err(got, want)


@pytest.mark.distributed
def test_backward_bounded_in_parity():
    """ZeRO-3 with HO-Ring on node(2) > gpu(2), staging in blocks of one column (16 bytes):
    at most REDUCE_IN_FLIGHT backward reduce-scatters in flight ([Note: reductions in
    flight]); zero_grad() frees every grad shard (runtime/groups/storage.py [Note: grad shard lifetime]),
    and a forward does not bring them back; the model equals one process on the whole batch."""
    import shardc.algorithms as A
    pieces = A.get(Collectives.HO_RING.value).pieces
    for n_groups, most, blocks, freed, after_forward, err in dist_run(4, _backward_bounded, 16):
        assert n_groups > REDUCE_IN_FLIGHT and blocks > pieces    # the bounds are exercised
        assert most == REDUCE_IN_FLIGHT
        assert freed == after_forward == n_groups
        assert err < 1e-5
