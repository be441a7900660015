"""A whole-parameter draw, drawn by each rank for its own chunk — stage: runtime (state).
The first rank's init (init_first.py) does not draw a parameter an init function fills with
`normal_` or `uniform_`: it counts the draw's outputs on a lagging generator (`Stream`) and
records where the draw starts; each rank then draws its part itself.

Input: the stream position where the draw starts (a run of the generator and an offset in
it), the parameter's size N and the distribution's arguments, and the element ranges of N
the ranks keep. Output: `Normal` / `Uniform` (the draw, recorded) and `piece`, one rank's
instruction for its range; `segments` and `walk_to` turn stream positions into generator
states, the walk split over the ranks; `apply` runs the instructions into that rank's shard.

[Note: a draw split by ranks]
torch's CPU `normal_` of a contiguous float32 tensor of N >= 16 elements (ATen's
`normal_fill`) takes one 32-bit Mersenne Twister output per element as a uniform, in order,
then turns each block of 16 (from element 0) into normals; when N % 16 != 0 it draws 16 more
outputs for the last 16 elements and transforms them as one block. So `normal_` of the
elements [s, e) with the generator advanced by s outputs gives exactly those elements of
the whole call when s is a multiple of 16 and either e is too and e <= N - 16 (e <= N when
N % 16 == 0), or e = N and N - s >= 16 (the tail handled as the whole call handles it);
the whole call consumes N outputs, plus 16 when N % 16 != 0. A rank keeping [a, b) draws
the smallest such [s, e) around it and keeps its part, as consecutive calls that the same
argument makes equal to one call (each a multiple of 16 elements, the last one at least 16).
`uniform_` of float32 (nn.Linear's `kaiming_uniform_`) takes one output per element,
serially, so any [a, b) drawn from the state a outputs in equals those elements of the
whole call; it consumes N. tests/test_init_split_draws.py checks both against one
process's draws.

[Note: drawn in place]
The kept elements [a, b) are drawn straight into the rank's float32 shard, by one call from
the first multiple of 16 in them to the last one that leaves the tail its 16 (`calls`); only
the elements around them (under 32 before, under 32 after) are drawn into a tensor of their
own and copied. So no rank holds a scratch for its draws: a scratch of its chunk of the largest
parameter was 62.5 MiB of a 32000 x 2048 embedding at 4 ranks, measured as start-up peak
above FSDP2's; a reused 4 MiB one (BLOCK elements) still left, with the polynomial jump's
transforms, 8-28 MiB of freed heap the C allocator kept on each rank of the 836M Llama at 8
ranks (measured by VmHWM; mt19937.py now transforms 4 bit planes at a time). A shard of
another dtype (cast on copy) is still drawn through BLOCK-element calls.

[Note: a lagging generator]
The first rank does not move torch's generator past a deferred draw: `Stream` counts the
outputs the deferred draws took since the state it last saw (a run's base), and a draw's
start is (run, offset). The generator is caught up (mt19937.py's `advance`: a walk, or a
jump past 2^24 outputs) only where something draws from it directly: an op of the init
function that draws from it (`catch_up`, from untouched.py) and the end of the init. A
generator the init function passes (`normal_(..., generator=g)`, a CPU one) lags the same
way, with runs of its own (its draws' states are its states: torch's CPU generators are one
kind). A state found changed at a `take` or a catch-up was set from outside (`manual_seed` in
the init function): its lag is dropped and a new run starts there, as one process's
generator would. Not seen: an init function reading the state through Python
(`torch.get_rng_state`, `fork_rng`) while draws are deferred sees the state before them.
Then (init_first.py) the first rank, which made every rank's pieces, cuts the stream into
one segment per rank (`segments`) and sends each rank the positions in its segment; each
rank jumps to its segment's first position and walks on to its last (`walk_to`; numpy's
MT19937, 3.1 ns an output here), keeping the state at each, and one gather gives every rank
the states its own draws start from: no rank walks another's part, and the walk divides by
the world size.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .mt19937 import advance

def bounds(a: int, b: int, n: int) -> tuple[int, int]:
    """The draw [s, e) around the kept elements [a, b) of an N-element `normal_` (see Note)."""
    s, e = a // 16 * 16, -(-b // 16) * 16
    if n % 16 == 0 or e <= n - 16:
        return s, min(e, n)
    return min(s, (n - 16) // 16 * 16), n


BLOCK = 1 << 20                         # elements a rank draws at a time (4 MiB of fp32; a multiple of 16)


def blocks(size: int) -> list[tuple[int, int]]:
    """[0, size) as consecutive draws of BLOCK elements, the last taking the rest (at least
    16, so a tail is handled as one call of `size` handles it: see Note)."""
    out, lo = [], 0
    while size - lo >= BLOCK + 16:
        out.append((lo, lo + BLOCK))
        lo += BLOCK
    return out + [(lo, size)]


def deferrable(t: torch.Tensor) -> bool:
    """`normal_` of t can be split (see Note): CPU float32, contiguous, at least 16 elements."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() and t.numel() >= 16


