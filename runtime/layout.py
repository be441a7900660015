"""Flat-group layout — stage: runtime (pure arithmetic, no tensors, no communication).

Input: a unit's parameter shapes and its resolved `Scopes` on a `Mesh`.
Output: `GroupLayout` (where each parameter lives in the padded flat buffer) and
`ScopePlan` (factors, digit orders and this rank's chunk offsets for every state).

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
from math import lcm, prod

from shardc.dsl.ir import Mesh, Scopes


@dataclass(frozen=True, slots=True)
class Slot:
    fqn: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True, slots=True)
class GroupLayout:
    trainable: bool
    slots: tuple[Slot, ...]
    phi: int          # real elements
    n: int            # padded elements

    @property
    def split_sizes(self) -> list[int]:
        sizes = [s.numel for s in self.slots]
        return sizes + [self.n - self.phi] if self.n > self.phi else sizes


def coords(rank: int, mesh: Mesh) -> dict[str, int]:
    """Coordinate of `rank` on every level; the innermost level varies fastest."""
    out = {}
    for lvl in reversed(mesh.levels):
        out[lvl.name] = rank % lvl.size
        rank //= lvl.size
    return out


def mixed_index(coord: dict[str, int], mesh: Mesh, order: tuple[str, ...]) -> int:
    """Mixed-radix number over `order`, first digit most significant."""
    idx = 0
    for name in order:
        idx = idx * mesh.size(name) + coord[name]
    return idx


@dataclass(frozen=True, slots=True)
class ScopePlan:
    """Everything a unit needs to know about its scopes on this rank."""
    mesh: Mesh
    scopes: Scopes
    rank: int

    # -- levels (mesh order) and digit orders -------------------------------------
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

    @property
    def outside_os(self) -> tuple[str, ...]:
        return tuple(n for n in self.mesh.names if n not in self.os)

    def order(self, state: str) -> tuple[str, ...]:
        return self.scopes.chunk_order(state)

    def diff_order(self, inner: str, outer: str) -> tuple[str, ...]:
        """Digits of `inner`'s order that `outer`'s order lacks (a group's position)."""
        drop = set(self.scopes.chunk_order(outer))
        return tuple(l for l in self.scopes.chunk_order(inner) if l not in drop)

    def s(self, levels: tuple[str, ...]) -> int:
        return prod(self.mesh.size(l) for l in levels)

    def index(self, order: tuple[str, ...]) -> int:
        return mixed_index(coords(self.rank, self.mesh), self.mesh, order)

    def pad_multiple(self, trainable: bool) -> int:
        facs = [self.s(self.p), self.s(self.q)]
        if trainable:
            facs += [self.s(self.g), self.s(self.os)]
        return lcm(*facs)

    # -- chunk offsets (in elements of a group of n) -------------------------------
    def chunk(self, state: str, n: int) -> tuple[int, int]:
        """(start, length) of this rank's `state` chunk in the full flat buffer."""
        levels = {"params": self.p, "grads": self.g, "optim": self.os}[state]
        size = n // self.s(levels)
        return self.index(self.order(state)) * size, size

    def secondary_chunk(self, n: int) -> tuple[int, int]:
        size = n // self.s(self.q)
        return self.index(self.q) * size, size


def build_layout(named_shapes: list[tuple[str, tuple[int, ...]]], trainable: bool,
                 multiple: int) -> GroupLayout:
    slots, off = [], 0
    for fqn, shape in named_shapes:
        numel = prod(shape)
        slots.append(Slot(fqn, tuple(shape), off, numel))
        off += numel
    n = -(-off // multiple) * multiple if off else 0
    return GroupLayout(trainable, tuple(slots), off, n)
