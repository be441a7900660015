"""opt.step() with no backward since zero_grad() leaves parameters and optimizer state
untouched, as in PyTorch (whose zero_grad sets grads to None), for AdamW (whose weight
decay would otherwise move every parameter) and SGD with momentum; a later real step
still matches one process on the concatenated batch."""
from __future__ import annotations

import copy

import pytest

from tests.harness import dist_run
from tests.test_runtime_util import (Tiny, batches, loss_fn, make_opt, max_rel_err, reference,
                                     strategy, units_for)

pytestmark = pytest.mark.distributed


def _run(rank, world, kind):
    from shardc.runtime import shard_module
    model = Tiny()
    s = strategy("paro_iig", "node(2) > gpu(2)", accumulate=1)
    sm = shard_module(copy.deepcopy(model), s, units_for(model, s.scopes))
    opt = make_opt(kind, sm)
    start = sm.full_state_dict()
    opt.step()                                  # fresh optimizer, no backward
    first = sm.full_state_dict(), len(opt.state)
    data = batches(2, world, 1)
    x, y = data[0]
    loss_fn(sm(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    opt.step()
    opt.zero_grad()
    after_one = sm.full_state_dict()
    opt.step()                                  # after zero_grad, no backward
    opt.zero_grad()
    second = sm.full_state_dict()
    x, y = data[1]
    loss_fn(sm(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    opt.step()
    opt.zero_grad()
    return (max_rel_err(first[0], start), first[1], max_rel_err(second, after_one),
            max_rel_err(sm.full_state_dict(), reference(model, data, kind)[0]))


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_step_without_backward_moves_nothing(kind):
    for moved_fresh, states, moved_later, err in dist_run(4, _run, kind):
        assert moved_fresh == 0.0 and states == 0
        assert moved_later == 0.0
        assert err < 1e-5
