"""Cost-model formulas against hand-computed values (docs/internals.md, PaRO Table 2).

Every expected number is worked out in the comment beside it from the internals.md
rules: padding N = round_up(Φ, lcm(factors)), payloads, the ledger table, memory per
state, ring/hierarchical link bytes and the alpha-beta time model.
"""
from __future__ import annotations

import json

import pytest

from shardc.dsl.ir import (
    Collectives, DType, GradsSpec, Level, Mesh, OptimSpec, ParamsSpec, Scopes, Secondary, Strategy,
)
from shardc.analysis.costmodel import (
    AlphaBeta, Profile, UnitSize, choose_collectives, inter_intra, link_bytes, predict_ledger,
    predict_memory,
)
from shardc.analysis.costmodel.links import record_links
from shardc.lowering import Op

M2 = Mesh((Level("node", 2), Level("gpu", 4)))
M3 = Mesh((Level("node", 2), Level("gpu", 2), Level("gcd", 2)))
W2 = ("node", "gpu")


def strat(mesh, p=(), g=(), o=(), *, accumulate=2, sec=None, pcomm=DType.FP32, pdtype=DType.FP32,
          gcomm=DType.FP32, gdtype=DType.FP32, algo=Collectives.AUTO):
    sc = Scopes(ParamsSpec(p, sec, pcomm, pdtype), GradsSpec(g, gcomm, gdtype), OptimSpec(o))
    return Strategy("t", mesh, sc, accumulate=accumulate, collectives=algo)


def units(s, *sizes):
    """Root first; each size is trainable or (trainable, frozen)."""
    out = []
    for i, n in enumerate(sizes):
        t, f = n if isinstance(n, tuple) else (n, 0)
        out.append(UnitSize("<root>" if i == 0 else f"u{i}", t, f, s.scopes, root=(i == 0)))
    return out


def table(records):
    return [(r.phase, r.op, r.levels, r.bytes, r.count) for r in records]


