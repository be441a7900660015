"""Torch's CPU generator moved ahead by any count — stage: runtime (state).

Input: torch's CPU generator state (`torch.random.get_rng_state()`: a Mersenne Twister,
MT19937) and a count n of 32-bit outputs. Output: the state after n outputs (`advance`), as
if n outputs had been drawn, at a cost that does not grow with n past `WALK_MAX`.

[Note: a jump of the Mersenne Twister]
MT19937 is linear over GF(2): its words x_k obey x_{k+624} = x_{k+397} ^ twist(x_k, x_{k+1})
and the window W_k = (x_k .. x_{k+623}) steps by a linear map T. T's characteristic
polynomial phi has degree 19937 (its 135 exponents are `PHI`, found by Berlekamp-Massey on
the output bits and checked by the tests: a jump equals the walk). By Cayley-Hamilton
phi(T) = 0 on the windows T reaches, so for g = x^m mod phi, T^m W = g(T) W = XOR of the
windows W_i for the i where g has a 1 (Haramoto et al., "Efficient jump ahead for
F2-linear random number generators", 2008). W_0, the window torch's state holds, need not
be reached by T (the lower 31 bits of x_0 never reach the future), so the jump starts from
W_1: the state n outputs ahead of a state at block position p is W_{p+n} = g(T) W_1 with
g = x^(p+n-2) mod phi, W_{p+n-1} at position 1 (torch refuses position 0).
- g by left-to-right binary exponentiation: a square over GF(2) spreads the bits (x^i ->
  x^2i); its remainder mod phi is Barrett's (q = floor(floor(a / x^D) * mu / x^D), mu =
  floor(x^2D / phi), exact for polynomials of degree < 2D); products as float64 FFT
  convolutions of 0/1 vectors (sums <= D, exact after rounding), parity taken after.
- g(T) W_1: the 20,560 words x_1 .. x_{D+623} (the recurrence, 227 words at a time), and
  for each of the 32 bit planes the correlation of g with that plane (one FFT each), parity
  again: the 624 words of W_{p+n}, which become torch's state at position 0.
Cost here: about 20 squarings of 4 FFTs of 40,960 points and 64 FFTs of 20,736, some tens
of ms, against 3.1 ns per output to walk (numpy's MT19937 `random_raw`, the same
generator and tempering as torch's): a walk is shorter below `WALK_MAX` outputs.
"""
from __future__ import annotations

import functools
import struct

import numpy as np
import torch

MT_N = 624
D = 19937                                   # the degree of phi: 624 * 32 - 31
_LEFT, _NEXT, _KEY = 8, 16, 24              # torch's CPU generator state: int32 left, uint64 next, uint64 key[624]
PHI = (0, 1189, 1416, 1585, 1643, 1870, 2493, 2773, 3000, 3227, 3454, 3681, 3908, 4135, 4362, 4753, 5661,
       6337, 6569, 7129, 7477, 7525, 7583, 7752, 7979, 8206, 9505, 9901, 9969, 10128, 10693, 10761, 10920,
       11089, 11147, 11157, 11215, 11321, 11374, 11384, 11485, 11611, 11712, 11717, 11838, 11881, 11944,
       11997, 12277, 12335, 12393, 12504, 12509, 12620, 12673, 12731, 12736, 12789, 12905, 12958, 12963,
       13137, 13185, 13190, 13243, 13301, 13412, 13528, 13533, 13639, 13697, 13760, 13813, 13866, 14093,
       14151, 14209, 14320, 14325, 14436, 14547, 14552, 14605, 14721, 14774, 14779, 14953, 15001, 15006,
       15059, 15117, 15228, 15344, 15349, 15455, 15513, 15576, 15629, 15682, 15909, 15967, 16025, 16136,
       16141, 16252, 16363, 16368, 16421, 16537, 16590, 16595, 16817, 16822, 16875, 16933, 17044, 17160,
       17271, 17329, 17445, 17498, 17725, 17783, 17841, 17952, 18068, 18179, 18237, 18406, 18633, 18691,
       18860, 19087, 19314, 19937)
WALK_MAX = 1 << 24          # outputs below which walking is cheaper than a jump (measured here: see Note)
_SQ_FFT = 40960             # >= 2D - 1: a product of two remainders
_CORR_FFT = 20736           # >= D + 623: the correlation's words, no wrap-around
PLANES = 4                  # bit planes transformed at a time in a jump (`_apply`)
_UPPER, _LOWER, _A = np.uint32(0x80000000), np.uint32(0x7FFFFFFF), np.uint32(0x9908B0DF)


def to_numpy(state: torch.Tensor) -> dict:
    """torch's CPU generator state as numpy's MT19937 state (the same key and position)."""
    b = state.numpy().tobytes()
    left = struct.unpack_from("<i", b, _LEFT)[0]
    key = np.frombuffer(b, dtype="<u8", count=MT_N, offset=_KEY).astype(np.uint32)
    return {"bit_generator": "MT19937", "state": {"key": key, "pos": MT_N + 1 - left}}


def to_torch(ns: dict, template: torch.Tensor) -> torch.Tensor:
    """numpy's MT19937 state as torch's, the rest of `template` (its seed, the normal cache) kept."""
    b = bytearray(template.numpy().tobytes())
    pos = int(ns["state"]["pos"])
    struct.pack_into("<i", b, _LEFT, MT_N + 1 - pos)
    struct.pack_into("<Q", b, _NEXT, pos if pos < MT_N else 0)
    b[_KEY:_KEY + MT_N * 8] = np.asarray(ns["state"]["key"], dtype=np.uint32).astype("<u8").tobytes()
    return torch.frombuffer(b, dtype=torch.uint8).clone()