class Stream:
    """torch's CPU generators (the default one, and any an init function passes) with deferred
    draws counted, not drawn ([Note: a lagging generator]); every generator's runs in one list."""

    def __init__(self):
        self.bases: list[torch.Tensor] = []         # each run's first state
        self.lengths: list[int] = []                # outputs deferred in each run
        self.gens: dict[int, list] = {}             # id(generator) -> [generator, its run, its lag]

    def _current(self, g: torch.Generator) -> list:
        """g's entry; a new run where g is not where this stream left it."""
        entry, cur = self.gens.get(id(g)), g.get_state()
        if entry is None or not torch.equal(cur, self.bases[entry[1]]):
            self.bases.append(cur)
            self.lengths.append(0)
            entry = self.gens[id(g)] = [g, len(self.bases) - 1, 0]
        return entry

    def take(self, n: int, g: torch.Generator | None = None) -> tuple[int, int]:
        """A deferred draw of n outputs from g (None: the default generator): where it starts."""
        entry = self._current(torch.default_generator if g is None else g)
        at = (entry[1], entry[2])
        entry[2] += n
        self.lengths[entry[1]] = entry[2]
        return at

    def catch_up(self, g: torch.Generator | None = None) -> None:
        """g where its deferred draws leave it (a new run starts there)."""
        g = torch.default_generator if g is None else g
        entry = self.gens.get(id(g))
        if entry is None or not entry[2] or not torch.equal(g.get_state(), self.bases[entry[1]]):
            return                          # nothing deferred, or set from outside since
        g.set_state(advance(self.bases[entry[1]], entry[2]))
        self._current(g)

    def catch_up_all(self) -> None:
        for g, _, _ in list(self.gens.values()):
            self.catch_up(g)

    def state_at(self, at: tuple[int, int]) -> torch.Tensor:
        return advance(self.bases[at[0]], at[1])

    def replay(self, at: tuple[int, int], draw) -> None:
        """`draw()` on the default generator set to position `at`, its state put back after."""
        cur = torch.random.get_rng_state()
        torch.random.set_rng_state(self.state_at(at))
        draw()
        torch.random.set_rng_state(cur)


@dataclass
class Normal:
    """A deferred `normal_(mean, std)` of an n-element parameter, starting at stream position `at`."""
    n: int
    mean: float
    std: float
    at: tuple
    stream: Stream

    @classmethod
    def drawn(cls, stream: Stream, n: int, mean: float, std: float, g=None) -> "Normal":
        return cls(n, mean, std, stream.take(n + (16 if n % 16 else 0), g), stream)

    def replay(self, view: torch.Tensor) -> None:
        """The whole draw into `view` (an op reads the parameter: it needs its values)."""
        self.stream.replay(self.at, lambda: view.normal_(self.mean, self.std))

    def piece(self, at: int, a: int, b: int) -> tuple:
        """The instruction for elements [a, b) of the parameter, kept at `at` of a shard."""
        s, e = bounds(a, b, self.n)
        return ("normal", at, a - s, b - a, e - s, (self.at[0], self.at[1] + s), self.mean, self.std)


