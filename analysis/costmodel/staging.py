"""A collective's own buffers — the bytes one all-gather, reduce-scatter or all-reduce holds
beside its input and output while it is in flight, for the memory timeline (timeline.py).

Input: the strategy's mesh, the resolved collective algorithm (`Collectives`, as explain
resolves `auto`), one plan `Row` (levels, digit order, comm dtype) and the collective's
size. Output: bytes per rank. Each rule follows the executor that allocates the buffers,
runtime/eager/collectives.py, stage by stage (the algorithm's stages: shardc.algorithms); one
flat stage in the collective's own dtype holds nothing of its own.

[Note: staging: reduce-scatter]
`_rs_pieces` / `_rs_blocks`: a multi-stage reduce-scatter (hierarchical, ho-ring over two
or more levels) goes a block per piece at a time, the pieces' blocks together at most
STAGING_BYTES (shardc.lowering [Note: staging chunks], `staging_block`): the block's columns are copied out contiguous in the stages'
order (b bytes; none when one piece's one block is the whole input and the group's digit
order is already the stages': the permuted view is contiguous), then each stage but the
last writes a new buffer (`_rs_piece`: b / |S_1|, b / |S_1||S_2|, ...); the block is freed
before the piece's next. Every piece's block counts for as long as the reduce-scatter is
in flight (a bound: the pieces run at once from the issue). A comm dtype other than the buffers' adds the cast input (n in the comm dtype)
and its output (`tmp`). qgZ (`_qgz`, a quantized comm) is one all-to-all: the send and
receive payloads (s x the quantized shard each) and an fp32 accumulator of the output.

[Note: staging: all-gather]
`_ag_piece`: a multi-stage all-gather goes a block of each piece's columns at a time, the
pieces' blocks together at most STAGING_BYTES (shardc.lowering [Note: staging chunks]); each stage writes a new buffer,
|S_1| b, then |S_1||S_2| b, ..., the last the block's whole s b, placed into its columns of
the output before the next block is gathered. Issued (`Work` runs every piece to its first
stage) it holds each piece's first stage's buffer; at its wait the last two at once
(s b + s b / |S_k| per piece: n + n / |S_k| when the blocks are whole pieces). qwZ (a quantized comm) holds
the quantized shard and the gathered payloads (s of them), and at its wait the larger of
its stages' buffers and the decode's temporaries (the stages' are freed before `decode`).

[Note: staging: all-reduce]
`_ar_plan` / `_ar_blocks`: a staged all-reduce copies a block per piece out (the pieces'
together at most STAGING_BYTES, shardc.lowering [Note: staging chunks]) contiguous (no copy when one block
is every column: the view is already contiguous), then each scatter stage writes a new
buffer (b / |S_1|, ...), all alive until the block is copied back. An input
whose length is not a multiple of the scatter stages' ranks is first padded (a copy of n,
alive for the whole all-reduce).

[Note: staging: receive blocks]
With `a2a` (a backend in shardc.lowering's A2A_RS_BACKENDS: gloo) each flat reduce-scatter
stage is an all-to-all and a sum (runtime/eager/collectives.py `_rs`) holding one receive
block at a time (`recv_bytes`, shardc.lowering [Note: receive blocks]): a reduce-scatter's or
a staged all-reduce's stages run one after the other, so a piece holds its largest stage's
block, and the pieces' blocks add up. A native reduce-scatter (NCCL, a simulated rank's fake
group) holds none. Measured on 4 gloo ranks (bench/peak_gloo.py): ddp on HF GPT-2, its
all-reduce over node(2) > gpu(2) staged, 0.830 of the backward's peak without them.

[Note: staging: codec temporaries]
runtime/transport/quant.py codes a quantized collective's rows a batch at a time (shardc.lowering
[Note: codec batches]), in place where it can (quant.py [Note: the codec's working copies]).
Encoding a batch of b elements (padded to whole blocks: b') holds the quotient (b' fp32) and
the int8 codes (b), or, when the rows are not whole fp32 blocks, the padded fp32 copy beside
the quotient (2 b' fp32). Decoding into an fp32 buffer holds only int4's nibbles (b/2); into
any other dtype, the fp32 values first (b fp32). qgZ's sum decodes into one fp32 rows buffer
(b) beside its fp32 accumulator (the chunk, m), and sums a batch of several rows (m more). These live only while the collective is
issued (encode) or waited (decode), beside its payloads.
"""
from __future__ import annotations

from math import prod

import shardc.algorithms as algorithms
from shardc.algorithms.base import bounds, scatter_perm
from shardc.dsl.ir import Collectives, Mesh
from shardc.lowering import BLOCK, recv_bytes, shard_payload_bytes, staging_block
from shardc.lowering.peak_facts import CODEC_ROWS
from shardc.lowering.rows import elem_bytes



def _key(mesh: Mesh, row) -> tuple[str, ...]:
    order = row.order or mesh.ordered(row.levels)
    return tuple(l for l in order if mesh.size(l) > 1)


def _n(mesh: Mesh, stage) -> int:
    return prod(mesh.size(l) for l in stage)


def _algo(mesh: Mesh, algo: Collectives | None, key):
    return algorithms.resolve(Collectives.AUTO.value if algo is None else Collectives(algo).value, key)


