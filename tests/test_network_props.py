"""Hypothesis properties of the network model (analysis/costmodel/network.py, timing.py) on
random meshes of 2–4 levels: the three ways of saying "every inner level goes through
one in-node link" cost every collective alike ([Note: one in-node link]); every level on
one link is the textbook ring; and splitting an inner level in two (`gpu(8)` as
`gpu(2) > lane(4)`, how a strategy writes "4 of 8") leaves a flat ring's time unchanged.
Expected times are the ring formula written out here, not read from the model."""
from __future__ import annotations

from math import prod

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardc.analysis.costmodel.network import LevelLinks
from shardc.analysis.costmodel.timing import AlphaBeta
from shardc.dsl.ir import Collectives, Level, Mesh
from shardc.lowering import Op

OPS = (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE, Op.ALL_TO_ALL)
FACTOR = {Op.ALL_GATHER: 1, Op.REDUCE_SCATTER: 1, Op.ALL_REDUCE: 2, Op.ALL_TO_ALL: 1}   # ring passes over V
# A fallback no case should read: any leak of it moves the time by orders of magnitude.
DECOY = AlphaBeta(intra=1e3, inter=1e2, intra_lat=1.0, inter_lat=3.0)


@st.composite
def collectives(draw, min_levels=2):
    names = ("node", "gpu", "lane", "die")[:draw(st.integers(min_levels, 4))]
    mesh = Mesh(tuple(Level(n, draw(st.integers(1, 5))) for n in names))
    levels = tuple(n for n in names if draw(st.booleans())) or names
    return mesh, levels, draw(st.sampled_from(OPS)), draw(st.floats(1.0, 1e10))


ALGOS = st.sampled_from([Collectives.RING, Collectives.HIERARCHICAL, Collectives.HO_RING])
LINK = st.tuples(st.floats(1e8, 1e12), st.floats(0.0, 1e-4))     # (bytes/s, latency s)


@settings(max_examples=300, deadline=None)
@given(collectives(), ALGOS, LINK, LINK)
def test_three_spellings_of_one_in_node_link_agree(case, algo, inner, outer):
    mesh, levels, op, v = case
    (w_in, a_in), (w_out, a_out) = inner, outer
    outer_name, first_inner = mesh.names[0], mesh.names[1]
    two_tier = AlphaBeta(intra=w_in, inter=w_out, intra_lat=a_in, inter_lat=a_out)
    named = ((outer_name, w_out, a_out), (first_inner, w_in, a_in))
    shared = LevelLinks(named, DECOY, tuple((n, first_inner) for n in mesh.names[2:]))
    unnamed = LevelLinks(named, DECOY)        # inner levels not named: the first inner level's link
    t = two_tier.seconds(op, levels, v, mesh, algo)
    assert shared.seconds(op, levels, v, mesh, algo) == pytest.approx(t, rel=1e-12)
    assert unnamed.seconds(op, levels, v, mesh, algo) == pytest.approx(t, rel=1e-12)


@settings(max_examples=300, deadline=None)
@given(collectives(min_levels=1), LINK)
def test_every_level_on_one_link_is_the_textbook_ring(case, link):
    # A flat ring over p ranks on one link: FACTOR·(p−1) steps of α, and FACTOR·(p−1)/p·V
    # bytes per rank at w.
    mesh, levels, op, v = case
    w, alpha = link
    owner = mesh.names[-1]
    bw = LevelLinks(((owner, w, alpha),), DECOY, tuple((n, owner) for n in mesh.names[:-1]))
    p = prod(mesh.size(n) for n in levels)
    expected = FACTOR[op] * (p - 1) * alpha + FACTOR[op] * (p - 1) / p * v / w
    assert bw.seconds(op, levels, v, mesh, Collectives.RING) == pytest.approx(expected, rel=1e-12)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.integers(2, 4), st.integers(2, 4), st.booleans(), st.sampled_from(OPS),
       st.floats(1.0, 1e10), LINK, LINK)
def test_splitting_an_inner_level_keeps_a_flat_ring(nodes, k, m, across, op, v, inner, outer):
    # node(n) > gpu(k·m) against node(n) > gpu(k) > lane(m), the two-tier default: a ring
    # over the whole node (and across nodes if `across`) sends the same bytes through each
    # GPU's one in-node link in the same k·m−1 in-node steps.
    (w_in, a_in), (w_out, a_out) = inner, outer
    bw = AlphaBeta(intra=w_in, inter=w_out, intra_lat=a_in, inter_lat=a_out)
    whole = Mesh((Level("node", nodes), Level("gpu", k * m)))
    split = Mesh((Level("node", nodes), Level("gpu", k), Level("lane", m)))
    head = ("node",) if across else ()
    t_whole = bw.seconds(op, head + ("gpu",), v, whole, Collectives.RING)
    t_split = bw.seconds(op, head + ("gpu", "lane"), v, split, Collectives.RING)
    assert t_split == pytest.approx(t_whole, rel=1e-12)