def walk(state: torch.Tensor, n: int) -> torch.Tensor:
    """`state` after n outputs, drawn one by one (numpy's MT19937, nothing kept)."""
    g = np.random.MT19937()
    g.state = to_numpy(state)
    g.random_raw(n, output=False)
    return to_torch(g.state, state)


def advance(state: torch.Tensor, n: int) -> torch.Tensor:
    """`state` after n outputs: walked below WALK_MAX, else jumped (see Note)."""
    if n < WALK_MAX:
        return walk(state, n)
    return jump(state, n)


def jump(state: torch.Tensor, n: int) -> torch.Tensor:
    """`state` after n outputs, by the polynomial jump (see Note)."""
    if n == 0:
        return state.clone()
    ns = to_numpy(state)
    key, pos = ns["state"]["key"], int(ns["state"]["pos"])
    t = pos + n                             # the next output is x_t: the state is W_{t-1} at position 1
    if t < 2 * D:                           # (torch refuses position 0: `left` is at most 624)
        w = extend(key, t + MT_N - 1)[t - 1:]
    else:
        w = _apply(_power(t - 2), extend(key, D + MT_N)[1:])
    return to_torch({"bit_generator": "MT19937", "state": {"key": w, "pos": 1}}, state)


def extend(head: np.ndarray, total: int) -> np.ndarray:
    """The words x_0 .. x_{total-1} of the sequence whose first 624 are `head`."""
    out = np.empty(max(total, MT_N), dtype=np.uint32)
    out[:MT_N] = head
    m = MT_N
    while m < total:                        # x_k for k in [m, m + 227) reads x_{k-227} < m
        hi = min(m + 227, total)
        y = (out[m - 624:hi - 624] & _UPPER) | (out[m - 623:hi - 623] & _LOWER)
        out[m:hi] = out[m - 227:hi - 227] ^ (y >> 1) ^ ((y & 1) * _A)
        m = hi
    return out[:total]


@functools.lru_cache(maxsize=1)
def _spectra():
    """phi's low coefficients, and the spectra of phi and mu = floor(x^2D / phi) (once per process)."""
    phi = np.zeros(D + 1, dtype=np.uint8)
    phi[list(PHI)] = 1
    rem = np.zeros(2 * D + 1, dtype=np.uint8)       # x^2D, divided by phi term by term (phi is sparse)
    rem[2 * D] = 1
    mu = np.zeros(D + 1, dtype=np.uint8)
    low = np.array(PHI[:-1])
    for k in range(2 * D, D - 1, -1):
        if rem[k]:
            mu[k - D] = 1
            rem[k] = 0
            rem[low + (k - D)] ^= 1
    return phi[:D].copy(), np.fft.rfft(phi, _SQ_FFT), np.fft.rfft(mu, _SQ_FFT)


def _mul_parity(a: np.ndarray, spectrum: np.ndarray) -> np.ndarray:
    prod = np.fft.irfft(np.fft.rfft(a, _SQ_FFT) * spectrum, _SQ_FFT)
    return (np.rint(prod).astype(np.int64) & 1).astype(np.uint8)


def _square(g: np.ndarray) -> np.ndarray:
    """g^2 mod phi, g of degree < D."""
    low, phi_s, mu_s = _spectra()
    a = np.zeros(2 * D - 1, dtype=np.uint8)
    a[::2] = g
    q = _mul_parity(a[D:], mu_s)[D:2 * D - 1]       # Barrett: floor(floor(a / x^D) * mu / x^D)
    return a[:D] ^ _mul_parity(q, phi_s)[:D]


def _times_x(g: np.ndarray) -> np.ndarray:
    low = _spectra()[0]
    top = g[D - 1]
    out = np.empty_like(g)
    out[0], out[1:] = 0, g[:-1]
    return out ^ low if top else out


def _power(m: int) -> np.ndarray:
    """x^m mod phi, by left-to-right binary exponentiation from its leading bits below D."""
    bits = bin(m)[2:]
    e, i = 0, 0
    while i < len(bits) and 2 * e + int(bits[i]) < D:
        e, i = 2 * e + int(bits[i]), i + 1
    g = np.zeros(D, dtype=np.uint8)
    g[e] = 1
    for b in bits[i:]:
        g = _square(g)
        if b == "1":
            g = _times_x(g)
    return g


def _apply(g: np.ndarray, words: np.ndarray) -> np.ndarray:
    """XOR of the windows words[i : i + 624] where g_i = 1 (words: D + 623 of them), by
    `PLANES` bit planes at a time (all 32 at once held 16 MB of transforms, which the C
    allocator then kept in its heap: 6 MiB more start-up peak on every rank of the 836M Llama)."""
    spectrum = np.conj(np.fft.rfft(g.astype(np.float64), _CORR_FFT))
    out = np.zeros(MT_N, dtype=np.uint32)
    for lo in range(0, 32, PLANES):
        shifts = np.arange(lo, lo + PLANES, dtype=np.uint32)[:, None]
        planes = ((words[None, :] >> shifts) & 1).astype(np.float64)
        corr = np.fft.irfft(np.fft.rfft(planes, _CORR_FFT, axis=1) * spectrum, _CORR_FFT, axis=1)[:, :MT_N]
        bits = (np.rint(corr).astype(np.int64) & 1).astype(np.uint32)
        out |= np.bitwise_or.reduce(bits << shifts, axis=0)
    return out
