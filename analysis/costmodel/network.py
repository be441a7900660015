"""Network model — seconds of one collective from per-level links and the algorithm.

Input: a collective (op, the mesh levels it spans, its logical bytes V), the mesh, the
algorithm (ring, hierarchical, HO-Ring) and a link per level: bandwidth per rank
(bytes/s) and latency per ring step. Output: seconds. `LevelLinks` holds links for
any number of levels (`--link node=25GB/s --link gpu=200GB/s --link gcd=50GB/s`), and
levels that share another level's links (`--link lane=gpu`, [Note: shared links]);
`AlphaBeta` in `timing.py` is its two-tier shorthand (`--intra/--inter`).

[Note: flat ring over several levels]
A flat ring over p = Π p_i ranks sends, per rank, FACTOR·(p−1)/p·V in p−1 steps
(FACTOR = 2 for an all-reduce). NCCL runs one ring per channel and every channel
crosses each boundary through a different rank's link, so a level's traffic is
spread over all of its links: each rank's level-i link carries the average of
`links.flat_ring` (edges_i/p · FACTOR·(p−1)/p·V; for node(g) > gpu(M) that is 1/M of
the ring's bytes on every GPU's inter-node link). The links run at once, so the ring
takes max_i(bytes_i / w_i) plus FACTOR·(p−1) steps of the slowest latency. (The
model before this one ran the whole ring at one GPU's inter-node bandwidth, M times
too slow, and predicted HO-Ring 92 % faster where PaRO measured 32.6 %.)

[Note: staged algorithms]
`hierarchical` runs one ring per level on V_i = V/Π(inner sizes), one after the
other: Σ t_i with t_i = FACTOR·(p_i−1)·(α_i + V_i/(p_i·w_i)) (an all-reduce is its
reduce-scatter, all-reduce and all-gather stages: the same sum). `ho-ring` runs the same
stages on both link tiers at once, pipelined over its pieces (shardc.algorithms, PaRO
§3.3): each stage pays `pieces` latencies, and the time is the slowest stage plus the
others' share of one piece, max t_i + (Σ t_i − max t_i)/pieces. The stages and the rule
are the algorithm object's (shardc.algorithms), which the runtime executes. An
all-to-all (qgZ) is always one flat exchange.

[Note: shared links]
Mesh levels are how a strategy names groups, and a group of 4 of a node's 8 GPUs needs
two levels inside the node (`gpu(2) > lane(4)`) whose traffic goes through one NVLink
port per GPU. `--link lane=gpu` says so: `lane` has `gpu`'s link, and a flat ring's
bytes on the two levels add up on that one link (given apart, an 8-GPU ring in the
node would spread its bytes over two links and run 4/3 as fast as a 4-GPU ring). The
stages of `ho-ring` that share a link run one after the other on it, as one stage of
their summed time; the step pipeline queues collectives of either level on the one
link (pipeline.py). An inner level `--link` does not name goes through the first inner
level's links, as in the two-tier default ([Note: one in-node link] in timing.py);
every other level has a link of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import Collectives, Mesh
from shardc.dsl.quantities import parse_rate, parse_seconds
import shardc.algorithms as algorithms
from shardc.lowering import Op

from shardc.analysis.costmodel.links import FACTOR, flat_ring


def in_node_link(mesh: Mesh, level: str) -> str:
    """The level whose links carry `level`'s traffic when nothing says otherwise: its own
    for the outermost level, the first inner level's for every inner one ([Note: one
    in-node link] in timing.py)."""
    return level if level in mesh.names[:2] else mesh.names[1]


def stage_sizes(mesh: Mesh, levels) -> list[tuple[str, int]]:
    """The levels a group spans (mesh order) with their sizes, size-1 levels dropped."""
    return [(l, mesh.size(l)) for l in mesh.ordered(levels) if mesh.size(l) > 1]


def combine(stages: list[tuple[str, float]], algo: Collectives, key=()) -> float:
    """Seconds of a staged collective from its stages `[(link, seconds)]` ([Note: staged
    algorithms]; the algorithm's own rule); stages on one link run in turn, as one stage of
    their summed time ([Note: shared links])."""
    on: dict[str, float] = {}
    for link, t in stages:
        on[link] = on.get(link, 0.0) + t
    return algorithms.resolve(algo, key or ("", "")).combine(list(on.values()))


def collective_seconds(op: Op, levels, nbytes: float, mesh: Mesh, algo: Collectives, link,
                       key=None) -> float:
    """Seconds of one collective; `link(level) -> (latency s, bytes/s)`; `key(level)`: the
    link a level's traffic goes through (default its own; [Note: shared links]). Each of
    the algorithm's stages is a flat collective over its levels ([Note: flat ring over
    several levels]) that pays a latency per piece."""
    key = key or (lambda l: l)
    sizes = stage_sizes(mesh, levels)
    if not sizes:
        return 0.0
    group = tuple(l for l, _ in sizes)
    algo_ = algorithms.resolve(algo, group)
    stages = []
    for sop, slv, v in algo_.stages(Op(op).value, group, mesh.ordered, mesh.size, nbytes):
        sz = stage_sizes(mesh, slv)
        p = prod(s for _, s in sz)
        on: dict[str, list] = {}
        for l, b in flat_ring(Op(sop), sz, v).items():
            on.setdefault(key(l), [0.0, link(l)[1]])[0] += b
        wire = max(b / w for b, w in on.values())
        t = FACTOR[Op(sop)] * (p - 1) * algo_.pieces * max(link(l)[0] for l, _ in sz) + wire
        stages.append((key(sz[0][0]) if len(on) == 1 else next(iter(on)), t))
    if len(stages) == 1:
        return stages[0][1]
    return combine(stages, algo, group)


@dataclass(frozen=True, slots=True)
class LevelLinks:
    """One link per named mesh level: `((level, bytes/s, latency s), ...)`, outermost first
    as given; `shared`: `((level, owner), ...)`, levels whose traffic goes through another
    level's links ([Note: shared links]); a level not named uses `fallback` (an
    `AlphaBeta`, the two-tier default)."""
    links: tuple
    fallback: object
    shared: tuple = ()

    def __str__(self) -> str:
        named = [f"{l} {w / 1e9:g} GB/s" + ("" if a is None else f" + {a * 1e6:g} us") for l, w, a in self.links]
        named += [f"{l} on {o}'s links" for l, o in self.shared]
        return f"per-level links: {', '.join(named)} (other levels: {self.fallback})"

    def key(self, mesh: Mesh, level: str) -> str:
        """The level whose links carry `level`'s traffic: its owner's if shared, its own if
        named; an inner level not named goes through the first inner level's links, as in
        the two-tier default ([Note: one in-node link] in timing.py)."""
        shared = dict(self.shared)
        if level in shared:
            return self.key(mesh, shared[level])
        if level in (n for n, _, _ in self.links):
            return level
        owner = in_node_link(mesh, level)
        return level if owner == level else self.key(mesh, owner)

    def link(self, mesh: Mesh, level: str) -> tuple[float, float]:
        """(latency, bytes/s); a link given without latency keeps its tier's default."""
        level = self.key(mesh, level)
        for name, w, a in self.links:
            if name == level:
                return (self.fallback.link(mesh, level)[0] if a is None else a), w
        return self.fallback.link(mesh, level)

    def check(self, mesh: Mesh) -> None:
        for name in [n for n, _, _ in self.links] + [n for s in self.shared for n in s]:
            if name not in mesh.names:
                raise ShardcError(f"--link names level {name!r}, which is not on the mesh {mesh}")
        for level, owner in self.shared:
            if owner == level or owner in dict(self.shared):
                raise ShardcError(f"--link {level}={owner}: {owner!r} must be a level with links of its own")

    def seconds(self, op: Op, levels, nbytes: float, mesh: Mesh, algo: Collectives) -> float:
        return collective_seconds(op, levels, nbytes, mesh, algo, lambda l: self.link(mesh, l),
                                  lambda l: self.key(mesh, l))


def parse_links(specs, fallback) -> LevelLinks:
    """`["node=25GB/s", "gpu=200GB/s@5us", "lane=gpu"]` -> LevelLinks (latency after `@`,
    else the fallback's latency for that level's tier; a level name after `=`: that
    level's links, [Note: shared links])."""
    out, shared = [], []
    for spec in specs:
        name, eq, rest = str(spec).partition("=")
        name, rest = name.strip(), rest.strip()
        if not eq or not name or not rest:
            raise ShardcError(f"cannot read --link {spec!r}; write LEVEL=BANDWIDTH[@LATENCY], e.g. node=25GB/s@20us, "
                              "or LEVEL=OTHER_LEVEL for a level on another level's links")
        if any(n == name for n, _, _ in out) or any(n == name for n, _ in shared):
            raise ShardcError(f"--link names level {name!r} twice; give each level one link")
        if rest.isidentifier():
            shared.append((name, rest))
            continue
        rate, at, lat = rest.partition("@")
        latency = parse_seconds(lat) if at else None
        out.append((name, parse_rate(rate), latency))
    return LevelLinks(tuple(out), fallback, tuple(shared))
