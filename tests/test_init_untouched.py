"""The first rank's init fills NaN only where an op could see it (runtime/state/untouched.py,
[Note: NaN only where it can be seen]; runtime/state/init_first.py's reused buffer).

An init that writes parts of parameters before anything else (through `.data` too), reads
a parameter before writing it, overwrites others whole, reseeds the generator and draws a
tensor of its own between deferred draws, draws biases from a generator of its own, and leaves the final norm alone, on
2 gloo ranks under ZeRO-3 (the first rank draws and scatters, its one buffer reused from
unit to unit): every value equals one process's `to_empty`, every floating parameter NaN,
`apply(fn)` — NaN exactly where that process has NaN, so no byte of a reused buffer or of
`torch.empty` shows through — every rank's generator ends where that process's does, and the
parameters no op touched are the unset ones.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.harness import dist_run
from tests.test_runtime_util import Tiny, strategy, units_for

pytestmark = pytest.mark.distributed
SEED = 11


def mixed(m):
    """Whole draws, partial writes first, a read first; the final norm only when asked."""
    with torch.no_grad():
        _mixed(m)


def _mixed(m):
    if isinstance(m, Tiny):
        m.scale.fill_(1.5)                      # its buffer (lost on meta)
    if isinstance(m, nn.Linear):
        m.weight.data[:, 0].fill_(0.5)          # partial, through .data: the rest stays NaN
        m.weight.mul_(2.0)                      # reads it
        if m.bias is not None:
            nn.init.normal_(m.bias, generator=mixed.gen)      # whole, from the caller's generator
    elif isinstance(m, nn.Embedding):
        torch.manual_seed(21)                   # reseeded between deferred draws: a new run
        nn.init.normal_(m.weight, std=0.02)
    elif isinstance(m, nn.LayerNorm) and (m is not getattr(mixed, "skip", None)):
        m.weight.data.copy_(1.0 + torch.rand(m.weight.shape))     # a draw of its own: the generator caught up
        m.bias[1:].zero_()                      # bias[0] stays NaN


def _meta() -> Tiny:
    with torch.device("meta"):
        return Tiny()


def _reference(skip_norm: bool) -> dict:
    model = _meta()
    torch.manual_seed(SEED)
    model.to_empty(device="cpu")
    model.head.weight = model.emb.weight
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    mixed.skip = model.norm if skip_norm else None
    mixed.gen = torch.Generator().manual_seed(SEED + 1)
    model.apply(mixed)
    return model.state_dict()


def _run(rank, world, skip_norm):
    from shardc.runtime import shard_module
    model = _meta()
    s = strategy("zero3", "node(1) > gpu(2)", accumulate=1)
    mixed.skip = model.norm if skip_norm else None
    mixed.gen = torch.Generator().manual_seed(SEED + 1)
    torch.manual_seed(SEED)
    sm = shard_module(model, s, units_for(model, s.scopes), init=mixed)
    if skip_norm:
        return sorted(sm.params.unset)
    after = torch.random.get_rng_state()
    got, want = sm.full_state_dict(), _reference(False)
    bad = [k for k in want if not torch.equal(got[k].isnan(), want[k].isnan())
           or not torch.equal(got[k].nan_to_num(7.0), want[k].nan_to_num(7.0))]
    return bad + ([] if torch.equal(after, torch.random.get_rng_state()) else ["the generator after init"])


def test_values_and_nan_equal_one_process():
    assert dist_run(2, _run, False) == [[], []]


def test_untouched_parameters_are_unset():
    assert dist_run(2, _run, True) == [["norm.bias", "norm.weight"]] * 2
