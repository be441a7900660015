"""Plan passes (`shardc.lowering.passes`): each switchable, each exact with it on and off.

`early_sync`: the emitted SCHEDULE lists `sync_early` only with the pass on; training
under paro_iig (accumulate 4: syncs only on the step's last backward) on 4 gloo ranks
equals one process on the concatenated batch with the pass on and off; the ledger is
the same record for record (the pass moves issue points, never rows); with the pass on
the first units' syncs are issued inside the last backward (before the root's
reduce-scatter), with it off all of them after that backward's last reduce-scatter,
and no backward but the step's last issues any.
"""
from __future__ import annotations

import pytest
import torch

import shardc
from examples.gpt import GPT, TINY
from shardc.compiler.api import compile_source
from shardc.dsl.errors import ShardcError
from shardc.lowering.passes import PASSES, pass_names
from tests.harness import dist_run
from tests.test_compile_parity import (_assert_close, _reference, _text, batches, eval_loss, make_model, make_opt,
                                      train)

pytestmark = pytest.mark.distributed
MESH = "node(2) > gpu(2)"
ON, OFF = None, ()


def test_pass_list_and_names():
    assert tuple(PASSES) == ("early_sync",)
    assert pass_names(None) == ("early_sync",) and pass_names(()) == ()
    with pytest.raises(ShardcError, match="unknown plan pass 'early_synk'; the passes are: early_sync"):
        pass_names(["early_synk"])


def test_emitted_schedule_shows_the_pass():
    strategy = shardc.load_strategy(_text("paro_iig.shard"), mesh=MESH)
    on, plan_on = compile_source(make_model(), strategy, capture="fx", passes=ON)
    off, plan_off = compile_source(make_model(), strategy, capture="fx", passes=OFF)
    n = TINY.n_layer
    assert plan_on.lowering.schedule.sync_early == (*range(n, 0, -1), 0)   # backward order, root last
    assert f"sync_early={plan_on.lowering.schedule.sync_early!r}," in on and "plan passes early_sync" in on
    assert "sync_early" not in off and "plan passes none" in off
    assert plan_on.lowering.units == plan_off.lowering.units            # rows untouched


def _job(rank, world, passes, opt_kind):
    torch.manual_seed(123 + rank)
    model = GPT(TINY) if rank else make_model()
    strategy = shardc.load_strategy(_text("paro_iig.shard"), mesh=MESH)
    sm = shardc.compile(model, strategy, capture="fx", passes=passes)
    o = make_opt(opt_kind, sm)
    opt = sm.optimizer(o.pop("cls"), **o)
    sm.runtime.events.clear()
    losses = train(sm, opt, batches(world, strategy.accumulate), rank, world, strategy.accumulate)
    ledger = [(r.phase, r.op, tuple(r.levels), r.bytes, r.count) for r in sm.comm_ledger()]
    events = list(sm.runtime.events)
    with torch.no_grad():
        losses.append(eval_loss(sm, rank, world))
    return losses, {k: v.clone() for k, v in sm.full_state_dict().items()}, events, ledger


def _backwards(events):
    """The events of each micro-batch: from its forward's root gather (paro_iig gathers the
    root: params shard over gpu) to the next one."""
    out = []
    for e in events:
        if e == ("issue_gather", 0):
            out.append([])
        out[-1].append(e)
    return out


@pytest.mark.parametrize("opt_kind", ["adamw", "sgd"])
def test_early_sync_on_and_off_match_reference(opt_kind):
    strategy = shardc.load_strategy(_text("paro_iig.shard"), mesh=MESH)
    ref = _reference(strategy.accumulate, opt_kind, 4)
    on, off = dist_run(4, _job, ON, opt_kind), dist_run(4, _job, OFF, opt_kind)
    _assert_close([r[:2] for r in on], ref)
    _assert_close([r[:2] for r in off], ref)
    for r_on, r_off in zip(on, off):
        assert r_on[3] == r_off[3]                        # the same ledger, record for record
        micro_on, micro_off = _backwards(r_on[2]), _backwards(r_off[2])
        assert len(micro_on) == len(micro_off) == 3 * strategy.accumulate
        for k, (ev_on, ev_off) in enumerate(zip(micro_on, micro_off)):
            syncs_on = [i for i, e in enumerate(ev_on) if e[0] == "issue_sync"]
            syncs_off = [i for i, e in enumerate(ev_off) if e[0] == "issue_sync"]
            if (k + 1) % strategy.accumulate:             # not the step's last backward: no sync
                assert syncs_on == syncs_off == []
                continue
            last_reduce = max(i for i, e in enumerate(ev_off) if e[0] == "issue_reduce")
            assert min(syncs_off) > last_reduce           # off: all after the last reduce-scatter
            root_reduce = ev_on.index(("issue_reduce", 0))
            assert ev_on.index(("issue_sync", TINY.n_layer)) < root_reduce   # on: inside the backward
            assert len(syncs_on) == len(syncs_off) == TINY.n_layer + 1