def test_paro_iig_two_levels_ledger_memory_links():
    s = strat(M2, ("gpu",), ("gpu",), W2)
    us = units(s, 10, 30)
    # L = lcm(s_P=4, s_G=4, s_OS=8) = 8: root N = 16, block N = 32 (fp32: 4 bytes each).
    assert table(predict_ledger(s, us)) == [
        ("forward", "all_gather", ("gpu",), 16 * 4, 2),            # root, 2 micro-batches
        ("forward", "all_gather", ("gpu",), 32 * 4, 2),            # block
        ("backward", "all_gather", ("gpu",), 32 * 4, 2),           # block only: root stays gathered
        ("backward", "reduce_scatter", ("gpu",), 16 * 4, 2),
        ("backward", "reduce_scatter", ("gpu",), 32 * 4, 2),
        ("sync", "reduce_scatter", ("node",), 16 // 4 * 4, 1),     # OS∖G = node, N/s_G·4
        ("sync", "reduce_scatter", ("node",), 32 // 4 * 4, 1),
        ("update", "all_gather", ("node",), 16 // 4 * 4, 1),       # OS∖P = node, N/s_P·4
        ("update", "all_gather", ("node",), 32 // 4 * 4, 1),
    ]
    mem = predict_memory(M2, us)          # AdamW, fp32 params: K = 8, no extra master
    assert mem["params"] == (16 + 32) // 4 * 4 == 48
    assert mem["grads"] == 48
    assert mem["optim"] == (16 + 32) // 8 * 8 == 48
    assert mem["params_secondary"] == 0 and mem["total"] == 144
    links = link_bytes(predict_ledger(s, us), M2, Collectives.RING)
    # gpu (p=4): 3/4·V per all-gather/reduce-scatter:
    #   fwd 2·(64+128) + bwd AG 2·128 + bwd RS 2·(64+128) = 1024 bytes -> 768 sent.
    # node (p=2): 1/2·(16+32) sync + 1/2·(16+32) update = 48.
    assert links == pytest.approx({"node": 48.0, "gpu": 768.0})
    assert inter_intra(links, M2) == pytest.approx((48.0, 768.0))
    one = Mesh((Level("gpu", 4),))                      # one level = one node: all intra
    assert inter_intra({"gpu": 10.0}, one) == (0.0, 10.0)


def test_zero_topo_three_levels_secondary_and_quantized():
    sec = Secondary(("gpu", "gcd"), DType.INT8)
    s = strat(M3, ("gcd",), ("gpu", "gcd"), ("node", "gpu", "gcd"), sec=sec, gcomm=DType.INT4)
    us = units(s, 100, 1000)
    # L = lcm(s_P=2, s_G=4, s_OS=8, s_Q=4) = 8: root N = 104, block N = 1000.
    # secondary all-gather over (gpu, gcd), int8, s = 4: 1000/4 = 250 per rank:
    #   4 · (ceil(250·8/8) + ceil(250/256)·4) = 4 · (250 + 4) = 1016
    # qgZ all_to_all over (gpu, gcd), int4: root 104/4 = 26 -> 4·(13 + 4) = 68;
    #   block 250 -> 4·(125 + 4) = 516
    assert table(predict_ledger(s, us)) == [
        ("forward", "all_gather", ("gcd",), 104 * 4, 2),
        ("forward", "all_gather", ("gcd",), 1000 * 4, 2),
        ("backward", "all_gather", ("gpu", "gcd"), 1016, 2),
        ("backward", "all_to_all", ("gpu", "gcd"), 68, 2),
        ("backward", "all_to_all", ("gpu", "gcd"), 516, 2),
        ("sync", "reduce_scatter", ("node",), 104 // 4 * 4, 1),
        ("sync", "reduce_scatter", ("node",), 1000 // 4 * 4, 1),
        ("update", "all_gather", ("node", "gpu"), 104 // 2 * 4, 1),
        ("update", "all_gather", ("node", "gpu"), 1000 // 2 * 4, 1),
    ]
    mem = predict_memory(M3, us)
    assert mem["params"] == (104 + 1000) // 2 * 4 == 2208
    assert mem["params_secondary"] == 250 + 4          # block only (root has no secondary), int8 + scales
    assert mem["grads"] == (104 + 1000) // 4 * 4 == 1104
    assert mem["optim"] == (104 + 1000) // 8 * 8 == 1104
    assert mem["total"] == 2208 + 254 + 1104 + 1104


def test_unquantized_secondary_and_bf16_master():
    # ZeRO++ hpZ without quantization, bf16 params: backward gather over gpu in bf16.
    s = strat(M2, W2, W2, W2, sec=Secondary(("gpu",)), pdtype=DType.BF16, pcomm=DType.BF16)
    us = units(s, 8, 20)
    # L = lcm(8, 8, 8, 4) = 8: root N = 8, block N = 24.
    led = table(predict_ledger(s, us, micro_batches=3))
    assert ("backward", "all_gather", ("gpu",), 24 * 2, 3) in led          # payload(N, bf16)
    assert ("forward", "all_gather", ("node", "gpu"), 8 * 2, 3) in led
    assert not [r for r in led if r[0] == "update"]                        # OS = P
    mem = predict_memory(M2, us)
    assert mem["params_secondary"] == 24 // 4 * 2                          # N/s_Q · b(bf16)
    # s_P = s_OS: the fp32 master is the params shard (lowering [Note: the master is the params shard])
    assert mem["params"] == (8 + 24) // 8 * 4
    assert mem["optim"] == (8 + 24) // 8 * 8                               # m, v; no separate master


def test_ddp_frozen_and_optimizers():
    s = strat(M2)
    us = units(s, (10, 6))
    # DDP: one all-reduce over the world of N·4 = 40 bytes; the frozen group never moves.
    assert table(predict_ledger(s, us)) == [("sync", "all_reduce", W2, 40, 1)]
    assert predict_memory(M2, us, optimizer="sgd", optimizer_kwargs={"momentum": 0.9}) == {
        "params": (10 + 6) * 4, "params_secondary": 0, "grads": 40, "optim": 40,
        "total": 64 + 40 + 40, "transient": 0,
        "startup": 64 + 64}     # the params shard (no grads before the first backward, no fp32 master) + the unit's whole params
    assert predict_memory(M2, us, optimizer="sgd")["optim"] == 0
    assert predict_memory(M2, us, optimizer="adam", optimizer_kwargs={"amsgrad": True})["optim"] == 10 * 12
    assert predict_memory(M2, us, optimizer="rmsprop", optimizer_kwargs={"centered": True})["optim"] == 10 * 8


def test_padding_and_mics_replica_all_reduce():
    s = strat(M2, ("gpu",), ("gpu",), ("gpu",), accumulate=1)
    us = units(s, 10)
    # L = 4: N = 12. MiCS: per-micro-batch RS over gpu, then all-reduce over node of N/s_OS·4 = 12.
    assert table(predict_ledger(s, us)) == [
        ("forward", "all_gather", ("gpu",), 48, 1),
        ("backward", "reduce_scatter", ("gpu",), 48, 1),
        ("sync", "all_reduce", ("node",), 12, 1),
    ]
    # zero3 on 8 ranks: Φ = 10 -> N = 16 (bytes 64), chunk 2 elements.
    z = strat(M2, W2, W2, W2, accumulate=1)
    assert table(predict_ledger(z, units(z, 10)))[0] == ("forward", "all_gather", W2, 64, 1)


def test_clip_and_counts():
    s = strat(M2, (), W2, W2)
    us = units(s, 16, 16, 16)
    led = table(predict_ledger(s, us, micro_batches=4, clip_grad_norm=True))
    # three units of N = 16: the two non-root RS merge with the root's (same bytes): 3 units · 4.
    assert ("backward", "reduce_scatter", W2, 64, 12) in led
    assert ("update", "all_gather", W2, 64, 3) in led
    assert led[-1] == ("update", "all_reduce", W2, 4, 1)
    ddp = strat(M2)                                  # s_OS = 1: the norm is already global
    assert not [r for r in table(predict_ledger(ddp, units(ddp, 16), clip_grad_norm=True)) if r[3] == 4]


def test_ring_versus_hierarchical_link_bytes():
    # One all-gather of V = 6400 bytes over node(2) > gpu(4) (p = 8).
    ring = record_links(Op.ALL_GATHER, W2, 6400, M2, Collectives.RING)
    # ring edges: 2 cross nodes (one per node boundary incl. wrap), 6 stay inside;
    # each carries 7/8·V; averaged over 8 ranks: node 2/8·7/8·6400 = 1400, gpu 6/8·7/8·6400 = 4200.
    assert ring == pytest.approx({"node": 1400.0, "gpu": 4200.0})
    hier = record_links(Op.ALL_GATHER, W2, 6400, M2, Collectives.HIERARCHICAL)
    # stages: gpu 3/4·6400 = 4800; node 1/2·6400/4 = 800.
    assert hier == pytest.approx({"node": 800.0, "gpu": 4800.0})
    assert record_links(Op.ALL_GATHER, W2, 6400, M2, Collectives.HO_RING) == hier
    assert record_links(Op.ALL_REDUCE, ("node",), 100, M2, Collectives.RING) == pytest.approx({"node": 100.0})
    # all_to_all over 8: V/8 to 7 peers; 4 peers are on the other node: 4·800 = 3200, 3·800 = 2400.
    assert record_links(Op.ALL_TO_ALL, W2, 6400, M2, Collectives.RING) == pytest.approx({"node": 3200.0, "gpu": 2400.0})
    # the runtime's qgZ all_to_all ignores the algorithm: one flat all-to-all
    assert record_links(Op.ALL_TO_ALL, W2, 6400, M2, Collectives.HIERARCHICAL) == pytest.approx({"node": 3200.0, "gpu": 2400.0})
    # three levels, ring: p = 8, edges crossing node 2, gpu 2·1 = 2, gcd 4·1 = 4 -> ·7/8·V/8
    r3 = record_links(Op.REDUCE_SCATTER, ("node", "gpu", "gcd"), 800, M3, Collectives.RING)
    assert r3 == pytest.approx({"node": 175.0, "gpu": 175.0, "gcd": 350.0})
    h3 = record_links(Op.REDUCE_SCATTER, ("node", "gpu", "gcd"), 800, M3, Collectives.HIERARCHICAL)
    assert h3 == pytest.approx({"gcd": 400.0, "gpu": 200.0, "node": 100.0})   # 1/2 of 800, 400, 200


def test_paro_table2_inter_volumes():
    # PaRO §3.6 Table 2 with N = 64, g = 8 groups of M = 8, s = 4 micro-batches, Ψ = 64·8·1000.
    mesh = Mesh((Level("node", 8), Level("gpu", 8)))
    psi, n, g, m, acc = 64 * 8 * 1000, 64, 8, 8, 4
    z3 = strat(mesh, W2, W2, W2, accumulate=acc)
    z3_links = link_bytes(predict_ledger(z3, units(z3, psi)), mesh, Collectives.RING)
    # ZeRO3, flat ring, fp32: forward A-G and backward R-S each g·s·Ψ/N·(N−1) inter over all ranks.
    assert z3_links["node"] * n == pytest.approx(2 * g * acc * psi / n * (n - 1) * 4)
    assert z3_links["gpu"] * n == pytest.approx(2 * (n - g) * acc * psi / n * (n - 1) * 4)
    iig = strat(mesh, ("gpu",), ("gpu",), W2, accumulate=acc)
    iig_links = link_bytes(predict_ledger(iig, units(iig, psi)), mesh, Collectives.HIERARCHICAL)
    # PaRO-IIG: inter R-S and A-G once per step, each N·Ψ/N·(g−1) over all ranks.
    assert iig_links["node"] * n == pytest.approx(2 * n * psi / n * (g - 1) * 4)
    # intra: forward A-G, R-S per micro-batch (root unit: no backward re-gather): N·s·Ψ/M·(M−1) each.
    assert iig_links["gpu"] * n == pytest.approx(2 * n * acc * psi / m * (m - 1) * 4)


def test_alpha_beta_times_and_choice():
    ab = AlphaBeta(intra=1e9, inter=1e8, intra_lat=1e-6, inter_lat=1e-5)
    # one level (gpu, p = 4), V = 4e6: 3·(1e-6 + 4e6/(4·1e9))
    assert ab.seconds(Op.ALL_GATHER, ("gpu",), 4e6, M2, Collectives.RING) == pytest.approx(3 * (1e-6 + 1e-3))
    assert ab.seconds(Op.ALL_REDUCE, ("gpu",), 4e6, M2, Collectives.RING) == pytest.approx(6 * (1e-6 + 1e-3))
    # flat ring over 8 ranks: 7 steps at the slowest latency; each level's links carry their
    # share of the ring (2 of its 8 edges cross nodes: 2/8·7/8·V per rank on node links,
    # 6/8·7/8·V on gpu links), all links at once, so the slower level sets the time.
    wire = max(2 / 8 * 7 / 8 * 8e6 / 1e8, 6 / 8 * 7 / 8 * 8e6 / 1e9)
    assert ab.seconds(Op.ALL_GATHER, W2, 8e6, M2, Collectives.RING) == pytest.approx(7 * 1e-5 + wire)
    # hierarchical: gpu stage 3·(1e-6 + 8e6/(4e9)) + node stage 1·(1e-5 + 2e6/(2·1e8))
    hier = 3 * (1e-6 + 2e-3) + (1e-5 + 1e-2)
    assert ab.seconds(Op.ALL_GATHER, W2, 8e6, M2, Collectives.HIERARCHICAL) == pytest.approx(hier)
    # ho-ring: 4 chunks, each stage pays 4 latencies; slowest stage + the other / 4
    gpu, node = 3 * (4e-6 + 2e-3), 4e-5 + 1e-2
    assert ab.seconds(Op.ALL_GATHER, W2, 8e6, M2, Collectives.HO_RING) == pytest.approx(node + gpu / 4)
    z3 = strat(M2, W2, W2, W2)
    assert choose_collectives(z3, [10**7, 10**7], bandwidth=ab) == Collectives.HO_RING
    assert choose_collectives(z3, [10, 10], bandwidth=ab) == Collectives.HIERARCHICAL   # latency-bound
    assert choose_collectives(strat(M2, ("gpu",), ("gpu",), ("gpu",)), [10**7], bandwidth=ab) == Collectives.RING
    explicit = strat(M2, W2, W2, W2, algo=Collectives.RING)
    assert choose_collectives(explicit, [10**7], bandwidth=ab) == Collectives.RING


def test_profile_interpolation(tmp_path):
    f = tmp_path / "bw.json"
    f.write_text(json.dumps({"mesh": [{"name": "node", "size": 2}, {"name": "gpu", "size": 4}], "entries": [
        {"op": "all_gather", "levels": ["gpu"], "algo": "ring", "bytes": 1e6, "seconds": 1e-3, "busbw": 0},
        {"op": "all_gather", "levels": ["gpu"], "algo": "ring", "bytes": 1e8, "seconds": 1e-2, "busbw": 0},
        {"op": "all_gather", "levels": ["node"], "algo": "ring", "bytes": 1e6, "seconds": 1e-2, "busbw": 0},
    ]}))
    prof = Profile.load(str(f))
    # 1e7 is halfway (in log bytes) between 1e6 (1 GB/s) and 1e8 (10 GB/s): 5.5 GB/s.
    assert prof.seconds(Op.ALL_GATHER, ("gpu",), 1e7, M2, Collectives.RING) == pytest.approx(1e7 / 5.5e9)
    assert prof.seconds(Op.ALL_GATHER, ("gpu",), 1e9, M2, Collectives.RING) == pytest.approx(1e9 / 1e10)  # clamped
    # hierarchical composed from one-level entries: gpu stage on 8e6, node stage on 2e6 (1e8 B/s).
    gpu_bw = 1e9 + (9e9) * (0.903089987 / 2)          # log10(8e6) − 6 = 0.903, half the span
    expect = 8e6 / gpu_bw + 2e6 / 1e8
    assert prof.seconds(Op.ALL_GATHER, W2, 8e6, M2, Collectives.HIERARCHICAL) == pytest.approx(expect, rel=1e-6)
    # qgZ's all_to_all is not profiled: it is timed as the ring reduce-scatter it replaces... if present
    from shardc.dsl.errors import ShardcError
    with pytest.raises(ShardcError, match="no reduce_scatter entry over gpu"):
        prof.seconds(Op.ALL_TO_ALL, ("gpu",), 10, M2, Collectives.HIERARCHICAL)
    with pytest.raises(ShardcError, match="no reduce_scatter entry"):
        prof.seconds(Op.REDUCE_SCATTER, ("gpu",), 10, M2, Collectives.RING)
    # auto picks among the algorithms the profile has: only `ring` was measured over node+gpu
    ring2 = [{"op": op, "levels": ["node", "gpu"], "algo": "ring", "bytes": 1e6, "seconds": 1e-3, "busbw": 0}
             for op in ("all_gather", "reduce_scatter")]
    f.write_text(json.dumps({"mesh": [], "entries": ring2}))
    z3 = strat(M2, W2, W2, W2)
    assert choose_collectives(z3, [10**6], bandwidth=Profile.load(str(f))) == Collectives.RING
    rs = {"op": "reduce_scatter", "levels": ["gpu"], "algo": "ring", "bytes": 1e6, "seconds": 2e-3, "busbw": 0}
    f.write_text(json.dumps({"mesh": [], "entries": [rs]}))
    assert Profile.load(str(f)).seconds(Op.ALL_TO_ALL, ("gpu",), 1e6, M2, Collectives.HO_RING) == pytest.approx(2e-3)


def test_profile_cpu_share_and_quantized_entries(tmp_path):
    """[Note: CPU share of a collective]: k = min(T, u·r) with r = compute wall / CPU; a
    quantized collective uses its own entries, else the fp32 ones at its payload size."""
    f = tmp_path / "bw.json"
    ag = {"op": "all_gather", "levels": ["gpu"], "algo": "ring", "busbw": 0}
    f.write_text(json.dumps({"mesh": [], "entries": [
        {**ag, "comm": "fp32", "bytes": 1e6, "seconds": 1e-2, "cpu_seconds": 1e-3},
        {**ag, "comm": "int8", "bytes": 1e6, "seconds": 4e-2, "cpu_seconds": 2e-2}],
        "compute": {"flops": 1e9, "seconds": 0.5, "cpu_seconds": 0.125, "flops_per_s": 2e9}}))
    prof = Profile.load(str(f))
    assert prof.flops == 2e9 and prof.cpu_share == 4.0
    assert prof.cost(Op.ALL_GATHER, ("gpu",), 1e6, M2, Collectives.RING) == pytest.approx((1e-2, 4e-3))
    assert prof.cost(Op.ALL_GATHER, ("gpu",), 1e6, M2, Collectives.RING, "int8") == pytest.approx((4e-2, 4e-2))
    assert prof.cost(Op.ALL_GATHER, ("gpu",), 1e6, M2, Collectives.RING, "int4") == pytest.approx((1e-2, 4e-3))


def test_step_time_places_the_syncs_on_the_last_backward():
    """[Note: sync overlap] (analysis/costmodel/pipeline.py), worked by hand. DDP: one
    all-reduce a_i per unit in the sync phase. The last backward lasts B = 2/3·c; shares by
    parameters (root .2, u1 .1, u2 .3, u3 .4), the root's compute first. Gradients in:
    u3 at .6B, u2 at .9B, u1 at B, the root at B. Each sync is issued when the next unit's
    gradients are in: u3 at .9B, u2, u1 and the root at B; the links run one at a time."""
    from shardc.analysis.costmodel.timing import step_time
    ab = AlphaBeta(intra=1e9, inter=1e8, intra_lat=0.0, inter_lat=0.0)
    s = strat(M2, accumulate=1, algo=Collectives.RING)
    us = units(s, 2_000_000, 1_000_000, 3_000_000, 4_000_000)       # root, u1, u2, u3 (fp32)
    a = {n: ab.seconds(Op.ALL_REDUCE, W2, 4 * n, M2, Collectives.RING) for n in (2e6, 1e6, 3e6, 4e6)}

    def total(c, passes=None):
        return step_time(s, us, ab, micro_batches=1, flops=1.0, mb_flops=c, passes=passes).total

    # a long backward: u3's sync ends before B; u2's, u1's and the root's come after it
    assert total(100.0) == pytest.approx(100.0 + a[3e6] + a[1e6] + a[2e6])
    # B = 5·a3: u3's sync, issued at .9B = B − a3/2, runs a3/2 past the backward
    c = 7.5 * a[4e6]
    assert total(c) == pytest.approx(c + a[4e6] / 2 + a[3e6] + a[1e6] + a[2e6])
    # without early_sync every sync is issued when the backward ends
    assert total(100.0, passes=()) == pytest.approx(100.0 + sum(a.values()))


def test_startup_counts_a_loads_staging():
    # lowering/startup.py [Note: start-up peak]. ZeRO-1 with bf16 params: params replicated
    # (s_P = 1), the fp32 master over the world (s_OS = 8). Root N = 8, block N = 64 (L = 8).
    # A load's staging: a cast read of the block's params chunk from an fp32 file (N·4 = 256
    # bytes, under LOAD_BLOCK), or the re-make of its params shard from the master (its OS
    # chunk sent in bf16, N/8·2, and the gather's output, N·2: 144); both exceed the largest
    # unit's whole parameters (N·2 = 128), so the load sets the start-up peak.
    from shardc.lowering import lower
    from shardc.lowering.startup import load_staging_bytes, shards_bytes, startup_bytes, unit_values_bytes
    s = strat(M2, (), W2, W2, pdtype=DType.BF16, pcomm=DType.BF16)
    plan = lower(M2, units(s, 8, 64), s.prefetch)
    assert unit_values_bytes(plan) == 64 * 2
    assert shards_bytes(plan) == (8 + 64) * 2 + (8 + 64) // 8 * 4        # bf16 params + fp32 master chunk
    # torch's DCP reader (the recipe): two saved chunks of an fp32 checkpoint, at most the two
    # largest groups (64 + 8 elements)
    assert load_staging_bytes(plan) == max(64 * 4, 64 // 8 * 2 + 64 * 2, (64 + 8) * 4)
    assert startup_bytes(plan) == shards_bytes(plan) + (64 + 8) * 4
    assert predict_memory(M2, units(s, 8, 64))["startup"] == startup_bytes(plan)
