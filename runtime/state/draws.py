"""A whole-parameter draw, drawn by each rank for its own chunk — stage: runtime (state).
The first rank's init (init_first.py) does not draw a parameter an init function fills with
`normal_`: it moves the CPU generator past the draw and records where each rank's part of
it starts; each rank then draws its part itself.

Input: the generator's state before the draw, the parameter's size N, mean and std, and the
element ranges of N the ranks keep. Output: `Normal` (the generator advanced as the whole
`normal_` would have advanced it; the state at each range's start) and `piece`, one rank's
instruction for its range, which `apply` runs into that rank's shard.

[Note: a draw split by ranks]
torch's CPU `normal_` of a contiguous float32 tensor of N >= 16 elements (ATen's
`normal_fill`) takes one 32-bit Mersenne Twister output per element as a uniform, in order,
then turns each block of 16 (from element 0) into normals; when N % 16 != 0 it draws 16 more
outputs for the last 16 elements and transforms them as one block. So `normal_` of the
elements [s, e) with the generator advanced by s outputs gives exactly those elements of
the whole call when s is a multiple of 16 and either e is too and e <= N - 16 (e <= N when
N % 16 == 0), or e = N and N - s >= 16 (the tail handled as the whole call handles it);
the whole call consumes N outputs, plus 16 when N % 16 != 0. A rank keeping [a, b) draws
the smallest such [s, e) around it and keeps its part, drawing it as consecutive calls of
BLOCK elements (the last taking the rest), which the same argument makes equal to one call:
a rank's scratch is 4 MiB, not its chunk of the largest parameter (62.5 MiB of a 32000 x
2048 embedding at 4 ranks, measured as start-up peak above FSDP2's). Advancing the generator without
drawing uses numpy's MT19937 (`random_raw`, the same generator and tempering) on torch's
state: 3.1 ns per element against `normal_`'s 6.6 here (loaded machine, one thread), and
nothing is sent but the 5 KB states. tests/test_init_split_draws.py checks equality with
one process's init.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

MT_N = 624
_LEFT, _NEXT, _KEY = 8, 16, 24          # torch's CPU generator state: int32 left, uint64 next, uint64 key[624]


def _to_numpy(state: torch.Tensor) -> dict:
    b = state.numpy().tobytes()
    left = struct.unpack_from("<i", b, _LEFT)[0]
    key = np.frombuffer(b, dtype="<u8", count=MT_N, offset=_KEY).astype(np.uint32)
    return {"bit_generator": "MT19937", "state": {"key": key, "pos": MT_N + 1 - left}}


def _to_torch(ns: dict, template: torch.Tensor) -> torch.Tensor:
    b = bytearray(template.numpy().tobytes())
    pos = int(ns["state"]["pos"])
    struct.pack_into("<i", b, _LEFT, MT_N + 1 - pos)
    struct.pack_into("<Q", b, _NEXT, pos if pos < MT_N else 0)
    b[_KEY:_KEY + MT_N * 8] = np.asarray(ns["state"]["key"], dtype=np.uint32).astype("<u8").tobytes()
    return torch.frombuffer(b, dtype=torch.uint8).clone()


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


@dataclass
class Normal:
    """A deferred `normal_(mean, std)` of an n-element parameter: the state where each
    draw starts (`states`, by start element)."""
    n: int
    mean: float
    std: float
    start: torch.Tensor
    states: dict

    @classmethod
    def drawn(cls, n: int, mean: float, std: float, starts) -> "Normal":
        """Record the draw and move torch's CPU generator past it, keeping the state at each of
        `starts` (multiples of 16, below n)."""
        cur = torch.random.get_rng_state()
        g = np.random.MT19937()
        g.state = _to_numpy(cur)
        states, done = {}, 0
        for s in sorted(set(starts)):
            g.random_raw(s - done, output=False)
            done = s
            states[s] = _to_torch(g.state, cur)
        g.random_raw(n + (16 if n % 16 else 0) - done, output=False)
        torch.random.set_rng_state(_to_torch(g.state, cur))
        return cls(n, mean, std, cur, states)

    def replay(self, view: torch.Tensor) -> None:
        """The whole draw into `view` (an op reads the parameter: it needs its values)."""
        cur = torch.random.get_rng_state()
        torch.random.set_rng_state(self.start)
        view.normal_(self.mean, self.std)
        torch.random.set_rng_state(cur)

    def piece(self, at: int, a: int, b: int) -> tuple:
        """The instruction for elements [a, b) of the parameter, kept at `at` of a shard."""
        s, e = bounds(a, b, self.n)
        return ("normal", at, a - s, b - a, e - s, self.states[s], self.mean, self.std)


def apply(pieces, shard: torch.Tensor) -> None:
    """One rank's instructions into its shard: ("normal", at, skip, len, size, state, mean,
    std), ("fill", at, len, value), ("copy", at, values)."""
    if not pieces:
        return
    cur = torch.random.get_rng_state()
    scratch = None                          # one block's room, reused (no heap left behind per block)
    for p in pieces:
        if p[0] == "normal":
            _, at, skip, length, size, state, mean, std = p
            torch.random.set_rng_state(state)
            for lo, hi in blocks(size):           # consecutive draws: the same values as one
                if scratch is None or scratch.numel() < hi - lo:
                    scratch = torch.empty(hi - lo, dtype=torch.float32)
                drawn = scratch[:hi - lo].normal_(mean, std)
                x, y = max(lo, skip), min(hi, skip + length)
                if x < y:
                    shard[at + x - skip:at + y - skip].copy_(drawn[x - lo:y - lo])
        elif p[0] == "fill":
            shard[p[1]:p[1] + p[2]].fill_(p[3])
        else:
            shard[p[1]:p[1] + p[2].numel()].copy_(p[2])
    torch.random.set_rng_state(cur)
