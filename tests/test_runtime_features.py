"""Runtime features on 4 gloo ranks (node(2) > gpu(2)): frozen parameters, param groups,
clip_grad_norm_, no_sync, a parameter-free unit, a two-module (bucket) unit,
activation checkpointing (units recomputed inside the backward), eval under no_grad, misuse errors
(the loop's own micro-batch counts: tests/test_accumulation.py),
state-dict round trips and the prefetch schedule. Each compares with one process on the
concatenated batch (tied embedding/head and padding are in every case: blocks have 109
elements, not a multiple of 4)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from shardc.lowering import REDUCE_IN_FLIGHT
from tests.harness import dist_run
from tests.test_runtime_util import (Tiny, batches, loss_fn, make_opt, max_rel_err,
                                     nobias_groups, reference, strategy, train_sharded,
                                     units_for)

pytestmark = pytest.mark.distributed
MESH = "node(2) > gpu(2)"
TOL = 1e-5


def _shard(model, name, acc=2, bucket=False):
    from shardc.runtime import shard_module
    s = strategy(name, MESH, accumulate=acc)
    return shard_module(copy.deepcopy(model), s, units_for(model, s.scopes, bucket))


def _variants(rank, world):
    out = {}
    for label, model_kw, name, kw in [
        ("frozen", dict(frozen=True), "paro_iig", {}),
        ("empty_unit", dict(empty_unit=True), "zero3", {}),
        ("groups", {}, "paro_igg", dict(groups=True)),
        ("clip", {}, "zero3", dict(clip=0.05)),
        ("clip_mics", {}, "mics", dict(clip=0.05)),
        ("bucket", {}, "zeropp", dict(bucket=True)),
        ("checkpoint", dict(checkpoint=True), "zero3", {}),
        ("checkpoint_hpz", dict(checkpoint=True), "zeropp", {}),
    ]:
        model = Tiny(**model_kw)
        data = batches(3, world, 2)
        want, want_norms = reference(model, data, "adamw", clip=kw.get("clip"),
                                     groups=kw.get("groups", False))
        sm = _shard(model, name, bucket=kw.get("bucket", False))
        groups = nobias_groups(model) if kw.get("groups") else None
        got, norms, _ = train_sharded(sm, data, rank, world, 2, "adamw", clip=kw.get("clip"),
                                      groups=groups)
        out[label] = (max_rel_err(got, want), norms, want_norms)
    return out


def test_frozen_groups_clip_empty_unit_bucket():
    res = dist_run(4, _variants)
    for r in res:
        for label, (err, norms, want_norms) in r.items():
            assert err < TOL, (label, err)
            assert len(norms) == len(want_norms)
            for a, b in zip(norms, want_norms):
                assert abs(a - b) <= 1e-5 * abs(b), (label, norms, want_norms)
        assert r["clip"][2][0] > 0.05           # clipping really happened


def _frozen_unchanged(rank, world):
    model = Tiny(frozen=True)
    sm = _shard(model, "zero3")
    before = sm.full_state_dict()["blocks.1.up.weight"]
    train_sharded(sm, batches(2, world, 2), rank, world, 2, "sgd")
    after = sm.full_state_dict()
    grad_bytes = sm.memory_report()["grads"]
    return bool(torch.equal(before, after["blocks.1.up.weight"])), grad_bytes


def test_frozen_params_get_no_update_or_grad():
    # trainable elements per unit: root 66+12=78 -> 80; blocks 109 -> 112, block 1 without
    # up (6*7+7=49) is 60 -> 60: grads shard over world (4): (80+112+60+112)/4 * 4 bytes.
    for same, grad_bytes in dist_run(4, _frozen_unchanged):
        assert same
        assert grad_bytes == (80 + 112 + 60 + 112) // 4 * 4


def _no_sync(rank, world):
    model = Tiny()
    data = batches(3, world, 2)
    want, _ = reference(model, data, "sgd")
    sm = _shard(model, "paro_iig", acc=1)
    got, _, _ = train_sharded(sm, data, rank, world, 2, "sgd", use_no_sync=True)
    return max_rel_err(got, want)


def test_no_sync_accumulates_without_sync():
    assert all(err < TOL for err in dist_run(4, _no_sync))


def _eval(rank, world):
    model = Tiny()
    ref = copy.deepcopy(model)
    sm = _shard(model, "zeropp")
    x, y = batches(1, world, 1)[0]
    sm.reset_comm_ledger()
    with torch.no_grad():
        got = sm(x)
    led = sm.comm_ledger()
    held = [g.held for u in sm.runtime.units for g in u.groups]
    return float((got - ref(x)).abs().max()), [(r.phase, r.op) for r in led], held


def test_eval_forward_under_no_grad():
    for err, ops, held in dist_run(4, _eval):
        assert err < 1e-6
        assert {p for p, _ in ops} == {"forward"}       # gathers only, no backward work
        assert not any(held)                            # every unit released


def _errors(rank, world):
    from shardc.dsl.errors import ShardcError
    msgs = {}
    model = Tiny()
    sm = _shard(model, "zero3", acc=2)
    opt = make_opt("sgd", sm)
    x, y = batches(1, world, 1)[0]
    loss_fn(sm(x), y).backward()
    try:
        sm.optimizer(torch.optim.LBFGS, lr=1.0)
    except ShardcError as e:
        msgs["lbfgs"] = str(e)
    ddp = _shard(model, "ddp", acc=1)
    msgs["lbfgs_ddp"] = type(ddp.optimizer(torch.optim.LBFGS, lr=1.0)).__name__
    try:
        sm.optimizer(torch.optim.SGD, param_groups=[{"params": ["nope.weight"]}], lr=0.1)
    except ShardcError as e:
        msgs["badname"] = str(e)
    loss_fn(sm(x), y).backward()                 # second micro-batch: synced now
    opt.step()
    try:
        sm(x)
    except ShardcError as e:
        msgs["no_zero_grad"] = str(e)
    sm.zero_grad()
    msgs["ok_after_zero"] = tuple(sm(x).shape)
    from shardc.runtime import UnitSpec, shard_module
    s = strategy("zero3", MESH)
    units = units_for(model, s.scopes)
    split_tied = [UnitSpec("<root>", ("emb.weight", "norm.weight", "norm.bias"), s.scopes),
                  *units[1:-1], dataclasses.replace(units[-1], params=units[-1].params + ("head.weight",))]
    for label, bad in (("tied", split_tied), ("orphan", units[:-1])):
        try:
            shard_module(copy.deepcopy(model), s, bad)
        except ShardcError as e:
            msgs[label] = str(e)
    return msgs


def test_misuse_errors():
    msgs = dist_run(4, _errors)[0]
    assert "LBFGS" in msgs["lbfgs"] and "element-wise" in msgs["lbfgs"]
    assert msgs["lbfgs_ddp"] == "LBFGS"
    assert "nope.weight" in msgs["badname"]
    assert "zero_grad" in msgs["no_zero_grad"]
    assert msgs["ok_after_zero"][-1] == 11
    assert "tied parameters must share one unit" in msgs["tied"]
    assert "blocks.2." in msgs["orphan"] and "no unit" in msgs["orphan"]


def _state_dicts(rank, world):
    model = Tiny()
    data = batches(4, world, 2)
    sm = _shard(model, "paro_iig")
    opt = make_opt("adamw", sm)

    def step(x, y):
        for xm, ym in zip(x.chunk(world)[rank].chunk(2), y.chunk(world)[rank].chunk(2)):
            (loss_fn(sm(xm), ym) / 2).backward()
        opt.step()
        opt.zero_grad()

    step(*data[0])
    # deep copies: a state dict is views of the live state, as torch's (runtime/state/checkpoint.py
    # [Note: the recipe loads in place])
    full, shard, osd = sm.full_state_dict(), copy.deepcopy(sm.state_dict()), copy.deepcopy(opt.state_dict())
    step(*data[1]), step(*data[2])
    after_a = sm.full_state_dict()
    sm.load_state_dict(shard)
    opt.load_state_dict(osd)
    back = max_rel_err(sm.full_state_dict(), full)
    step(*data[1]), step(*data[2])
    resumed = max_rel_err(sm.full_state_dict(), after_a)
    # full state dict into a fresh sharded model of a differently initialised model
    other = _shard(Tiny(seed=5), "zero3")
    other.load_full_state_dict(full)
    cross = max_rel_err(other.full_state_dict(), full)
    names = sorted(full)
    return back, resumed, cross, names


def test_state_dict_round_trips():
    back, resumed, cross, names = dist_run(4, _state_dicts)[0]
    assert back == 0.0 and cross == 0.0
    assert resumed < 1e-6
    assert "head.weight" in names and "emb.weight" in names and "scale" in names


def _schedule(rank, world):
    model = Tiny()
    sm = _shard(model, "zero3", acc=1)
    x, y = batches(1, world, 1)[0]
    sm.runtime.events.clear()
    loss_fn(sm(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    return list(sm.runtime.events)


def test_prefetch_overlaps_next_gather():
    ev = dist_run(4, _schedule)[0]
    pos = {e: k for k, e in reversed(list(enumerate(ev)))}     # first occurrence
    for i in (1, 2):
        assert pos[("issue_gather", i + 1)] < pos[("run", i)], ev
    bwd = ev[ev.index(("run", 3)):]
    # backward: unit 2's re-gather is issued before unit 3's gradients are reduced
    assert bwd.index(("issue_gather", 2)) < bwd.index(("issue_reduce", 3)), bwd
    # one reduce-scatter in flight (shardc.lowering [Note: reductions in flight]): unit 3's is
    # waited as unit 2's gradients arrive, before unit 2's is issued
    assert REDUCE_IN_FLIGHT == 1
    assert bwd.index(("issue_reduce", 3)) < bwd.index(("wait_reduce", 3)) < bwd.index(("issue_reduce", 2))


def _dcp(rank, world, path):
    import torch.distributed.checkpoint as dcp
    model = Tiny(d=8, h=8)                       # no padding: zero3 and mics agree on N
    sm = _shard(model, "zero3")
    train_sharded(sm, batches(1, world, 2), rank, world, 2, "sgd")
    dcp.save(sm.state_dict(), checkpoint_id=path)
    want = sm.full_state_dict()
    out = {}
    for name in ("zero3", "mics"):               # same layout, and resharded P: world -> gpu
        other = _shard(Tiny(d=8, h=8, seed=7), name)
        sd = other.state_dict()
        dcp.load(sd, checkpoint_id=path)
        other.load_state_dict(sd)
        out[name] = max_rel_err(other.full_state_dict(), want)
    return out


def test_dcp_save_load_and_reshard(tmp_path):
    for r in dist_run(4, _dcp, str(tmp_path / "ckpt")):
        assert r == {"zero3": 0.0, "mics": 0.0}, r
