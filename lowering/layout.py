"""Layout arithmetic — part of stage 3 (lowering): factors, padding, ranks and chunks.

Input: a `Mesh`, a unit's resolved `Scopes`, element counts and a rank.
Output: shard factors, padded group sizes, rank coordinates and this rank's chunk
offsets for every state (`RankPlan`). Pure arithmetic: no tensors, no communication.

[Note: nested chunks]
Chunk indices are mixed-radix numbers over `Scopes.chunk_order(state)` (params digits
first, then the digits grads add, then those optim adds). Because optim's order starts
with grads' order, which starts with params' order, the optim chunk of a rank is a
contiguous slice of its grad chunk, which is a slice of its params chunk; the offset
of the inner chunk inside the outer one is (c_inner·n/s_inner − c_outer·n/s_outer).
The position of a rank in the group of a *difference* of scopes (OS∖G, OS∖P) is the
mixed-radix number over the trailing digits of the inner order, so a collective over
that group moves exactly the nested chunks.

[Note: padding]
N = round_up(Φ, L) with L = lcm(s_P, s_G, s_OS, s_Q) for the trainable group and
lcm(s_P, s_Q) for the frozen one (internals.md "Padding"). The padding sits at the end.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import lcm

from shardc.dsl.ir import Mesh, Scopes

from .ir import Factors


def factors(scopes: Scopes, mesh: Mesh) -> Factors:
    sec = scopes.params.secondary
    return Factors(p=mesh.factor(scopes.params.levels), g=mesh.factor(scopes.grads.levels),
                   os=mesh.factor(scopes.optim.levels), q=mesh.factor(sec.levels) if sec else 1)


def pad_multiple(f: Factors, trainable: bool) -> int:
    return lcm(f.p, f.g, f.os, f.q) if trainable else lcm(f.p, f.q)


def padded(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def coords(mesh: Mesh, rank: int) -> tuple[int, ...]:
    """Mixed-radix digits of `rank` over the level sizes, outermost first (innermost fastest)."""
    digits = []
    for lvl in reversed(mesh.levels):
        rank, d = divmod(rank, lvl.size)
        digits.append(d)
    return tuple(reversed(digits))


def mixed_index(mesh: Mesh, rank: int, order: tuple[str, ...]) -> int:
    """Mixed-radix number of `rank`'s coordinates over `order`, first digit most significant."""
    c = dict(zip(mesh.names, coords(mesh, rank)))
    idx = 0
    for name in order:
        idx = idx * mesh.size(name) + c[name]
    return idx


def minus(mesh: Mesh, a, b) -> tuple[str, ...]:
    """Levels of `a` not in `b`, mesh order."""
    return mesh.ordered(set(a) - set(b))


@dataclass(frozen=True, slots=True)
class RankPlan:
    """One unit's scopes seen from one rank: levels, digit orders and chunk offsets."""
    mesh: Mesh
    scopes: Scopes
    rank: int

    @property
    def p(self) -> tuple[str, ...]:
        return self.mesh.ordered(self.scopes.params.levels)

    @property
    def g(self) -> tuple[str, ...]:
        return self.mesh.ordered(self.scopes.grads.levels)

    @property
    def os(self) -> tuple[str, ...]:
        return self.mesh.ordered(self.scopes.optim.levels)

    @property
    def q(self) -> tuple[str, ...]:
        sec = self.scopes.params.secondary
        return self.mesh.ordered(sec.levels) if sec else ()

    def order(self, state: str) -> tuple[str, ...]:
        return self.scopes.chunk_order(state)

    def s(self, levels: tuple[str, ...]) -> int:
        return self.mesh.factor(levels)

    def groups(self) -> tuple[tuple[str, ...], ...]:
        """Every level set this unit communicates over (process groups to create)."""
        m = self.mesh
        return (self.p, self.g, self.os, self.q, minus(m, m.names, self.os),
                minus(m, self.os, self.g), minus(m, self.os, self.p))

    def chunk(self, state: str, n: int) -> tuple[int, int]:
        """(start, length) of this rank's `state` chunk in a flat buffer of n elements."""
        levels = {"params": self.p, "grads": self.g, "optim": self.os}[state]
        size = n // self.s(levels)
        return mixed_index(self.mesh, self.rank, self.scopes.chunk_order(state)) * size, size

    def secondary_chunk(self, n: int) -> tuple[int, int]:
        size = n // self.s(self.q)
        return mixed_index(self.mesh, self.rank, self.q) * size, size
