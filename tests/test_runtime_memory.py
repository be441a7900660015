"""memory_report() after one full step equals internals.md's figures, written from the
formulas: params Φ·4/s_P, secondary Φ·4/s_Q (non-root units), grads Φ·4/s_G, optim
Φ·8/s_OS for AdamW with fp32 params (m and v; the master is the parameter itself) and
Φ·4/s_OS for SGD with momentum — with Φ padded to N per unit."""
from __future__ import annotations

import copy
from math import lcm, prod

import pytest

from tests.harness import dist_run
from tests.test_runtime_ledger import NAMED, TABLE
from tests.test_runtime_util import Tiny, batches, strategy, train_sharded, units_for

pytestmark = pytest.mark.distributed
SIZES = {"node": 2, "gpu": 2}
# d=8, h=8: root 11·8 + 2·8 = 104, blocks 2·8 + (8·8+8) + (8·8+8) = 160 — multiples of 8,
# so no strategy on 4 ranks pads. d=6, h=7: 78 and 109, padded to lcm of the factors.
PHI = {"even": [104, 160, 160, 160], "odd": [78, 109, 109, 109]}
K = {"adamw": 8, "sgd": 4}


def expected(name, phis, kind):
    p, q, g, os_ = TABLE[name]
    s = lambda lv: prod(SIZES[l] for l in lv)      # noqa: E731
    rep = dict(params=0, params_secondary=0, grads=0, optim=0)
    for u, phi in enumerate(phis):
        L = lcm(s(p), s(g), s(os_), s(q or ()))
        n = -(-phi // L) * L
        rep["params"] += n * 4 // s(p)
        if q is not None and u > 0:
            rep["params_secondary"] += n * 4 // s(q)
        rep["grads"] += n * 4 // s(g)
        rep["optim"] += n * K[kind] // s(os_)
    rep["total"] = sum(rep.values())
    return rep


def _reports(rank, world, shape, kind):
    from shardc.runtime import shard_module
    out = {}
    for name in NAMED:
        model = Tiny(d=8, h=8) if shape == "even" else Tiny()
        s = strategy(name, "node(2) > gpu(2)", accumulate=1)
        sm = shard_module(copy.deepcopy(model), s, units_for(model, s.scopes))
        train_sharded(sm, batches(1, world, 1), rank, world, 1, kind)
        out[name] = sm.memory_report()
        groups = [g.storage for u in sm.runtime.units for g in u.groups]
        out[name]["leftover"] = sum(g.full_data.untyped_storage().nbytes() for g in groups
                                    if g.s_p > 1)
        out[name]["leftover"] += sum(g.full.grad is not None for g in groups if g.trainable)
    return out


@pytest.mark.parametrize("shape,kind", [("even", "adamw"), ("odd", "sgd")])
def test_memory_report_matches_formula(shape, kind):
    assert all(p % 8 == 0 for p in PHI["even"]) and all(p % 2 for p in PHI["odd"][1:])
    for r in dist_run(4, _reports, shape, kind):
        for name in NAMED:
            # no full-size parameter buffer or gradient left alive for sharded states
            assert r[name].pop("leftover") == 0, name
            assert r[name] == expected(name, PHI[shape], kind), name
