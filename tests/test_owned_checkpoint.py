"""Checkpoints of tensor-owned optimizer states (issue 51; runtime/step/owned_state.py [Note:
owned states in checkpoints]): torch.optim.Muon's momentum saved with torch's recipe
(`get_state_dict`, `dcp.save`, `dcp.load`, `set_state_dict`) under `optim ... by tensor`
resumes under another layout and world size — owners over the world at 4 ranks ->
whole pieces under `optim replicate` at 2 ranks -> owners over gpu with replicas over node
at 4 ranks — and the three legs together equal one uninterrupted process on the
concatenated batch; at each load the optimizer states equal the saving run's bit for bit."""
from __future__ import annotations

import copy

import pytest

import shardc
from tests.harness import dist_run
from tests.test_checkpoint import _same
from tests.test_runtime_util import D, H, Tiny, batches, loss_fn, max_rel_err
from tests.test_tensor_owned import CLIP, _opts, _reference, _units

pytestmark = pytest.mark.distributed
SAMPLES, STEPS = 8, 3               # global batch (the same data at every world size); one step per leg

OWNED_WORLD = """\
mesh node(2) > gpu(2)
params shard over world
grads  shard over world
optim  shard over world
override "blocks.*" { optim shard over world by tensor }
"""
REPLICATED = """\
mesh gpu(2)
params replicate
grads  replicate
optim  replicate
"""
OWNED_GPU = """\
mesh node(2) > gpu(2)
params shard over gpu
grads  shard over gpu
optim  shard over gpu
override "blocks.*" { optim shard over gpu by tensor }
"""


def _data(world):
    return batches(STEPS, world, 1, b=SAMPLES // world)


def _full(sm, opts):
    return [sm.full_optim_state_dict(o) for o in opts]


def _leg(rank, world, text, step, load, save):
    """Build under `text`, load `load` (a DCP checkpoint), train data step `step`, save to `save`."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp
    from shardc.runtime import shard_module
    s = shardc.load_strategy(text)
    model = Tiny(seed=0 if load is None else 5)          # a load replaces every value
    sm = shard_module(copy.deepcopy(model), s, _units(model, s))
    opts = _opts(list(sm.named_parameters()))
    loaded = None
    if load is not None:
        msd, osd = get_state_dict(sm, opts)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=load)
        set_state_dict(sm, opts, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded = _full(sm, opts)
    x, y = _data(world)[step]
    loss_fn(sm(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    sm.clip_grad_norm_(CLIP)
    for o in opts:
        o.step()
    for o in opts:
        o.zero_grad()
    msd, osd = get_state_dict(sm, opts)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=save)
    held = sum(v["momentum_buffer"].numel() for v in opts[0].state.values())
    return loaded, _full(sm, opts), sm.full_state_dict(), held


def test_muon_momentum_resumes_owned_to_replicated_to_owned(tmp_path):
    legs = [(4, OWNED_WORLD, 1), (2, REPLICATED, 2), (4, OWNED_GPU, 2)]   # world, layout, owner groups
    prev, out = None, None
    for step, (world, text, groups) in enumerate(legs):
        path = str(tmp_path / f"leg{step}")
        out = dist_run(world, _leg, text, step, prev, path)
        if prev is not None:
            for loaded, *_ in out:                     # the states loaded equal the saving run's
                _same(loaded, saved, f"leg {step}")
        saved = out[0][1]
        # the momentum lives whole, each matrix on one rank per owner group (every rank: replicate)
        assert sum(r[3] for r in out) == (world if text is REPLICATED else groups) * 6 * D * H
        assert saved[0]["state"]["blocks.0.up.weight"]["momentum_buffer"].shape == (H, D)   # nn.Linear(D, H)
        prev = path
    want = _reference(Tiny(seed=0), _data(1)[:STEPS])
    for *_, params, _ in out:
        assert max_rel_err(params, want) < 1e-5