@dataclass
class Uniform:
    """A deferred float32 `uniform_(lo, hi)` of an n-element parameter (one output an element)."""
    n: int
    lo: float
    hi: float
    at: tuple
    stream: Stream

    @classmethod
    def drawn(cls, stream: Stream, n: int, lo: float, hi: float, g=None) -> "Uniform":
        return cls(n, lo, hi, stream.take(n, g), stream)

    def replay(self, view: torch.Tensor) -> None:
        self.stream.replay(self.at, lambda: view.uniform_(self.lo, self.hi))

    def piece(self, at: int, a: int, b: int) -> tuple:
        return ("uniform", at, 0, b - a, b - a, (self.at[0], self.at[1] + a), self.lo, self.hi)


def segments(positions, lengths, world: int) -> list[list]:
    """The stream (runs of `lengths` outputs, one after another) cut into `world` equal
    segments: the positions in each, in stream order (the walk each rank makes)."""
    first = np.cumsum([0] + list(lengths))
    total = int(first[-1])
    out = [[] for _ in range(world)]
    for run, off in sorted(positions, key=lambda at: (int(first[at[0]]) + at[1], at[0])):
        g = int(first[run]) + off
        out[min(g * world // total, world - 1) if total else 0].append((run, off))
    return out


def walk(positions, bases):
    """The generator state at each position, in stream order, one at a time (a generator of
    states: only the last is held): a jump to the first, then the walk from each to the next
    (see [Note: a lagging generator])."""
    state, where = None, None
    for run, off in positions:
        if where is not None and where[0] == run and where[1] <= off:
            state = advance(state, off - where[1])
        else:
            state = advance(bases[run], off)
        where = (run, off)
        yield state


def walk_to(positions, bases) -> dict:
    """Every position's state (`walk`, kept): {position: state}."""
    return dict(zip(positions, walk(positions, bases)))


def resolve(pieces: list, stream: Stream) -> None:
    """One process: the pieces' positions as states, in place; the generators caught up."""
    stream.catch_up_all()
    positions = sorted({p[5] for p in pieces})
    states = walk_to(segments(positions, stream.lengths, 1)[0], stream.bases)
    for i, p in enumerate(pieces):
        pieces[i] = p[:5] + (states[p[5]],) + p[6:]


def calls(kind: str, skip: int, length: int, size: int) -> list[tuple[int, int, bool]]:
    """A piece's draw [0, size) as consecutive calls equal to one (see Note), each (lo, hi,
    kept whole): the kept elements [skip, skip + length) in one call drawn straight into the
    shard, the few outside them (under 32 before, under 32 after) in calls of their own.
    `uniform_` is one call (it keeps every element it draws)."""
    if kind == "uniform":
        return [(0, size, True)]
    end, last = skip + length, size if size % 16 == 0 else (size - 16) // 16 * 16   # the last cut
    cuts = sorted({0, size} | {c for c in (-(-skip // 16) * 16, min(end // 16 * 16, last)) if 0 < c <= last})
    return [(lo, hi, skip <= lo and hi <= end) for lo, hi in zip(cuts, cuts[1:])]


def apply(pieces, shard: torch.Tensor) -> None:
    """One rank's instructions into its shard: ("normal", at, skip, len, size, state, mean,
    std), ("uniform", at, 0, len, len, state, lo, hi), ("fill", at, len, value), ("copy", at,
    values); a draw's state as `resolve` left it. [Note: drawn in place]"""
    if not pieces:
        return
    cur = torch.random.get_rng_state()
    for p in pieces:
        if p[0] in ("normal", "uniform"):
            kind, at, skip, length, size, state, u, v = p
            torch.random.set_rng_state(state)
            place = shard.dtype == torch.float32
            for lo, hi, whole in calls(kind, skip, length, size) if place else \
                    [(lo, hi, False) for lo, hi in blocks(size)]:
                part = shard[at + lo - skip:at + hi - skip] if whole else torch.empty(hi - lo)
                drawn = part.normal_(u, v) if kind == "normal" else part.uniform_(u, v)
                x, y = max(lo, skip), min(hi, skip + length)
                if not whole and x < y:
                    shard[at + x - skip:at + y - skip].copy_(drawn[x - lo:y - lo])
        elif p[0] == "fill":
            shard[p[1]:p[1] + p[2]].fill_(p[3])
        else:
            shard[p[1]:p[1] + p[2].numel()].copy_(p[2])
    torch.random.set_rng_state(cur)