def reduce_scatter_bytes(mesh: Mesh, algo, row, n: int, elem: int, a2a: bool = False) -> int:
    """Bytes a reduce-scatter of `n` input elements of `elem` bytes holds while in flight
    ([Note: staging: reduce-scatter]; `a2a`: its stages' receive blocks too, [Note: staging:
    receive blocks])."""
    key = _key(mesh, row)
    if not key or row is None:
        return 0
    s = _n(mesh, key)
    if row.comm.quantized:                      # qgZ: the send and receive payloads
        return 2 * s * shard_payload_bytes(n // s, row.comm)
    c = elem_bytes(row.comm)
    cast = n * c + (n // s) * c if c != elem else 0
    a = _algo(mesh, algo, key)
    stages = a.scatter(key, mesh.ordered)
    if stages == (key,) and a.pieces == 1:
        return cast + (recv_bytes(n // s, s, c) if a2a else 0)
    # per piece, one block of its columns at a time (`staging_block`): copied out (no
    # copy when the one block is the whole input in the stages' order: a view), then each
    # stage but the last writes a new buffer
    m = n // s
    block = staging_block(s * c, a.pieces)
    inplace = a.pieces == 1 and scatter_perm(stages, key) == sorted(scatter_perm(stages, key))
    total = 0
    for lo, hi in bounds(m, a.pieces):
        b = min(hi - lo, block) * s * c
        total += 0 if inplace and b == m * s * c else b
        recv = 0
        for k, st in enumerate(stages):
            recv = max(recv, recv_bytes(b // _n(mesh, st) // c, _n(mesh, st), c) if a2a else 0)
            b //= _n(mesh, st)
            total += b if k < len(stages) - 1 else 0
        total += recv
    return cast + total


def all_gather_bytes(mesh: Mesh, algo, row, n: int, elem: int) -> tuple[int, int]:
    """(issued, at its wait): bytes an all-gather of `n` output elements holds
    ([Note: staging: all-gather])."""
    key = _key(mesh, row)
    if not key or row is None:
        return 0, 0
    s = _n(mesh, key)
    a = _algo(mesh, algo, key)
    stages = a.gather(key, mesh.ordered)
    staged = not (stages == (key,) and a.pieces == 1)
    if row.comm.quantized:                      # qwZ: the quantized shard and s gathered payloads
        p = shard_payload_bytes(n // s, row.comm)
        if not staged:
            return p + s * p, p + s * p + codec_bytes(mesh, row, n, elem)
        # the stages' buffers are freed before the payloads are decoded
        return (p + s * p + p * _n(mesh, stages[0]),
                p + s * p + max(s * p + s * p // _n(mesh, stages[-1]), codec_bytes(mesh, row, n, elem)))
    c = elem_bytes(row.comm)
    cast = n * c if c != elem else 0
    if not staged:
        return cast, cast
    # per piece, one block of its columns at a time (`staging_block`)
    block = staging_block(s * c, a.pieces)
    first = last = 0
    for lo, hi in bounds(n // s, a.pieces):
        b = min(hi - lo, block) * c
        first += b * _n(mesh, stages[0])
        last += b * s + b * s // _n(mesh, stages[-1])
    return cast + first, cast + last


def all_reduce_bytes(mesh: Mesh, algo, row, n: int, elem: int, a2a: bool = False) -> int:
    """Bytes a staged all-reduce of `n` elements of `elem` bytes holds while in flight
    ([Note: staging: all-reduce]; `a2a`: its scatter stages' receive blocks too, [Note:
    staging: receive blocks])."""
    key = _key(mesh, row)
    if not key or row is None:
        return 0
    a = _algo(mesh, algo, key)
    plan = a.reduce(key, mesh.ordered)
    inner = prod(_n(mesh, st) for st in plan.scatter)
    if not plan.scatter or n < inner:
        return 0
    pad = 0 if n % inner == 0 else -(-n // inner) * inner * elem
    cols = -(-n // inner)
    block = staging_block(inner * elem, a.pieces)
    total = 0
    for lo, hi in bounds(cols, a.pieces):
        b = min(hi - lo, block) * inner * elem
        if hi - lo < cols or block < cols:       # a block of some columns: copied out contiguous
            total += b
        recv = 0
        for st in plan.scatter:
            recv = max(recv, recv_bytes(b // _n(mesh, st) // elem, _n(mesh, st), elem) if a2a else 0)
            b //= _n(mesh, st)
            total += b
        total += recv
    return pad + total


def codec_bytes(mesh: Mesh, row, n: int, out_elem: int) -> int:
    """The codec's temporaries of a quantized all-gather over n elements, decoded into a
    buffer of `out_elem`-byte elements: one batch's ([Note: staging: codec temporaries]);
    0 for a collective in a float dtype."""
    return _codec(mesh, row, n, out_elem, 4)


def reduce_codec_bytes(mesh: Mesh, row, n: int, in_elem: int) -> int:
    """qgZ's codec temporaries: the larger of its encode of `in_elem`-byte inputs and its
    sum's decode ([Note: staging: codec temporaries])."""
    return _codec(mesh, row, n, 0, in_elem)


def _codec(mesh: Mesh, row, n: int, out_elem: int, in_elem: int) -> int:
    """One batch's codec bytes: an all-gather's decode (`out_elem` > 0) or qgZ's."""
    key = _key(mesh, row) if row is not None else ()
    if not key or not row.comm.quantized:
        return 0
    s = _n(mesh, key)
    m = max(n // s, 1)
    rows = min(s, max(1, CODEC_ROWS // m))
    batch, padded = rows * m, rows * -(-m // BLOCK) * BLOCK
    nibbles = batch // 2 if row.comm.bits == 4 else 0
    if out_elem:                                # an all-gather's decode into its output
        return nibbles + (0 if out_elem == 4 else 4 * batch)
    copy = m % BLOCK != 0 or in_elem != 4
    encode = 8 * padded if copy else 4 * padded + batch
    return max(encode, 4 * m + 4 * batch + nibbles + (4 * m if rows > 1 else 0))
