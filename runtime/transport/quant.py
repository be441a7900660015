"""Blockwise absmax quantization for communication (ZeRO++ qwZ/qgZ, ZeRO-topo).

Input: a 1-D float tensor (one rank's shard, or one chunk of a reduce-scatter input).
Output: one uint8 payload buffer, and back. The payload sizes come from
`shardc.lowering` (docs/internals.md, "Ledger").

[Note: payload layout]
A shard of m elements quantized to b bits (b = 8 or 4) is one uint8 buffer of
`ceil(m*b/8) + ceil(m/256)*4` bytes: first the codes, then one fp32 scale per block of
256 elements (the last block may be short). Codes are symmetric: q = round(x/scale)
clamped to [-qmax, qmax] with qmax = 2^(b-1)-1 and scale = absmax(block)/qmax, so the
error of an element is at most scale/2 = absmax(block)/(2*qmax). int8 codes are stored
as two's-complement bytes; int4 codes are stored offset by 8 (1..15), two per byte,
the even element in the low nibble. A block of zeros has scale 0 and decodes to zeros.

[Note: rows at once]
A collective over s ranks quantizes s chunks (qgZ's reduce-scatter) or decodes s payloads
(a quantized all-gather, hpZ's secondary gather). They are coded as rows of an (s, ·)
tensor, in batches of at most `ROWS_AT_ONCE` elements (`row_batches`), never one Python
call per rank: at 1024 ranks such a loop was most of a simulated step (docs/simulate.md).
The number of calls follows the unit's size, not the group's, and the codec's fp32 working
copies stay bounded (coding every row at once would hold several fp32 copies of a whole
unit). A row is coded exactly as the 1-D functions code it (they are the one-row case).

[Note: the codec batch's size]
ROWS_AT_ONCE is the lowering's CODEC_ROWS (shardc.lowering.peak_facts), 2^20 elements: a
batch's fp32 working copies are 4 MiB each. At 2^24 (64 MiB copies) every call allocated
and freed working copies past glibc's mmap threshold, so each came back as fresh
zero-filled pages: hpZ's micro-batches (bench model, 2 nodes x 2, loopback gloo) took a
median 0.511 CPU s a rank and 45k page faults, against 0.384 s and 3.9k with one call per
rank (e24a095) and 0.429 s and 6.1k at 2^20; the collectives and bytes are the same
(docs/BENCHMARKS.md, "hpZ (zeropp) against e24a095").

[Note: the codec's working copies]
A batch is coded with as few fp32 passes and copies as the layout allows, and the result is
bit for bit what the plain formula gives. encode: rows that are whole fp32 blocks are read
in place (no zero-padded copy); the quotient is rounded and clamped in place. decode: an
fp32 output (the gathered buffer, qgZ's rows buffer) is written in place, codes cast into
it, then scaled block by block; any other output dtype gets the fp32 values and one cast
(a bf16 buffer is not scaled in bf16). qgZ's sum (transport/a2a.py) adds a one-row batch
as it is (a (1, m) `sum(0)` is a copy). Before, each batch held three fp32 copies and the
gather's decode a fourth: hpZ's micro-batches took 0.429 CPU s a rank against e24a095's
0.384 (bench model, 2 nodes x 2, loopback gloo); per-rank cProfiles placed the difference
in these copies (docs/BENCHMARKS.md, "hpZ (zeropp) against e24a095"). explain counts what
is left (analysis/costmodel/staging.py [Note: staging: codec temporaries]).

[Note: codec batches on meta]
On the meta device (a simulated rank, runtime/simulation.py) there are no values to code,
so a quantized collective codes only its first batch: the largest one, whose temporaries
are the collective's codec peak (each batch's are freed before the next's), so the
simulated peak is the real run's while the calls stay one per collective, not one per
batch (a 1024-rank simulated hpZ rank of LLaMA-65B's width: 1024 one-row batches per
collective at 2^20 elements, 24 CPU s a step against 1.5 s).
"""
from __future__ import annotations

from math import ceil

import torch

from shardc.dsl.ir import DType
from shardc.lowering import BLOCK, code_bytes, payload_bytes, shard_payload_bytes  # noqa: F401 (re-exported)
from shardc.lowering.peak_facts import CODEC_ROWS

# The payload layout's sizes (BLOCK, `shard_payload_bytes`) and the ledger's byte formula
# (`payload_bytes`) are owned by the lowering; the codecs below follow them.


ROWS_AT_ONCE = CODEC_ROWS       # elements coded per call ([Note: rows at once]); the lowering's bound


