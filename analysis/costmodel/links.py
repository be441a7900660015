"""Link traffic — bytes each rank sends over each mesh level's links per step.

Input: ledger records, the mesh, and the collective algorithm for multi-level groups.
Output: `{level: bytes}` averaged over ranks (the sum over all ranks is `world` times
this; PaRO Table 2 reports that sum), and the intra/inter split.

[Note: which link a byte crosses]
Ranks are numbered mixed-radix over the mesh levels, innermost fastest. A message
between two ranks crosses the link of the outermost level in which their coordinates
differ ("inter" = the outermost mesh level, "intra" = every other level).
- ring over a group of p = Π p_i ranks (levels i = 1..k, outermost first): the ring
  has p edges; (Π_{j<i} p_j)(p_i − 1) of them change level i as their outermost digit,
  plus the wrap-around edge on level 1. Each edge carries (p−1)·V/p for an all-gather or
  reduce-scatter (twice that for an all-reduce), so per rank, averaged:
  bytes_i = edges_i / p · (p−1)/p · V.  For node(g) > gpu(M) this is PaRO's
  "g·(N−1)·V/N inter + (N−g)·(N−1)·V/N intra" summed over ranks.
- hierarchical (and ho-ring, which only overlaps the same stages): one ring per level,
  innermost first for a reduce-scatter (outermost first for an all-gather); the stage
  on level i moves V_i = V / Π_{j>i} p_j, so bytes_i = (p_i − 1)/p_i · V_i.
- all_to_all: each rank sends V/p to each peer; (p_i − 1)·Π_{j>i} p_j peers differ
  first at level i. The runtime's qgZ all_to_all ignores the algorithm (one flat
  all-to-all over the group), so all_to_all is always counted flat.
Levels of size 1 carry nothing and are dropped first.
"""
from __future__ import annotations

from math import prod

from shardc.dsl.ir import Collectives, Mesh
from shardc.lowering import Op

FACTOR = {Op.ALL_GATHER: 1, Op.REDUCE_SCATTER: 1, Op.ALL_REDUCE: 2, Op.ALL_TO_ALL: 1, Op.BROADCAST: 1}


def _sizes(mesh: Mesh, levels) -> list[tuple[str, int]]:
    return [(l, mesh.size(l)) for l in mesh.ordered(levels) if mesh.size(l) > 1]


def flat_ring(op: Op, sizes: list[tuple[str, int]], v: float) -> dict[str, float]:
    """Per-rank bytes per level for one flat collective over the flattened group."""
    p = prod(s for _, s in sizes)
    out: dict[str, float] = {}
    if p <= 1:
        return out
    outer = 1
    for i, (name, s) in enumerate(sizes):
        inner = prod(x for _, x in sizes[i + 1:])
        if op is Op.ALL_TO_ALL:
            out[name] = (s - 1) * inner * v / p
        else:
            edges = outer * (s - 1) + (1 if i == 0 else 0)
            out[name] = FACTOR[op] * edges / p * (p - 1) / p * v
        outer *= s
    return out


def staged(op: Op, sizes: list[tuple[str, int]], v: float) -> dict[str, float]:
    """Per-rank bytes per level for the hierarchical (level-by-level) algorithm."""
    out: dict[str, float] = {}
    for i, (name, s) in enumerate(sizes):
        inner = prod(x for _, x in sizes[i + 1:])
        out[name] = FACTOR[op] * (s - 1) / s * v / inner
    return out


def _chain(sizes: list[tuple[str, int]], v: float) -> dict[str, float]:
    p = prod(s for _, s in sizes)
    out, outer = {}, 1
    for name, s in sizes:
        out[name] = outer * (s - 1) * v / p
        outer *= s
    return out


def record_links(op: Op, levels, nbytes: float, mesh: Mesh, algo: Collectives) -> dict[str, float]:
    """Per-rank bytes per level of one collective of `nbytes` over `levels`."""
    sizes = _sizes(mesh, levels)
    if len(sizes) > 1 and op is not Op.ALL_TO_ALL and algo in (Collectives.HIERARCHICAL, Collectives.HO_RING, Collectives.AUTO):
        return staged(op, sizes, nbytes)
    if op is Op.BROADCAST:   # a chain of p − 1 edges, each carrying the whole V
        return _chain(sizes, nbytes)
    return flat_ring(op, sizes, nbytes)


def link_bytes(records, mesh: Mesh, algo: Collectives = Collectives.RING) -> dict[str, float]:
    """Per-rank bytes sent over each level's links in one step (every level listed);
    `records` are ledger records, which spell their op (`Op` values)."""
    out = {name: 0.0 for name in mesh.names}
    for r in records:
        for level, b in record_links(Op(r.op), r.levels, r.bytes, mesh, algo).items():
            out[level] += b * r.count
    return out


def inter_intra(links: dict[str, float], mesh: Mesh) -> tuple[float, float]:
    """(inter, intra): bytes on the outermost level's links, and on all the others.

    A one-level mesh is one node (as in the alpha-beta model): everything is intra.
    """
    if len(mesh.names) < 2:
        return 0.0, sum(links.values())
    outer = mesh.names[0]
    return links.get(outer, 0.0), sum(b for k, b in links.items() if k != outer)
