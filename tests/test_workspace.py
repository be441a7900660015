"""The reduce workspace (runtime/groups/workspace.py): backward scratch buffers are reused across
units and micro-batches, bounded, and empty outside a step's accumulation window.

Bounds from [Note: reduce workspace]: at most two reduce-scatters in flight, each with an
N-element input, an all-to-all receive buffer (gloo: N elements for units as small as
these, under the receive bound) and an N/s_G chunk, so the pool holds at most
2·(2N + N/s_G) elements of the largest unit (fp32: 4 bytes each); every tensor is made
during the first two micro-batches of a step (the first has no chunks: its reduce-scatters
land in the grad shards, groups/storage.py [Note: reduce into the shard]). A unit of one parameter reduce-scatters its
gradient as it is, with no flat copy, and trains at parity.
"""
from __future__ import annotations

import copy

import pytest
import torch

from tests.harness import dist_run
from tests.test_runtime_util import (V, Block, D, H, Tiny, batches, loss_fn, max_rel_err, reference, strategy,
                                     train_sharded, units_for)


def test_take_reuses_what_was_given_back():
    from shardc.runtime.groups.workspace import Workspace
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
def test_clear_frees_the_bytes_whoever_still_holds_the_tensor():
    """[Note: bytes freed at once]: a handed-back buffer that another owner (gloo's worker,
    for a moment) still references loses its bytes at `clear`, not when that owner lets go;
    a tensor still taken keeps its bytes."""
    from shardc.runtime.groups.workspace import Workspace
    ws = Workspace()
    given, kept = ws.take(1000, torch.float32, torch.device("cpu")), ws.take(10, torch.float32, torch.device("cpu"))
    still_held = given                  # what gloo's worker holds after the op is waited
    ws.give(given)
    ws.clear()
    assert still_held.untyped_storage().nbytes() == 0
    assert kept.untyped_storage().nbytes() == 40


def test_chunks_pool_apart_from_flat_buffers():
    """[Note: pools by role]: a first micro-batch that reduces into the grad shards leaves two
    N-element buffers free (the flat input, gloo's receive block); the second micro-batch's
    N/2 chunk must not be cut from one of them, or its receive block needs a third: the pool
    would hold 3N elements where the plan says N + N/2 + N."""
    from shardc.runtime.groups.workspace import Workspace
    ws, f32, cpu, n = Workspace(), torch.float32, torch.device("cpu"), 1000
    for mb in range(2):
        flat = ws.take(n, f32, cpu)
        chunk = ws.take(n // 2, f32, cpu, role="chunk") if mb else None
        recv = ws.take(n, f32, cpu)
        ws.give(recv)
        if chunk is not None:
            ws.give(chunk, role="chunk")
        ws.give(flat)
    assert ws.held_bytes() == (n + n // 2 + n) * 4 and ws.allocations == 3


def test_reduce_buffers_reused_and_bounded():
    for r in dist_run(2, _window):
        a, held = r["allocs"], r["held"]
        assert a[1] == a[2] and a[4] == a[5], a      # made in micro-batches 1 and 2 only
        assert 0 < held[0] <= r["bound"] and 0 < held[3] <= r["bound"], (held, r["bound"])
        assert held[2] == 0 and held[5] == 0, held                   # emptied by the step's sync


def _one_param_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(V, D), Block(D, H), torch.nn.Linear(D, V, bias=False))


def _one_param_units(rank, world, opt_kind):
    """Embedding and head as units of one parameter each (V·D = 66 elements: no padding on
    2 ranks); which groups laid their gradients out flat, and the trained parameters."""
    from shardc.runtime import UnitSpec, shard_module
    from shardc.runtime.groups.storage import FlatStorage
    model = _one_param_model()
    s = strategy("zero3", "gpu(2)")
    block = tuple(n for n, _ in model.named_parameters() if n.startswith("1."))
    specs = [UnitSpec("<root>", (), s.scopes), UnitSpec("0", ("0.weight",), s.scopes, ("0",)),
             UnitSpec("1", block, s.scopes, ("1",)), UnitSpec("2", ("2.weight",), s.scopes, ("2",))]
    flat_n, whole_n = [], []
    flat, whole = FlatStorage.flat_grads, FlatStorage.whole_grad
    FlatStorage.flat_grads = lambda st, grads, ws: flat_n.append(st.n) or flat(st, grads, ws)
    FlatStorage.whole_grad = lambda st, grads: (lambda g: g is not None and whole_n.append(st.n) or g)(whole(st, grads))
    try:                                 # this pooled worker runs later tests: put them back
        sm = shard_module(copy.deepcopy(model), s, specs)
        got, _, _ = train_sharded(sm, batches(2, world, 1), rank, world, 1, opt_kind)
    finally:
        FlatStorage.flat_grads, FlatStorage.whole_grad = flat, whole
    return got, flat_n, whole_n


@pytest.mark.distributed
@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
def test_one_parameter_units_reduce_their_gradient_as_is(opt_kind):
    want, _ = reference(_one_param_model(), batches(2, 2, 1), opt_kind)
    block_n = sum(p.numel() for p in _one_param_model()[1].parameters())
    for got, flat_n, whole_n in dist_run(2, _one_param_units, opt_kind):
        assert max_rel_err(got, want) < 1e-5
        assert whole_n == [V * D, V * D] * 2          # head, then embedding, in each of 2 backwards
        assert len(flat_n) == 2 and all(n >= block_n for n in flat_n)   # the block's, laid out flat
