"""Prefetch keeps at most the planned number of gathered full buffers alive.

The plan's transient window (analysis/costmodel/memory.py, docs/internals.md "Memory")
holds, besides the root, at most prefetch + 1 gathered units at once: the unit that
runs and the k gathers issued ahead of it. The runtime must not exceed that in the
forward nor in the backward (where a residual block's input gradient arrives, and the
next unit's re-gather is asked for, before the block itself is done). Counted here from
the storage actually allocated (a full buffer whose storage has size > 0 is alive) at
every runtime event of two accumulated steps, for prefetch 0, 1 and 2, with a
4-block model so that k + 2 units could be alive if nothing capped them, with and
without activation checkpointing (the recomputed forward runs inside the backward).
"""
from __future__ import annotations

import copy
import dataclasses

import pytest

from tests.harness import dist_run
from tests.test_runtime_util import Tiny, batches, strategy, train_sharded, units_for

pytestmark = pytest.mark.distributed


class _Probe(list):
    """The engine's event list, counting live non-root full buffers at every event."""

    def __init__(self, units):
        super().__init__()
        self.groups = [g.storage for u in units[1:] for g in u.groups if g.storage.s_p > 1]
        self.peak = {"forward": 0, "backward": 0}
        self.direction = "forward"

    def append(self, event):
        if event[0] in ("backward", "issue_reduce", "recompute"):
            self.direction = "backward"
        elif event[0] == "run":
            self.direction = "forward"
        live = sum(g.full_data.untyped_storage().size() > 0 for g in self.groups)
        self.peak[self.direction] = max(self.peak[self.direction], live)
        super().append(event)


def _peaks(rank, world, prefetches, checkpoint):
    from shardc.runtime import shard_module
    out = {}
    for k in prefetches:
        model = Tiny(n_blocks=4, checkpoint=checkpoint)
        s = dataclasses.replace(strategy("zero3", "gpu(2)", accumulate=2), prefetch=k)
        sm = shard_module(copy.deepcopy(model), s, units_for(model, s.scopes))
        probe = _Probe(sm.runtime.units)
        sm.runtime.events = probe
        train_sharded(sm, batches(2, world, 2), rank, world, 2, "adamw")
        out[k] = probe.peak
    return out


@pytest.mark.parametrize("checkpoint", [False, True])
def test_live_full_buffers_within_plan(checkpoint):
    for r in dist_run(2, _peaks, (0, 1, 2), checkpoint):
        for k, peak in r.items():
            assert peak["forward"] == k + 1, (k, peak)          # the window is used, and not exceeded
            assert 1 <= peak["backward"] <= k + 1, (k, peak)
