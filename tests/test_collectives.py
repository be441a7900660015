"""Collectives: every algorithm x op x digit order against a reference computed from the
definition (chunk c of the full buffer belongs to the group member whose index over
`order` is c), quantized paths within their error bound, payload sizes by hand."""
from __future__ import annotations

import itertools

import pytest
import torch

from shardc.dsl.ir import Collectives, DType, Level, Mesh
from tests.harness import dist_run

M22 = Mesh((Level("node", 2), Level("gpu", 2)))
M24 = Mesh((Level("node", 2), Level("gpu", 4)))
M222 = Mesh((Level("a", 2), Level("b", 2), Level("c", 2)))
ALGOS = (Collectives.RING, Collectives.HIERARCHICAL, Collectives.HO_RING, Collectives.AUTO)


# -- reference, from the definition ------------------------------------------------------
def coords(mesh: Mesh, r: int) -> dict[str, int]:
    out = {}
    for lvl in reversed(mesh.levels):
        r, out[lvl.name] = divmod(r, lvl.size)
    return out


def members(mesh: Mesh, rank: int, order: tuple[str, ...]) -> list[int]:
    """Group of `rank` over the levels of `order`, listed by chunk index."""
    me = coords(mesh, rank)
    same = [r for r in range(mesh.world)
            if all(coords(mesh, r)[n] == me[n] for n in mesh.names if n not in order)]

    def idx(r):
        i = 0
        for n in order:
            i = i * mesh.size(n) + coords(mesh, r)[n]
        return i
    return sorted(same, key=idx)


