"""Plan passes (`shardc.lowering.passes`): each switchable, each exact with it on and off.

`early_sync`: the emitted SCHEDULE lists `sync_early` only with the pass on; training
under paro_iig (accumulate 4: syncs only on the step's last backward) on 4 gloo ranks
equals one process on the concatenated batch with the pass on and off; the ledger is
the same record for record (the pass moves issue points, never rows); with the pass on
the first units' syncs are issued inside the last backward (before the root's
reduce-scatter), with it off all of them after that backward's last reduce-scatter,
and no backward but the step's last issues any.

`defer_update`: with it on opt.step() returns with the update all-gathers in flight and
each unit's is waited in the next forward right before the unit is needed (its gather
issued or it runs); full_state_dict() right after the last opt.step() (before any
forward) already sees the updated parameters (the parity check reads it there), and so
does the eval forward after it; with it off no update is deferred.
"""
from __future__ import annotations

import pytest
import torch

import shardc
from examples.gpt import GPT, TINY
from shardc.compiler.api import compile_source
from shardc.dsl.errors import ShardcError
from shardc.lowering.passes import PLAN_PASSES, pass_names
from tests.harness import dist_run
from tests.test_compile_parity import (_assert_close, _reference, _text, batches, eval_loss, make_model, make_opt,
                                      train)

pytestmark = pytest.mark.distributed
MESH = "node(2) > gpu(2)"
ON, OFF = None, ()


def test_pass_list_and_names():
    assert tuple(PLAN_PASSES) == ("early_sync", "defer_update")
    assert pass_names(None) == ("early_sync", "defer_update") and pass_names(()) == ()
    assert pass_names(["defer_update", "early_sync"]) == ("early_sync", "defer_update")   # PLAN_PASSES order
    with pytest.raises(ShardcError, match="unknown plan pass 'early_synk'; the passes are: early_sync, defer_update"):
        pass_names(["early_synk"])


def test_emitted_schedule_shows_the_pass():
    strategy = shardc.load_strategy(_text("paro_iig.shard"), mesh=MESH)
    on, plan_on = compile_source(make_model(), strategy, capture="fx", passes=ON)
    off, plan_off = compile_source(make_model(), strategy, capture="fx", passes=OFF)
    n = TINY.n_layer
    assert plan_on.lowering.schedule.sync_early == (*range(n, 0, -1), 0)   # backward order, root last
    assert f"sync_early={plan_on.lowering.schedule.sync_early!r}," in on
    # paro_iig: optim over world, params over gpu -> every trainable unit has an update all-gather
    assert plan_on.lowering.schedule.update_deferred == tuple(range(n + 1))
    assert f"update_deferred={plan_on.lowering.schedule.update_deferred!r}," in on
    assert "plan passes early_sync, defer_update" in on
    assert "sync_early" not in off and "update_deferred" not in off and "plan passes none" in off
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
    pending = sm.runtime.boundary.pending_updates()                  # in flight after the last opt.step()
    events = list(sm.runtime.events)
    sd = {k: v.clone() for k, v in sm.full_state_dict().items()}   # before any forward: must be updated
    with torch.no_grad():
        losses.append(eval_loss(sm, rank, world))
    return losses, sd, events, ledger, pending


def _backwards(events):
    """The events of each micro-batch: from its forward's root gather (paro_iig gathers the
    root: params shard over gpu), or the deferred update wait before it, to the next one."""
    out = []
    for e in events:
        if e == ("wait_update", 0) or e == ("issue_gather", 0) and not (out and out[-1] == [("wait_update", 0)]):
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
        assert r_on[4] == list(range(TINY.n_layer + 1)) and r_off[4] == []
        assert not any(e[0] == "wait_update" for e in r_off[2])
        for k, ev in enumerate(micro_on):                  # each forward after a step waits each unit's
            waits = [e[1] for e in ev if e[0] == "wait_update"]
            assert waits == (list(range(TINY.n_layer + 1)) if k and k % strategy.accumulate == 0 else []), (k, ev)
            for i in waits:                               # ... right before it is needed
                need = next(j for j, e in enumerate(ev) if e in (("issue_gather", i), ("run", i)))
                assert ev.index(("wait_update", i)) == need - 1, (i, ev)


def test_cli_passes_flag(tmp_path, capsys, monkeypatch):
    import os

    from shardc.cli import main
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = ["compile", "examples/strategies/paro_iig.shard", "--model", "examples/gpt.py:tiny", "--mesh", MESH]
    out = {}
    for flag in ("", "early_sync", None):
        path = tmp_path / f"m_{flag}.py"
        extra = [] if flag is None else ["--passes", flag]
        assert main(base + extra + ["-o", str(path)]) == 0, capsys.readouterr().err
        out[flag] = path.read_text()
    assert "plan passes none" in out[""] and "sync_early" not in out[""]
    assert "plan passes early_sync (" in out["early_sync"] and "update_deferred" not in out["early_sync"]
    assert "plan passes early_sync, defer_update" in out[None]
    capsys.readouterr()
    assert main(base + ["--passes", "bogus", "-o", str(tmp_path / "x.py")]) != 0
    err = capsys.readouterr().err
    assert "unknown plan pass 'bogus'" in err and "Traceback" not in err


def _sync_stage_job(rank, world):
    """After a step's last backward, before opt.step(): which stage each unit's sync is in."""
    import copy
    from shardc.runtime import shard_module
    from tests.test_runtime_util import (Tiny, batches as tiny_batches, max_rel_err, reference, strategy,
                                         train_sharded, units_for)
    out = {}
    for name in ("hsdp_zero2", "lins_7b", "ddp"):
        model, data, stages = Tiny(), tiny_batches(2, world, 2), []
        want, _ = reference(model, data, "sgd")
        s = strategy(name, "node(2) > gpu(2)", accumulate=2)
        sm = shard_module(copy.deepcopy(model), s, units_for(model, s.scopes))
        got, _, _ = train_sharded(sm, data, rank, world, 2, "sgd", before_step=lambda sm: stages.append(
            {u.index: {"reduce_scatter": "rs", "all_reduce": "ar"}[u.trainable.syncing.stage.value]
             for u in sm.runtime.units if u.trainable}))
        out[name] = stages, max_rel_err(got, want)
    return out


def test_sync_all_reduces_go_out_during_the_backward():
    # [Note: early sync], Tiny = root + 3 blocks, backward order 3, 2, 1, root. HSDP-ZeRO-2 and
    # DDP (OS = G: the sync is one all-reduce over the replicas) have every unit's in flight
    # when the backward ends. Lins' 7B layout (reduce-scatter over gpu, then all-reduce over
    # node): block 2's sync advanced block 3's to its all-reduce, block 1's block 2's; block
    # 1's and the root's advance at opt.step(). Parity with one process in every case.
    for r in dist_run(4, _sync_stage_job):
        assert r["hsdp_zero2"][0] == r["ddp"][0] == [{0: "ar", 1: "ar", 2: "ar", 3: "ar"}] * 2, r
        assert r["lins_7b"][0] == [{0: "rs", 1: "rs", 2: "ar", 3: "ar"}] * 2, r
        assert all(err < 1e-5 for _, err in r.values()), r
