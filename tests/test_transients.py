"""The runtime's transient bounds (shardc.lowering [Note: syncs in flight], [Note: staging
chunks], [Note: receive blocks]): the rule's numbers, a staged hierarchical all-reduce exact
and within its staging bound (torch's MemTracker), and a step-end sync with at most
SYNC_IN_FLIGHT groups in flight, in parity with one process."""
from __future__ import annotations

import copy

import pytest
import torch

from shardc.dsl.ir import Collectives
from shardc.lowering import RS_RECV_BYTES, RS_RECV_FLOOR, STAGING_OVER, SYNC_IN_FLIGHT, recv_block_bytes
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
    from shardc.runtime import collectives as C
    from shardc.runtime.mesh import ShardMesh
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
    """n divisible by the inner level (no padded copy): each of the algorithm's pieces holds
    at most STAGING_OVER blocks of STAGING_BYTES at a time (the block, its scatter chunk,
    the gloo reduce-scatter's receive buffer, the stages' own buffers), never all n."""
    import shardc.algorithms as A
    n, staging = 4 * 8192, 4096
    for algo, exact, peak in dist_run(4, _staged_all_reduce, staging, n)[0]:
        pieces = A.resolve(algo, ("node", "gpu")).pieces
        assert exact, algo
        assert peak <= STAGING_OVER * pieces * staging, (algo, peak)
        assert peak < n * 4, (algo, peak)            # before: a copy of all n elements


def _bounded_sync(rank, world):
    from shardc.runtime import shard_module
    from shardc.runtime.flat_group import FlatGroup
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
