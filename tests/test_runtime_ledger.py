"""Ledger: one optimizer step's records equal the internals.md derivation, written here
from the formulas (Φ per unit, shard factors, 4-byte fp32 elements) — not from the
runtime. Model: root Φ = 11·6 (tied embedding/head) + 2·6 (final norm) = 78, three
blocks of Φ = 2·6 + (6·7+7) + (7·6+6) = 109."""
from __future__ import annotations

import copy
from math import lcm, prod

import pytest

from tests.harness import dist_run
from tests.test_runtime_util import Tiny, batches, strategy, train_sharded, units_for

pytestmark = pytest.mark.distributed
PHI = [78, 109, 109, 109]
NAMED = ["ddp", "zero1", "zero2", "zero3", "mics", "hsdp_zero2", "zeropp", "paro_igg",
         "paro_iig", "paro_nig", "lins_7b"]
SIZES_2x2 = {"node": 2, "gpu": 2}
ORDER = ("node", "gpu", "gcd")

# (params, secondary, grads, optim) levels of each named strategy (the layout it stands for).
W2 = ("node", "gpu")
TABLE = {
    "ddp": ((), None, (), ()),
    "zero1": ((), None, (), W2),
    "zero2": ((), None, W2, W2),
    "zero3": (W2, None, W2, W2),
    "mics": (("gpu",), None, ("gpu",), ("gpu",)),
    "hsdp_zero2": ((), None, ("gpu",), ("gpu",)),
    "zeropp": (W2, ("gpu",), W2, W2),
    "paro_igg": (("gpu",), None, W2, W2),
    "paro_iig": (("gpu",), None, ("gpu",), W2),
    "paro_nig": ((), None, ("gpu",), W2),
    "lins_7b": ((), None, (), ("gpu",)),
    "zero_topo": (("gcd",), ("gpu", "gcd"), ("gpu", "gcd"), ("node", "gpu", "gcd")),
}


def expected(name, sizes, micro, clip=False):
    """The per-step ledger of internals.md's table, fp32, no quantization."""
    p, q, g, os_ = TABLE[name]
    s = lambda lv: prod(sizes[l] for l in lv)                      # noqa: E731
    minus = lambda a, b: tuple(l for l in ORDER if l in a and l not in b)   # noqa: E731
    mesh = tuple(l for l in ORDER if l in sizes)
    rec = {}

    def add(phase, op, levels, nbytes, count):
        key = (phase, op, levels, nbytes)
        rec[key] = rec.get(key, 0) + count

    for u, phi in enumerate(PHI):
        n = -(-phi // lcm(s(p), s(g), s(os_), s(q or ()))) * lcm(s(p), s(g), s(os_), s(q or ()))
        if s(p) > 1:
            add("forward", "all_gather", p, 4 * n, micro)
            if u > 0 and q is None:
                add("backward", "all_gather", p, 4 * n, micro)
            if u > 0 and q is not None and s(q) > 1:
                add("backward", "all_gather", q, 4 * n, micro)
        if s(g) > 1:
            add("backward", "reduce_scatter", g, 4 * n, micro)
        if minus(os_, g):
            add("sync", "reduce_scatter", minus(os_, g), 4 * n // s(g), 1)
        if minus(mesh, os_):
            add("sync", "all_reduce", minus(mesh, os_), 4 * n // s(os_), 1)
        if minus(os_, p):
            add("update", "all_gather", minus(os_, p), 4 * n // s(p), 1)
    if clip and s(os_) > 1:
        add("update", "all_reduce", os_, 4, 1)
    return sorted((k[0], k[1], k[2], k[3], c) for k, c in rec.items())


def _ledgers(rank, world, mesh, names, micro, clip):
    from shardc.runtime import shard_module
    out = {}
    for name in names:
        model = Tiny()
        s = strategy(name, mesh, accumulate=micro)
        sm = shard_module(copy.deepcopy(model), s, units_for(model, s.scopes))
        data = batches(2, world, micro)
        train_sharded(sm, data[:1], rank, world, micro, "adamw", clip=clip)
        sm.reset_comm_ledger()
        train_sharded(sm, data[1:], rank, world, micro, "adamw", clip=clip)
        out[name] = sorted((r.phase, r.op, r.levels, r.bytes, r.count) for r in sm.comm_ledger())
    return out


def test_ledger_2x2_named():
    got = dist_run(4, _ledgers, "node(2) > gpu(2)", NAMED, 2, None)
    for r in got:
        for name in NAMED:
            assert r[name] == expected(name, SIZES_2x2, 2), name


def test_ledger_zero_topo_with_clip():
    got = dist_run(8, _ledgers, "node(2) > gpu(2) > gcd(2)", ["zero_topo"], 4, 1.0)
    want = expected("zero_topo", {"node": 2, "gpu": 2, "gcd": 2}, 4, clip=True)
    for r in got:
        assert r["zero_topo"] == want


def test_paro_iig_ledger_literal():
    """PaRO-IIG spelled out: per micro-batch an intra-node RS, per step one inter-node RS
    and one inter-node AG. L = lcm(2, 2, 4) = 4: N = 80 (root), 112 (blocks)."""
    got = dist_run(4, _ledgers, "node(2) > gpu(2)", ["paro_iig"], 2, None)[0]["paro_iig"]
    assert got == sorted([
        ("forward", "all_gather", ("gpu",), 320, 2), ("forward", "all_gather", ("gpu",), 448, 6),
        ("backward", "all_gather", ("gpu",), 448, 6),
        ("backward", "reduce_scatter", ("gpu",), 320, 2),
        ("backward", "reduce_scatter", ("gpu",), 448, 6),
        ("sync", "reduce_scatter", ("node",), 160, 1), ("sync", "reduce_scatter", ("node",), 224, 3),
        ("update", "all_gather", ("node",), 160, 1), ("update", "all_gather", ("node",), 224, 3),
    ])
