"""Flat-group layout — stage: runtime (pure arithmetic, no tensors, no communication).

Input: a group's parameter names and shapes, and its padded size N from the lowered
plan (`shardc.lowering`, which owns padding, factors and chunk offsets).
Output: `GroupLayout` — where each parameter lives in the flat buffer (the padding, N − Φ
elements, sits at the end), and which part of each parameter a chunk of it holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod


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

    def ranges(self, start: int, length: int) -> list[tuple[Slot, int, int]]:
        """(slot, lo, hi) for every slot: the part of the parameter inside the chunk
        [start, start+length) of the flat buffer, lo/hi relative to the chunk (lo == hi when
        they do not meet). The one place a per-parameter range inside a rank's chunk is
        computed (the optimizer's pieces, the checkpoint's)."""
        out = []
        for s in self.slots:
            lo, hi = max(start, s.offset), min(start + length, s.offset + s.numel)
            out.append((s, lo - start, hi - start) if lo < hi else (s, 0, 0))
        return out

    def slot(self, fqn: str) -> Slot | None:
        return next((s for s in self.slots if s.fqn == fqn), None)


def build_layout(named_shapes: list[tuple[str, tuple[int, ...]]], trainable: bool, n: int) -> GroupLayout:
    """Parameters packed in order from offset 0 of a flat buffer of `n` (the plan's padded size)."""
    slots, off = [], 0
    for fqn, shape in named_shapes:
        numel = prod(shape)
        slots.append(Slot(fqn, tuple(shape), off, numel))
        off += numel
    assert off <= n, (off, n)
    return GroupLayout(trainable, tuple(slots), off, n)
