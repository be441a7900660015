"""Link traffic — bytes each rank sends over each mesh level's links per step.

Input: ledger records, the mesh, and the collective algorithm for multi-level groups
(its stages: shardc.algorithms).
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
- staged algorithms (hierarchical, ho-ring: shardc.algorithms): the sum over the
  algorithm's stages of each stage's flat collective; hierarchically, one ring per
  level, innermost first for a reduce-scatter (outermost first for an all-gather); the
  stage on level i moves V_i = V / Π_{j>i} p_j, so bytes_i = (p_i − 1)/p_i · V_i.
- all_to_all: each rank sends V/p to each peer; (p_i − 1)·Π_{j>i} p_j peers differ
  first at level i. The runtime's qgZ all_to_all ignores the algorithm (one flat
  all-to-all over the group), so all_to_all is always counted flat.
Levels of size 1 carry nothing and are dropped first.
"""
from __future__ import annotations

import shardc.algorithms as algorithms
from shardc.algorithms.base import FACTOR as _FACTOR, flat_bytes
from shardc.dsl.ir import Collectives, Mesh
from shardc.lowering import Op, row_mesh

FACTOR = {Op(k): v for k, v in _FACTOR.items()}


def _sizes(mesh: Mesh, levels) -> list[tuple[str, int]]:
    return [(l, mesh.size(l)) for l in mesh.ordered(levels) if mesh.size(l) > 1]


def flat_ring(op: Op, sizes: list[tuple[str, int]], v: float) -> dict[str, float]:
    """Per-rank bytes per level for one flat collective over the flattened group."""
    return flat_bytes(Op(op).value, sizes, v)


def record_links(op: Op, levels, nbytes: float, mesh: Mesh, algo: Collectives) -> dict[str, float]:
    """Per-rank bytes per level of one collective of `nbytes` over `levels`: the sum over
    the algorithm's stages of each stage's flat collective (shardc.algorithms)."""
    key = tuple(l for l, _ in _sizes(mesh, levels))
    out: dict[str, float] = {}
    if not key:
        return out
    for sop, slv, v in algorithms.resolve(algo, key).stages(Op(op).value, key, mesh.ordered, mesh.size, nbytes):
        for level, b in flat_bytes(sop, _sizes(mesh, slv), v).items():
            out[level] = out.get(level, 0.0) + b
    return out


def link_bytes(records, mesh: Mesh, algo: Collectives = Collectives.RING, meshes=None) -> dict[str, float]:
    """Per-rank bytes sent over each level's links in one step (every level listed);
    `records` are ledger records, which spell their op (`Op` values); a record over another
    placement's mesh (`over`) is on that mesh in `meshes` (`placement_meshes`), whose levels
    are the same links."""
    out = {name: 0.0 for name in mesh.names}
    for r in records:
        on = row_mesh(r, mesh, meshes)
        for level, b in record_links(Op(r.op), r.levels, r.bytes, on, algo).items():
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