def row_batches(rows: int, m: int, device: torch.device | str | None = None) -> list[tuple[int, int]]:
    """[lo, hi) ranges of `rows` rows of m elements, each at most ROWS_AT_ONCE elements (and
    at least one row); on the meta device only the first ([Note: codec batches on meta])."""
    k = max(1, ROWS_AT_ONCE // max(m, 1))
    batches = [(lo, min(lo + k, rows)) for lo in range(0, rows, k)]
    if device is not None and torch.device(device).type == "meta":
        return batches[:1]
    return batches


def _qmax(dtype: DType) -> int:
    return (1 << (dtype.bits - 1)) - 1


def encode(x: torch.Tensor, dtype: DType) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of the 1-D float tensor `x`: the payload's two parts, apart
    ([Note: payload layout]; int8 codes as int8, int4 as packed uint8 bytes; the whole-step
    mode gathers them as two buffers, runtime/graph/funcol.py)."""
    codes, scale = encode_rows(x.reshape(1, -1), dtype)
    return codes[0], scale[0]


def encode_rows(x: torch.Tensor, dtype: DType) -> tuple[torch.Tensor, torch.Tensor]:
    """`encode` of each row of the 2-D float tensor `x` (s rows of m elements) at once:
    codes (s, code_bytes) and scales (s, blocks). See [Note: rows at once] and
    [Note: the codec's working copies]."""
    if not dtype.quantized:
        raise ValueError(f"{dtype!r} is not a quantized dtype")
    rows, m = x.shape
    nblocks = ceil(m / BLOCK)
    if m == nblocks * BLOCK and x.dtype == torch.float32 and x.is_contiguous():
        xf = x                          # whole blocks already: read in place
    else:
        xf = torch.empty(rows, nblocks * BLOCK, dtype=torch.float32, device=x.device)
        xf[:, :m] = x
        xf[:, m:] = 0
    blocks = xf.view(rows, nblocks, BLOCK)
    qmax = _qmax(dtype)
    scale = blocks.abs().amax(dim=2) / qmax     # (torch.linalg.vector_norm(ord=inf): 12x the CPU)
    q = blocks / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, :, None]
    del xf, blocks
    q = q.round_().clamp_(-qmax, qmax).view(rows, -1)[:, :m].to(torch.int8)
    if dtype is DType.INT8:
        return q, scale                 # int8 codes (the payload holds their bytes)
    u = q.add_(8).view(torch.uint8)     # offset by 8, as (q + 8).to(uint8) would
    if m % 2:
        u = torch.cat([u, u.new_zeros(rows, 1)], dim=1)
    return u[:, 0::2] | (u[:, 1::2] << 4), scale


def decode(codes: torch.Tensor, scale: torch.Tensor, m: int, dtype: DType) -> torch.Tensor:
    """The m float32 values of (codes, scales) (see `encode`)."""
    return decode_rows(codes.reshape(1, -1), scale.reshape(1, -1), m, dtype)[0]


def decode_rows(codes: torch.Tensor, scale: torch.Tensor, m: int, dtype: DType,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """`decode` of each row of (codes (s, code_bytes), scales (s, blocks)): (s, m) float32,
    written into `out` when given (any float dtype; an fp32 `out` is decoded in place,
    [Note: the codec's working copies])."""
    rows = codes.shape[0]
    if out is not None and (out.dtype != torch.float32 or out.stride(-1) != 1):
        return out.copy_(decode_rows(codes, scale, m, dtype))     # scaled in fp32, cast once
    vals = torch.empty(rows, m, dtype=torch.float32, device=codes.device) if out is None else out
    if dtype is DType.INT8:
        vals.copy_(codes if codes.dtype == torch.int8 else codes.view(torch.int8))
    else:
        vals[:, 0::2].copy_(codes & 0xF)                 # the even elements: low nibbles
        vals[:, 1::2].copy_((codes >> 4)[:, :m // 2])     # the odd ones: high nibbles
        vals.sub_(8)
    whole = m // BLOCK
    vals[:, :whole * BLOCK].unflatten(1, (whole, BLOCK)).mul_(scale[:, :whole, None])
    if whole * BLOCK < m:                                 # the short last block
        vals[:, whole * BLOCK:].mul_(scale[:, whole:whole + 1])
    return vals


def quantize(x: torch.Tensor, dtype: DType, out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize the 1-D float tensor `x` into a uint8 payload (see [Note: payload layout])."""
    return quantize_rows(x.reshape(1, -1), dtype, None if out is None else out.view(1, -1))[0]


def quantize_rows(x: torch.Tensor, dtype: DType, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row of the 2-D float tensor `x` quantized into one row of a uint8 payload
    (s, payload bytes); `out` may be given (a 2-D view, one payload per row)."""
    codes, scale = encode_rows(x, dtype)
    ncode = codes.shape[1]
    if out is None:
        out = torch.empty(x.shape[0], ncode + scale.shape[1] * 4, dtype=torch.uint8, device=x.device)
    out[:, :ncode].copy_(codes.view(torch.uint8))
    out[:, ncode:].copy_(scale.view(torch.uint8))
    return out


def dequantize(buf: torch.Tensor, m: int, dtype: DType, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a payload of an m-element shard into `out` (float32 unless given)."""
    vals = dequantize_rows(buf.reshape(1, -1), m, dtype, None if out is None else out.view(1, -1))[0]
    return vals if out is None else out


def dequantize_rows(buf: torch.Tensor, m: int, dtype: DType, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode each row of `buf` (s payloads of m-element shards, one per row, possibly
    longer than a payload): (s, m) float32, or into `out` (s, m) when given."""
    nblocks = ceil(m / BLOCK)
    ncode = code_bytes(m, dtype)
    scale = buf[:, ncode:ncode + nblocks * 4].clone(memory_format=torch.contiguous_format).view(torch.float32)
    return decode_rows(buf[:, :ncode], scale, m, dtype, out)


def error_bound(x: torch.Tensor, dtype: DType) -> torch.Tensor:
    """Per-element bound on |dequantize(quantize(x)) - x| (half a step of its block)."""
    m = x.numel()
    nblocks = ceil(m / BLOCK)
    xf = torch.zeros(nblocks * BLOCK, dtype=torch.float32, device=x.device)
    xf[:m] = x.reshape(-1).float()
    step = xf.view(nblocks, BLOCK).abs().amax(dim=1) / _qmax(dtype)
    return (step[:, None] * (0.5 + 1e-3)).expand(nblocks, BLOCK).reshape(-1)[:m]
