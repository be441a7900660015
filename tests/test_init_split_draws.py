"""A draw split by ranks equals the whole draw (runtime/state/draws.py, [Note: a draw split
by ranks] and [Note: a lagging generator]; runtime/state/mt19937.py, [Note: a jump of the
Mersenne Twister]).

- The jump: torch's generator advanced by n outputs with the polynomial jump gives the same
  next draws as n outputs walked one by one (numpy's MT19937), for n below a block, across
  blocks, below and past 2 x 19937, and in the tens of millions; two jumps equal one of their
  sum (past 10^9 outputs, where a walk would take seconds).
- `normal_` for sizes with and without a tail (N % 16 != 0, and N < 32 where the tail overlaps
  the first block) and float32 `uniform_` for sizes with and without one, every split of N
  into 1, 2, 3 and 8 ranges at unaligned points: the draws are counted on a lagging stream
  (the generator untouched), each range's state found by `resolve` and drawn into a shard,
  and the pieces equal one whole call bit for bit; once caught up, the generator is where
  the whole call leaves it. The same with a generator of the caller's (`generator=g`). One
  process, no ranks.
- Drawn in place: a piece's calls are a valid split of one call and all but under 64 of its
  elements are drawn straight into the shard (no block-sized scratch); a bf16 shard gets
  the draw cast.
"""
from __future__ import annotations

import pytest
import torch

from shardc.runtime.state import draws, mt19937
from shardc.runtime.state.draws import Normal, Stream, Uniform, apply, resolve


def _state(k: int = 3) -> torch.Tensor:
    torch.manual_seed(5)
    torch.rand(k)                                  # somewhere in the sequence (block position k)
    return torch.random.get_rng_state()


def _next(state: torch.Tensor) -> torch.Tensor:
    torch.random.set_rng_state(state)
    return torch.rand(700)                         # past a block boundary


@pytest.mark.parametrize("n", [1, 620, 624, 1249, 2 * 19937 - 3, 2 * 19937 + 5, 3_000_017])
def test_jump_equals_walk(n):
    for k in (3, 623):                             # a state early in its block, and at its end
        s = _state(k)
        assert torch.equal(_next(mt19937.jump(s, n)), _next(mt19937.walk(s, n))), (n, k)


def test_jumps_compose():
    s = _state()
    a, b = 1_234_567_891, 987_654_321
    assert torch.equal(_next(mt19937.jump(mt19937.jump(s, a), b)), _next(mt19937.jump(s, a + b)))
    assert torch.equal(_next(mt19937.jump(s, 25_000_000)), _next(mt19937.walk(s, 25_000_000)))


def _splits(n: int):
    yield [(0, n)]
    yield [(0, n // 2), (n // 2, n)]
    yield [(0, 5), (5, n - 3), (n - 3, n)]
    cuts = sorted({0, n, *(n * i // 8 + (i % 3) for i in range(1, 8))})
    yield [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b]


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("kind,n", [("normal", 16), ("normal", 17), ("normal", 31), ("normal", 48),
                                    ("normal", 1000), ("normal", 1003), ("normal", 4096 + 7),
                                    ("uniform", 16), ("uniform", 1003), ("uniform", 4096 + 7)])
def test_pieces_equal_the_whole_draw(kind, n, own, monkeypatch):
    monkeypatch.setattr(draws, "BLOCK", 64)        # a piece drawn in several blocks, and in one
    make, args = (Normal, (0.1, 0.02)) if kind == "normal" else (Uniform, (-0.3, 0.2))
    g = torch.Generator() if own else torch.default_generator
    for ranges in _splits(n):
        g.set_state(_state())
        start = g.get_state()
        whole = getattr(torch.empty(n), kind + "_")(*args, generator=g)
        torch.rand(2, generator=g)                 # and the draw after it
        after = g.get_state()
        g.set_state(start)
        stream = Stream()
        op = make.drawn(stream, n, *args, g if own else None)
        assert torch.equal(g.get_state(), start)   # counted, not drawn
        pieces = [op.piece(0, a, b) for a, b in ranges]
        resolve(pieces, stream)                    # catches the generator up
        torch.rand(2, generator=g)
        assert torch.equal(g.get_state(), after), (n, ranges)
        got = torch.full((n,), float("nan"))
        for (a, b), p in zip(ranges, pieces):
            apply([p], got[a:b])
        assert torch.equal(got, whole), (n, ranges)
        assert torch.equal(g.get_state(), after)   # apply puts the generator back


@pytest.mark.parametrize("n", [16, 17, 31, 1003, 4096 + 7])
def test_kept_elements_drawn_in_place(n):
    """draws.py [Note: drawn in place]: a piece's calls are consecutive, start at multiples of
    16 and end with one of at least 16; what is not drawn straight into the shard is under 64
    elements, whatever the piece's size (no scratch of a block)."""
    for ranges in _splits(n):
        for a, b in ranges:
            s, e = draws.bounds(a, b, n)
            cs = draws.calls("normal", a - s, b - a, e - s)
            assert cs[0][0] == 0 and cs[-1][1] == e - s and all(x[1] == y[0] for x, y in zip(cs, cs[1:]))
            assert all(lo % 16 == 0 for lo, _, _ in cs) and cs[-1][1] - cs[-1][0] >= 16, (a, b, cs)
            assert sum(hi - lo for lo, hi, whole in cs if not whole) < 64, (a, b, cs)


def test_a_shard_of_another_dtype_gets_the_draw_cast(monkeypatch):
    """A bf16 shard (cast on copy) is drawn through BLOCK-element calls: one call's values, cast."""
    monkeypatch.setattr(draws, "BLOCK", 64)
    n = 1003
    torch.random.set_rng_state(_state())
    whole = torch.empty(n).normal_(0.1, 0.02)
    torch.random.set_rng_state(_state())
    stream = Stream()
    op = Normal.drawn(stream, n, 0.1, 0.02)
    pieces = [op.piece(0, a, b) for a, b in [(0, 300), (300, n)]]
    resolve(pieces, stream)
    got = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    for (a, b), p in zip([(0, 300), (300, n)], pieces):
        apply([p], got[a:b])
    assert torch.equal(got, whole.to(torch.bfloat16))
