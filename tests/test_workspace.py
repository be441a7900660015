"""The reduce workspace (runtime/workspace.py): backward scratch buffers are reused across
units and micro-batches, bounded, and empty outside a step's accumulation window.

Bounds from [Note: reduce workspace]: at most two reduce-scatters in flight, each with an
N-element input, an N-element all-to-all receive buffer (gloo) and an N/s_G chunk, so the
pool holds at most 2·(2N + N/s_G) elements of the largest unit (fp32: 4 bytes each);
every tensor is made during the first micro-batch of a step.
"""
from __future__ import annotations

import copy

import pytest
import torch

from tests.harness import dist_run
from tests.test_runtime_util import Tiny, batches, loss_fn, strategy, units_for


def test_take_reuses_what_was_given_back():
    from shardc.runtime.workspace import Workspace
    ws = Workspace()
    a = ws.take(10, torch.float32, torch.device("cpu"))
    ws.give(a)
    b = ws.take(6, torch.float32, torch.device("cpu"))
    assert b.data_ptr() == a.data_ptr() and b.numel() == 6 and ws.allocations == 1
    c = ws.take(6, torch.float32, torch.device("cpu"))        # a is taken: a new one
    assert c.data_ptr() != b.data_ptr() and ws.allocations == 2
    ws.give(b)
    ws.give(c)
    d = ws.take(20, torch.float32, torch.device("cpu"))       # both too small: one is dropped
    assert ws.allocations == 3 and ws.held_bytes() == 10 * 4 and d.numel() == 20
    ws.clear()
    assert ws.held_bytes() == 0


def _window(rank, world):
    from shardc.runtime import shard_module
    model = Tiny(n_blocks=4)
    s = strategy("zero3", "gpu(2)", accumulate=3)
    sm = shard_module(copy.deepcopy(model), s, units_for(model, s.scopes))
    opt = sm.optimizer(torch.optim.AdamW, lr=1e-3)
    ws = sm.runtime.workspace
    groups = [g.storage for g in sm.runtime.boundary.trainable_groups()]
    bound = 2 * (2 * max(g.n for g in groups) + max(g.grad_shard.numel() for g in groups)) * 4
    out = {"allocs": [], "held": [], "bound": bound}
    for x, y in batches(2, world, 3):
        xs, ys = x.chunk(world)[rank].chunk(3), y.chunk(world)[rank].chunk(3)
        for m in range(3):
            (loss_fn(sm(xs[m]), ys[m]) / 3).backward()
            out["allocs"].append(ws.allocations)
            out["held"].append(ws.held_bytes())
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.distributed
def test_reduce_buffers_reused_and_bounded():
    for r in dist_run(2, _window):
        a, held = r["allocs"], r["held"]
        assert a[0] == a[1] == a[2] and a[3] == a[4] == a[5], a      # made in micro-batch 1 only
        assert 0 < held[0] <= r["bound"] and 0 < held[3] <= r["bound"], (held, r["bound"])
        assert held[2] == 0 and held[5] == 0, held                   # emptied by the step's sync
