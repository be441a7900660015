"""Hypothesis properties of the lowering on random meshes (1–4 levels) and random valid
scopes: padding divides every shard factor, each rank's optim chunk lies inside its grad
chunk inside its params chunk, and every group's rows are exactly the rule table of
docs/internals.md ("Ledger"), whose formulas are written out again here."""
from __future__ import annotations

from math import ceil, prod

from hypothesis import given, settings
from hypothesis import strategies as st

from shardc.dsl.ir import STATES, DType, GradsSpec, Level, Mesh, OptimSpec, ParamsSpec, Scopes, Secondary
from shardc.lowering import RankPlan, UnitSize, lower

DTYPE_BITS = {DType.FP32: 32, DType.BF16: 16, DType.FP16: 16, DType.INT8: 8, DType.INT4: 4}


def _subset(draw, levels):
    return tuple(l for l in levels if draw(st.booleans()))


@st.composite
def cases(draw):
    names = ("a", "b", "c", "d")[:draw(st.integers(1, 4))]
    mesh = Mesh(tuple(Level(n, draw(st.integers(1, 4))) for n in names))
    os_ = _subset(draw, names)
    g = _subset(draw, os_)
    p = _subset(draw, g)
    sec = None
    if p and draw(st.booleans()):
        sec = Secondary(_subset(draw, p), draw(st.sampled_from([None, DType.INT8, DType.INT4])))
    pcomm = draw(st.sampled_from([DType.FP32, DType.BF16, DType.INT8])) if p else DType.FP32
    gcomm = draw(st.sampled_from([DType.FP32, DType.BF16, DType.INT8, DType.INT4])) if g else DType.FP32
    scopes = Scopes(ParamsSpec(p, sec, pcomm, draw(st.sampled_from([DType.FP32, DType.BF16, DType.FP16]))),
                    GradsSpec(g, gcomm, draw(st.sampled_from([DType.FP32, DType.BF16]))), OptimSpec(os_))
    unit = UnitSize("u", draw(st.integers(0, 5000)), draw(st.integers(0, 300)), scopes,
                    root=draw(st.booleans()))
    return mesh, unit


def b(dt):
    return DTYPE_BITS[dt] // 8


def payload(n, s, dt):
    if dt in (DType.INT8, DType.INT4):
        m = n // s
        return s * (ceil(m * DTYPE_BITS[dt] / 8) + ceil(m / 256) * 4)
    return n * b(dt)


def expected_rows(mesh, sc, n, trainable, root):
    size = lambda lv: prod(mesh.size(l) for l in lv)            # noqa: E731
    P, G, OS = sc.params.levels, sc.grads.levels, sc.optim.levels
    out = set()
    if size(P) > 1:
        out.add(("forward", "all_gather", P, payload(n, size(P), sc.params.comm), "forward"))
        sec = sc.params.secondary
        if not root and sec is None:
            out.add(("backward", "all_gather", P, payload(n, size(P), sc.params.comm), "backward"))
        elif not root and size(sec.levels) > 1:
            out.add(("backward", "all_gather", sec.levels,
                     payload(n, size(sec.levels), sec.quant or sc.params.dtype), "backward"))
    if not trainable:
        return out
    if size(G) > 1:
        op = "all_to_all" if sc.grads.comm in (DType.INT8, DType.INT4) else "reduce_scatter"
        out.add(("backward", op, G, payload(n, size(G), sc.grads.comm), "backward"))
    minus = lambda a, c: tuple(l for l in mesh.names if l in a and l not in c)   # noqa: E731
    if size(minus(OS, G)) > 1:
        out.add(("sync", "reduce_scatter", minus(OS, G), n // size(G) * b(sc.grads.dtype), "step"))
    if size(minus(mesh.names, OS)) > 1:
        out.add(("sync", "all_reduce", minus(mesh.names, OS), n // size(OS) * b(sc.grads.dtype), "step"))
    if size(minus(OS, P)) > 1:
        out.add(("update", "all_gather", minus(OS, P), n // size(P) * b(sc.params.dtype), "step"))
    return out


@settings(max_examples=300, deadline=None)
@given(cases())
def test_padding_chunks_and_rows(case):
    mesh, unit = case
    plan = lower(mesh, [unit]).units[0]
    sc = unit.scopes
    s = {k: prod(mesh.size(l) for l in getattr(sc, k).levels) for k in STATES}
    s_q = prod(mesh.size(l) for l in sc.params.secondary.levels) if sc.params.secondary else 1
    assert [g.phi for g in plan.groups] == [x for x in (unit.trainable, unit.frozen) if x]
    for g in plan.groups:
        factors = [s["params"], s_q] + ([s["grads"], s["optim"]] if g.trainable else [])
        assert all(g.n % f == 0 for f in factors)                            # padding divisibility
        assert g.phi <= g.n < g.phi + prod(factors)                          # and no more than needed
        rows = {(r.phase.value, r.op.value, r.levels, r.bytes, r.per.value) for r in g.rows}
        assert rows == expected_rows(mesh, sc, g.n, g.trainable, unit.root)
        assert len(rows) == len(g.rows)
        if not g.trainable:
            continue
        for rank in range(mesh.world):                                        # chunk nesting
            rp = RankPlan(mesh, sc, rank)
            (p0, pl), (g0, gl), (o0, ol) = (rp.chunk(k, g.n) for k in STATES)
            assert (pl, gl, ol) == (g.n // s["params"], g.n // s["grads"], g.n // s["optim"])
            assert p0 <= g0 and g0 + gl <= p0 + pl
            assert g0 <= o0 and o0 + ol <= g0 + gl


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=9), st.integers(0, 4))
def test_schedule_issues_each_gather_once_before_its_unit_runs(gathered, k):
    from shardc.lowering import schedule
    sched = schedule(gathered, k)
    g_fwd = [i for i in range(1, len(gathered)) if gathered[i]]
    for direction, order, run in (("forward", g_fwd, "run"), ("backward", g_fwd[::-1], "backward")):
        stages = getattr(sched, direction)
        issued = [j for s in stages for j in s.issue if j != 0]
        assert sorted(issued) == sorted(order)                                  # each exactly once
        seen: list[int] = []
        for s in stages:
            seen += s.issue
            assert s.unit in seen or not gathered[s.unit]                         # issued before it runs
            ahead = [j for j in seen if j != 0 and order.index(j) > order.index(s.unit)] if s.unit in order else []
            assert len(ahead) <= k                                                # at most k prefetched
