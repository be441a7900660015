"""A `normal_` split by ranks equals the whole draw (runtime/state/draws.py, [Note: a draw
split by ranks]).

For sizes with and without a tail (N % 16 != 0, and N < 32 where the tail overlaps the first
block), every split of N into 1, 2, 3 and 8 ranges at unaligned points: the generator is
moved past the draw without drawing, each range is drawn from its recorded state into a
shard, and the pieces equal the whole `normal_` bit for bit; the generator ends where the
whole call leaves it. One process, no ranks.
"""
from __future__ import annotations

import pytest
import torch

from shardc.runtime.state import draws
from shardc.runtime.state.draws import Normal, apply, bounds


def _splits(n: int):
    yield [(0, n)]
    yield [(0, n // 2), (n // 2, n)]
    yield [(0, 5), (5, n - 3), (n - 3, n)]
    cuts = sorted({0, n, *(n * i // 8 + (i % 3) for i in range(1, 8))})
    yield [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b]


@pytest.mark.parametrize("n", [16, 17, 31, 48, 1000, 1003, 4096 + 7])
def test_pieces_equal_the_whole_draw(n, monkeypatch):
    monkeypatch.setattr(draws, "BLOCK", 64)        # a piece drawn in several blocks, and in one
    for ranges in _splits(n):
        torch.manual_seed(5)
        torch.rand(3)                              # somewhere in the sequence
        start = torch.random.get_rng_state()
        whole = torch.empty(n).normal_(0.1, 0.02)
        after = torch.random.get_rng_state()
        torch.random.set_rng_state(start)
        op = Normal.drawn(n, 0.1, 0.02, [bounds(a, b, n)[0] for a, b in ranges])
        assert torch.equal(torch.random.get_rng_state(), after), (n, ranges)
        got = torch.full((n,), float("nan"))
        for a, b in ranges:
            apply([op.piece(0, a, b)], got[a:b])
        assert torch.equal(got, whole), (n, ranges)
        assert torch.equal(torch.random.get_rng_state(), after)     # apply puts the generator back