def data(rank: int, case: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    return torch.randn(n, generator=g)


def references(grp: list[int], me: int, case: int, m: int):
    """What rank `grp[me]` must get on `case`, from the inputs alone: the all-gather (the
    group's chunks in chunk order), the reduce-scatter's inputs (every member's full
    tensor) and result (the sum of their chunk `me`), the all-reduce (the members' sum)."""
    ag = torch.cat([data(r, case, m) for r in grp])
    full = [data(r, case, len(grp) * m) for r in grp]
    rs = sum(x[me * m:(me + 1) * m] for x in full)
    ar = sum(data(r, case, 2 * m + 1) for r in grp)
    return ag, full, rs, ar


def cases(mesh: Mesh):
    for k in range(1, len(mesh.names) + 1):
        for levels in itertools.combinations(mesh.names, k):
            for order in itertools.permutations(levels):
                yield levels, order


# -- rank functions ------------------------------------------------------------------------
def _float_paths(rank, world, mesh, m):
    from shardc.runtime.eager import collectives as C
    from shardc.runtime.transport.mesh import ShardMesh

    sm = ShardMesh(mesh)
    bad, done = [], 0
    for case, (levels, order) in enumerate(cases(mesh)):
        grp = members(mesh, rank, order)
        s, me = len(grp), grp.index(rank)
        ag_ref, rs_full, rs_ref, ar_ref = references(grp, me, case, m)
        ring_rs = None
        for algo in ALGOS:
            out = torch.full((s * m,), float("nan"))
            w = C.all_gather(out, data(rank, case, m), sm, levels, order, algo=algo)
            w.wait()
            if not torch.equal(out, ag_ref):
                bad.append(("all_gather", levels, order, algo))
            rs = torch.full((m,), float("nan"))
            C.reduce_scatter(rs, rs_full[me], sm, levels, order, algo=algo).wait()
            if not torch.allclose(rs, rs_ref, rtol=1e-5, atol=1e-6):
                bad.append(("reduce_scatter", levels, order, algo))
            ring_rs = rs if ring_rs is None else ring_rs
            if not torch.allclose(rs, ring_rs, rtol=1e-5, atol=1e-6):
                bad.append(("reduce_scatter vs ring", levels, order, algo))
            t = data(rank, case, 2 * m + 1)
            w = C.all_reduce(t, sm, levels, algo=algo)
            assert w.wait() and w.is_completed()
            if not torch.allclose(t, ar_ref, rtol=1e-5, atol=1e-6):
                bad.append(("all_reduce", levels, order, algo))
            done += 3
    return bad, done


def _lowp_paths(rank, world, mesh, m):
    """bf16 comm: all_gather is exactly the bf16 rounding; reduce_scatter sums close to fp32."""
    from shardc.runtime.eager import collectives as C
    from shardc.runtime.transport.mesh import ShardMesh

    sm = ShardMesh(mesh)
    bad = []
    levels, order = mesh.names, tuple(reversed(mesh.names))
    grp = members(mesh, rank, order)
    s, me = len(grp), grp.index(rank)
    for algo in ALGOS:
        out = torch.empty(s * m)
        C.all_gather(out, data(rank, 7, m), sm, levels, order, algo=algo, comm=DType.BF16).wait()
        if not torch.equal(out, torch.cat([data(r, 7, m).bfloat16().float() for r in grp])):
            bad.append(("all_gather bf16", algo))
        rs = torch.empty(m)
        C.reduce_scatter(rs, data(rank, 8, s * m), sm, levels, order, algo=algo, comm=DType.BF16).wait()
        ref = sum(data(r, 8, s * m)[me * m:(me + 1) * m] for r in grp)
        if not torch.allclose(rs, ref, rtol=2e-2, atol=2e-2 * s):
            bad.append(("reduce_scatter bf16", algo, (rs - ref).abs().max().item()))
    return bad


def _quant_paths(rank, world, mesh, m):
    from shardc.runtime.eager import collectives as C
    from shardc.runtime.transport import quant
    from shardc.runtime.transport.mesh import ShardMesh

    sm = ShardMesh(mesh)
    bad = []
    for case, (levels, order) in enumerate(cases(mesh)):
        grp = members(mesh, rank, order)
        s, me = len(grp), grp.index(rank)
        for dt in (DType.INT8, DType.INT4):
            # qwZ all_gather: exactly every rank's dequantized shard, placed by chunk index
            xs = [data(r, case, m) for r in grp]
            want = torch.cat([quant.dequantize(quant.quantize(x, dt), m, dt) for x in xs])
            bound = torch.cat([quant.error_bound(x, dt) for x in xs])
            for algo in ALGOS:
                out = torch.empty(s * m)
                C.all_gather(out, xs[me], sm, levels, order, algo=algo, comm=dt).wait()
                if not torch.equal(out, want):
                    bad.append(("qwZ", levels, order, algo, dt))
            if ((out - torch.cat(xs)).abs() > bound).any():
                bad.append(("qwZ bound", levels, order, dt))
            # qgZ reduce_scatter: sum of the dequantized chunks, within the summed bounds
            full = [data(r, 100 + case, s * m) for r in grp]
            chunks = [x[me * m:(me + 1) * m] for x in full]
            rs = torch.empty(m)
            C.reduce_scatter(rs, full[me], sm, levels, order, comm=dt).wait()
            deq = sum(quant.dequantize(quant.quantize(c, dt), m, dt) for c in chunks)
            if not torch.allclose(rs, deq, rtol=1e-5, atol=1e-5):
                bad.append(("qgZ", levels, order, dt))
            if ((rs - sum(chunks)).abs() > sum(quant.error_bound(c, dt) for c in chunks) + 1e-5).any():
                bad.append(("qgZ bound", levels, order, dt))
    return bad


def _bounded_blocks(rank, world, mesh, m, cap):
    """The gloo reduce-scatter past its receive bound ([Note: bounded all-to-all]): the
    same result for every algorithm and order, no receive buffer over the bound."""
    from shardc.runtime.eager import collectives as C
    from shardc.runtime.transport.mesh import ShardMesh
    from shardc.runtime.groups.workspace import Workspace

    sm, ws, taken = ShardMesh(mesh), Workspace(), []
    take = ws.take
    ws.take = lambda n, dtype, dev, role="flat": taken.append(n * dtype.itemsize) or take(n, dtype, dev, role)
    bad, bound = [], C.RS_RECV_BYTES
    C.RS_RECV_BYTES = cap                 # this pooled worker runs later tests: put it back
    try:
        for case, (levels, order) in enumerate(cases(mesh)):
            grp = members(mesh, rank, order)
            me = grp.index(rank)
            _, rs_full, rs_ref, _ = references(grp, me, case, m)
            for algo in ALGOS:
                rs = torch.full((m,), float("nan"))
                C.reduce_scatter(rs, rs_full[me], sm, levels, order, algo=algo, scratch=ws).wait()
                if not torch.allclose(rs, rs_ref, rtol=1e-5, atol=1e-6):
                    bad.append((levels, order, algo))
    finally:
        C.RS_RECV_BYTES = bound
    return bad, max(taken)


def _ho_ring_is_pipelined(rank, world, mesh):
    from shardc.runtime.eager import collectives as C
    from shardc.runtime.transport.mesh import ShardMesh

    sm = ShardMesh(mesh)
    out = torch.empty(world * 64)
    w = C.all_gather(out, torch.full((64,), float(rank)), sm, mesh.names, algo=Collectives.HO_RING)
    in_flight = len(w._pending)          # every piece's first stage was issued before wait()
    w.wait()
    return in_flight, torch.equal(out, torch.arange(world).float().repeat_interleave(64))


# -- tests ---------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize("mesh", [M22, M24, M222], ids=str)
def test_every_algo_and_order_matches_reference(mesh):
    results = dist_run(mesh.world, _float_paths, mesh, 7)     # 7: uneven HO-Ring pieces
    for bad, done in results:
        assert not bad, bad[:5]
        assert done > 0


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", [M24, M222], ids=str)
def test_quantized_within_bound(mesh):
    for bad in dist_run(mesh.world, _quant_paths, mesh, 300):  # 300: two blocks, the last one short
        assert not bad, bad[:5]


@pytest.mark.distributed
def test_bf16_comm():
    for bad in dist_run(8, _lowp_paths, M222, 33):
        assert not bad, bad


@pytest.mark.distributed
def test_reduce_scatter_receives_in_bounded_blocks():
    # 48 bytes: 3 fp32 columns per block over 4 ranks, 6 over 2; 7 columns: uneven blocks
    for bad, biggest in dist_run(4, _bounded_blocks, M22, 7, 48):
        assert not bad, bad[:5]
        assert biggest <= 48


@pytest.mark.distributed
def test_ho_ring_pieces_in_flight():
    from shardc import algorithms
    HO_PIECES = algorithms.get("ho-ring").pieces

    for in_flight, ok in dist_run(4, _ho_ring_is_pipelined, M22):
        assert ok and in_flight == HO_PIECES


def test_payload_bytes_hand_computed():
    from shardc.runtime.transport.quant import payload_bytes, quantize, shard_payload_bytes

    # s * (ceil((n//s)*bits/8) + ceil((n//s)/256)*4)
    assert payload_bytes(1024, 4, DType.INT8) == 4 * (256 + 1 * 4)          # 1040
    assert payload_bytes(1024, 4, DType.INT4) == 4 * (128 + 1 * 4)          # 528
    assert payload_bytes(3000, 2, DType.INT4) == 2 * (750 + 6 * 4)          # m=1500: 6 blocks
    assert payload_bytes(999, 3, DType.INT8) == 3 * (333 + 2 * 4)           # m=333: 2 blocks
    assert payload_bytes(10, 2, DType.INT4) == 2 * (3 + 1 * 4)              # m=5: ceil(2.5)=3
    assert payload_bytes(1000, 4, DType.FP32) == 4000
    assert payload_bytes(1000, 4, DType.BF16) == 2000
    for m, dt in [(5, DType.INT4), (333, DType.INT8), (1500, DType.INT4)]:
        assert quantize(torch.randn(m), dt).numel() == shard_payload_bytes(m, dt)


def _stage_log(rank, world, mesh, m):
    """Record every torch.distributed call the collectives make: (op, varying levels, in, out)."""
    import torch.distributed as dist

    from shardc.runtime.eager import collectives as C
    from shardc.runtime.transport.mesh import ShardMesh

    sm = ShardMesh(mesh)
    log = []

    def levels_of(pg):
        ranks = dist.get_process_group_ranks(pg)
        return tuple(n for n in mesh.names if len({coords(mesh, r)[n] for r in ranks}) > 1)

    def spy(name):
        real = getattr(dist, name)

        def call(*a, **kw):
            out, inp = (a[0], None) if name == "all_reduce" else (a[0], a[1])
            log[-1][1].append((name, levels_of(kw["group"]), (inp if inp is not None else out).numel(), out.numel()))
            return real(*a, **kw)
        return real, call

    names = ("all_gather_single", "all_to_all_single", "all_reduce")
    saved = {}
    for nm in names:
        saved[nm], fake = spy(nm)
        setattr(dist, nm, fake)
    try:
        full = torch.zeros(world * m)
        for algo in (Collectives.RING, Collectives.HIERARCHICAL, Collectives.HO_RING):
            log.append((("ag", algo), []))
            C.all_gather(full, torch.zeros(m), sm, mesh.names, algo=algo).wait()
            log.append((("rs", algo), []))
            C.reduce_scatter(torch.zeros(m), full, sm, mesh.names, algo=algo).wait()
            log.append((("ar", algo), []))
            C.all_reduce(full, sm, mesh.names, algo=algo).wait()
    finally:
        for nm in names:
            setattr(dist, nm, saved[nm])
    return dict(log)


@pytest.mark.distributed
def test_hierarchical_stages_carry_one_over_inner_on_outer_links():
    m = 16                                   # per-rank chunk; n = 8m over node(2) > gpu(4)
    n = 8 * m
    R, H, HO = Collectives.RING, Collectives.HIERARCHICAL, Collectives.HO_RING
    log = dist_run(8, _stage_log, M24, m)[5]
    both = ("node", "gpu")
    # ring: one flat collective over the 8-rank group (gloo reduce-scatter = all_to_all + local sum)
    assert log[("ag", R)] == [("all_gather_single", both, m, n)]
    assert log[("rs", R)] == [("all_to_all_single", both, n, n)]
    assert log[("ar", R)] == [("all_reduce", both, n, n)]
    # hierarchical: all-gather outer level first on the small chunk, then inner on n/4 -> n
    assert log[("ag", H)] == [("all_gather_single", ("node",), m, 2 * m),
                              ("all_gather_single", ("gpu",), 2 * m, n)]
    # reduce-scatter inner first on n, then outer on n/4 (= n / inner)
    assert log[("rs", H)] == [("all_to_all_single", ("gpu",), n, n),
                              ("all_to_all_single", ("node",), n // 4, n // 4)]
    # all-reduce: inner reduce-scatter, outer all-reduce on n/4, inner all-gather
    assert log[("ar", H)] == [("all_to_all_single", ("gpu",), n, n), ("all_reduce", ("node",), n // 4, n // 4),
                              ("all_gather_single", ("gpu",), n // 4, n)]
    # ho-ring: the same stages on 4 pieces; every piece's first stage is issued before any second stage
    ag = log[("ag", HO)]
    assert ag[:4] == [("all_gather_single", ("node",), m // 4, m // 2)] * 4
    assert ag[4:] == [("all_gather_single", ("gpu",), m // 2, 2 * m)] * 4
    rs = log[("rs", HO)]
    assert rs[:4] == [("all_to_all_single", ("gpu",), n // 4, n // 4)] * 4
    assert rs[4:] == [("all_to_all_single", ("node",), n // 16, n // 16)] * 4
