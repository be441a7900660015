"""One clip (runtime/step/clip.py [Note: one clip]; runtime/state/norms.py [Note: lazy norms]).

`sm.clip_grad_norm_(c)` and torch's own `torch.nn.utils.clip_grad_norm_(sm.parameters(), c)`
take the same total norm through one implementation: on 4 gloo ranks (node(2) > gpu(2)),
Tiny under ZeRO-3 with block 0's states sharded over gpu only (two distinct
optimizer level sets), each path's norm equals one process's on the whole batch, the two
paths train to the same parameters, and each clip call's ledger is explain's clip rows:
one all-reduce of one fp32 scalar (4 bytes) per distinct optimizer level set, here over
("gpu",) and ("node", "gpu"). With experts on an ep dim (examples/moe.py, PaRO-IIG with
the experts' optimizer over node, ep = gpu) both paths' norms equal one process's and
each other's, and both record the one clip row (the dense and the experts' clip levels
are both node, gpu). A gradient's own norm read alone is still the whole tensor's (one
all-reduce of its partial over its piece's levels).
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.harness import dist_run
from tests.test_runtime_util import Tiny, batches, loss_fn, max_rel_err, reference

pytestmark = pytest.mark.distributed
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIP = 0.05                      # below the norms seen here, so every step scales the gradients
MIXED = """strategy clip_two_levels
mesh node(2) > gpu(2)
params shard over world
grads  shard over world
optim  shard over world
accumulate 1
override "blocks.0" {
  params shard over gpu
  grads  shard over gpu
  optim  shard over gpu
}
"""
SCALAR = 4                       # bytes of the fp32 squared-norm partial each clip row all-reduces


def _sharded():
    import dataclasses

    import shardc
    from shardc.runtime import shard_module
    from shardc.units import find_units
    s = dataclasses.replace(shardc.load_strategy(MIXED), bucket=0)
    model = Tiny()
    return shard_module(model, s, find_units(model, s))


def _train(rank, world, data, path):
    sm = _sharded()
    opt = sm.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.01)
    norms, clip_ledgers = [], []
    for x, y in data:
        loss_fn(sm(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        before = {_key(r): r.count for r in sm.comm_ledger()}
        n = sm.clip_grad_norm_(CLIP) if path == "sm" else torch.nn.utils.clip_grad_norm_(sm.parameters(), CLIP)
        norms.append(float(n))
        after = [(_key(r), r.count - before.get(_key(r), 0)) for r in sm.comm_ledger()]
        clip_ledgers.append(sorted((k, c) for k, c in after if c))
        opt.step()
        opt.zero_grad()
    return sm.full_state_dict(), norms, clip_ledgers


def _key(r):
    return (r.phase, r.op, tuple(r.levels), r.bytes, r.over)


def _run(rank, world, data):
    return {path: _train(rank, world, data, path) for path in ("sm", "torch")}


def _alone(rank, world):
    """One gradient's norm read by itself: the whole tensor's, one recorded all-reduce."""
    sm = _sharded()
    x, y = batches(1, world, 1)[0]
    loss_fn(sm(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    w = dict(sm.named_parameters())["blocks.1.up.weight"]
    sm.reset_comm_ledger()
    n = float(w.grad.norm())
    return n, float(w.grad.full_tensor().norm()), [(_key(r), r.count) for r in sm.comm_ledger()]


def test_both_clip_paths_take_one_norm_and_record_explains_clip_rows():
    data = batches(2, 4, 1)
    ref_params, ref_norms = reference(Tiny(), data, "sgd", clip=CLIP)
    want = sorted((("update", "all_reduce", lv, SCALAR, "dense"), 1) for lv in (("gpu",), ("node", "gpu")))
    results = dist_run(4, _run, data)
    for rank_out in results:
        (sm_params, sm_norms, sm_ledgers), (t_params, t_norms, t_ledgers) = rank_out["sm"], rank_out["torch"]
        for got in (sm_norms, t_norms):
            assert max(abs(a - b) / b for a, b in zip(got, ref_norms)) < 1e-5, (got, ref_norms)
        assert max_rel_err(sm_params, ref_params) < 1e-5 and max_rel_err(t_params, ref_params) < 1e-5
        assert sm_ledgers == t_ledgers == [want] * len(data), (sm_ledgers, t_ledgers)


def test_a_gradient_norm_read_alone_is_the_whole_tensors():
    for n, whole, ledger in dist_run(4, _alone):
        assert abs(n - whole) <= 1e-6 * whole
        # Tiny's blocks.1 group: the (node, gpu) optimizer levels, one fp32 entry
        assert ledger == [(("update", "all_reduce", ("node", "gpu"), 4, "dense"), 1)]


def _ep_batch(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, 128, (2, 8), generator=g)


def _ep_loss(m, x):
    return torch.nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


def _ep(rank, world):
    import shardc
    from examples.moe import apply_ep, moe_tiny
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.runtime import shard_module
    from shardc.units import find_units
    from torch.distributed.device_mesh import init_device_mesh
    whole = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    dp = whole._unflatten(0, (2, 2), ("node", "gpu"))
    ep = whole._unflatten(0, (2, 2), ("efsdp", "ep"))["ep"]
    import dataclasses
    s = dataclasses.replace(shardc.load_strategy(os.path.join(ROOT, "examples/strategies/moe/paro_iig_ep_zero1.shard"),
                                                 mesh="node(2) > gpu(2)"), accumulate=1)
    out = {}
    for path in ("sm", "torch"):
        m = apply_ep(moe_tiny(), ep)
        sm = shard_module(m, s, find_units(m, resolve_bucket(m, s)), mesh=dp)
        _ep_loss(sm, _ep_batch(rank)).backward()
        sm.reset_comm_ledger()
        n = sm.clip_grad_norm_(CLIP) if path == "sm" else torch.nn.utils.clip_grad_norm_(sm.parameters(), CLIP)
        out[path] = (float(n), [(_key(r), r.count) for r in sm.comm_ledger()])
    return out


def test_with_experts_on_an_ep_dim_both_paths_take_one_norm():
    from examples.moe import moe_tiny
    m = moe_tiny()
    _ep_loss(m, torch.cat([_ep_batch(r) for r in range(4)])).backward()
    want = float(torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP))
    for r in dist_run(4, _ep):
        (sm_norm, sm_ledger), (t_norm, t_ledger) = r["sm"], r["torch"]
        assert abs(sm_norm - want) <= 1e-5 * want and abs(t_norm - want) <= 1e-5 * want, (sm_norm, t_norm, want)
        assert sm_ledger == t_ledger == [(("update", "all_reduce", ("node", "gpu"), SCALAR, "dense"), 1)], \
            (sm_ledger, t_ledger)
