"""Collectives library — all_gather / reduce_scatter / all_reduce over mesh levels.

Input: flat 1-D tensors, a `ShardMesh`, the group's levels and the chunk digit order,
an algorithm (`Collectives`: its name; the object, with its stages, is shardc.algorithms')
and a comm dtype. Output: a `Work` handle; the result is in `out` (or `t`) once `.wait()`
returns. Contract: docs/internals.md "Mesh and collectives".

[Note: chunk placement]
Chunk c of a full buffer (n elements, chunk size m = n/s) belongs to the rank whose
index over `order` is c (`ShardMesh.index(levels, order)`). Every algorithm and comm
dtype gives exactly this placement: each stage runs on the group positioned by its own
digits, and the buffer is permuted locally before (reduce-scatter) or after (all-gather)
the stages by the algorithm's stage order (shardc.algorithms [Note: an algorithm is its
stages]); the whole-step mode's graph/funcol.py runs the same stages.

[Note: stages and handles] and [Note: streams]: runtime/eager/work.py (`Work`).

[Note: reduce-scatter on gloo]
gloo's reduce_scatter is an all-reduce followed by a slice: it moves 2(s-1)/s·n bytes
per rank (measured on loopback: 6.0·n over 4 ranks, the same as all_reduce), twice a
ring reduce-scatter. On a gloo group a reduce-scatter stage is therefore
`all_to_all_single` (rank j receives every peer's chunk j: (s-1)/s·n bytes per rank,
measured 3.0·n) followed by a local sum, accumulated in fp32 for 16-bit comm dtypes.
Other backends (NCCL) use their native `reduce_scatter_single`, which sums in the comm
dtype (like FSDP2's reduce dtype); the choice is the group's backend for the tensors'
device (`device.native_reduce_scatter`), not the device (gloo also runs CUDA tensors).

[Note: bounded all-to-all]
The all-to-all's receive buffer is a second copy of the stage's input: for a unit of
N elements, N more. Past the lowering's receive block (shardc.lowering [Note: receive
blocks]: no more than the output chunk, at least 1 MiB, at most `RS_RECV_BYTES` = 32 MiB)
per stage, the stage goes in blocks of columns
(the same columns of every chunk, sent from the input's rows in place by the list
`all_to_all`): each block is exchanged and summed into its columns of the output before
the next is issued, so a stage holds at most one block's receive buffer beside its
input and output. The bytes on the wire
are the same; the blocks after the first are issued from `wait()` ([Note: stages and
handles]), so only the first one overlaps the caller's compute. An input whose receive
buffer fits one block (every unit of the test models: inputs under 1 MiB) is one exchange.

[Note: blocks reuse their buffers]
A staged piece (`_rs_blocks`, `_ag_piece`, `_ar_blocks`) takes its block's copy, its stages'
buffers and (without the runtime's workspace) the all-to-all's receive buffers from a pool
of its own (a `Workspace`) and hands each back once the stage after it has been waited:
the next block reuses them. Allocated fresh per block, a block's buffers could outlive it:
`wait()` returns when gloo marks the op done, but gloo's worker thread drops its reference
to the op, and with it the op's tensors, a moment later, so the next block's buffers could
be allocated while the last one's were still held (measured on 4 gloo ranks: a hierarchical
reduce-scatter's piece held 5.5 blocks in 5 runs of 20 on one rank, 3.5 otherwise).
Reused, a piece holds its first block's buffers whatever gloo's thread does (the same run:
2.5 blocks on every rank in every run, tests/test_transients.py), and its last act empties
the pool, which frees their bytes (`Workspace.clear`, runtime/groups/workspace.py [Note:
bytes freed at once]); a receive buffer made fresh (no workspace) is freed the same way
once summed (`_give`), and a cast's or a quantized gather's buffers at the wait
(`free_bytes`). The stages' buffers and the receive buffers are pooled apart (roles `STAGE`
and "flat"): a stage's smaller chunk never takes the larger receive buffer the next
stage's all-to-all then needs afresh.

[Note: comm dtypes]
fp32/bf16/fp16: the input is cast to the comm dtype, communicated, and cast back into
`out`. int8/int4 all_gather (qwZ): each rank quantizes its shard (runtime/transport/quant.py), the
uint8 payloads (codes + block scales) are gathered with the chosen algorithm (they are
just bytes with the same chunk placement), and every chunk is dequantized into `out`.
int8/int4 reduce_scatter (qgZ): each rank quantizes its s chunks, one all_to_all over
the group, then dequantizes and sums the s received chunks in fp32; the algorithm is
ignored (one flat all-to-all). Payload sizes are exactly `quant.payload_bytes`.
"""
from __future__ import annotations

from math import prod

import torch
import torch.distributed as dist

import shardc.algorithms as algorithms
from shardc.algorithms.base import bounds, gather_perm, scatter_perm
from shardc.dsl.ir import Collectives, DType
from shardc.lowering import RS_RECV_BYTES, STAGING_BYTES, Op, recv_block_bytes, staging_block

from ..groups.workspace import Workspace, free_bytes
from ..transport import a2a, device, quant
from ..dtypes import torch_dtype
from ..transport.mesh import ShardMesh
from .work import Work, local_copy


# -- one-level building blocks ----------------------------------------------------------
def _ag(dst, src, pg):
    return dist.all_gather_single(dst, src, group=pg, async_op=True)


# RS_RECV_BYTES (the lowering's, shardc.lowering [Note: receive blocks]) is read from this module's
# globals so that a test may lower it here.


def _rs(dst, src, pg, scratch=None):
    """One flat reduce-scatter stage; yields its handle(s), finishes into dst. `scratch` (a
    runtime Workspace, or None) lends the all-to-all's buffers."""
    if device.native_reduce_scatter(pg, src.device.type):
        yield [dist.reduce_scatter_single(dst, src, group=pg, async_op=True)]
        return
    s, m = dist.get_world_size(pg), dst.numel()
    cols = max(1, recv_block_bytes(m * src.element_size(), RS_RECV_BYTES) // (s * src.element_size()))
    if cols >= m:
        yield from _a2a_sum(dst, src, pg, s, scratch)
        return
    rows = src.view(s, m)
    for lo in range(0, m, cols):               # one block of columns at a time
        hi = min(m, lo + cols)
        recv = _take(scratch, s * (hi - lo), src)
        yield [dist.all_to_all(list(recv.view(s, -1)), [r[lo:hi] for r in rows], group=pg, async_op=True)]
        a2a.sum_rows(recv.view(s, -1), out=dst[lo:hi])
        _give(scratch, recv)
        del recv                               # one block alive at a time ([Note: receive blocks])


def _a2a_sum(dst, src, pg, s, scratch):
    """All-to-all `src` (s rows of dst's size), then sum the s rows received into dst."""
    recv = _take(scratch, src.numel(), src)
    yield [dist.all_to_all_single(recv, src, group=pg, async_op=True)]
    a2a.sum_rows(recv.view(s, -1), out=dst)
    _give(scratch, recv)


STAGE = "stage"     # a staged piece's own buffers, pooled apart from receive buffers ("flat")


def _take(scratch, n, like, role="flat"):
    return torch.empty(n, dtype=like.dtype, device=like.device) if scratch is None \
        else scratch.take(n, like.dtype, like.device, role)


def _give(scratch, t, role="flat"):
    """Hand back `t`, taken by `_take(scratch, ...)`; made fresh (no scratch), its bytes go now
    ([Note: blocks reuse their buffers]: gloo may still hold the tensor)."""
    if scratch is not None:
        scratch.give(t, role)
    else:
        free_bytes(t)


def _n(sm: ShardMesh, levels) -> int:
    return prod(sm.mesh.size(n) for n in levels)


# -- all_gather ---------------------------------------------------------------------------
def _ag_piece(out_view, src, sm, stages, key, lo, hi, block):
    """Gather piece [lo:hi) of every chunk stage by stage, a block of at most `block`
    columns at a time (shardc.lowering [Note: staging chunks]); place it by `key`."""
    names = [d for st in reversed(stages) for d in st]
    perm = gather_perm(stages, key)
    pool = Workspace()                            # [Note: blocks reuse their buffers]
    for a in range(lo, hi, block):
        b = min(hi, a + block)
        buf = src[a - lo:b - lo]
        for i, st in enumerate(stages):
            nxt = _take(pool, _n(sm, st) * buf.numel(), buf, STAGE)
            yield [_ag(nxt, buf, sm.group(st, st))]
            if i:
                _give(pool, buf, STAGE)           # read by this stage: free for the next
            buf = nxt
        out_view[..., a:b].copy_(buf.view(*[sm.mesh.size(n) for n in names], b - a).permute(perm))
        _give(pool, buf, STAGE)                   # free before the next block is gathered
    pool.clear()


def _ag_one(out, inp, pg):
    yield [_ag(out, inp, pg)]


def _ag_bytes(out, inp, sm, key, algo):
    """The algorithm's stages of all_gather, for buffers already in the comm dtype."""
    stages = algo.gather(key, sm.mesh.ordered)
    if stages == (key,) and algo.pieces == 1:          # one flat stage: straight into `out`
        return [_ag_one(out, inp, sm.group(key, key))]
    m = inp.numel()
    out_view = out.view(*[sm.mesh.size(n) for n in key], m)
    block = staging_block(_n(sm, key) * inp.element_size(), algo.pieces, STAGING_BYTES)
    return [_ag_piece(out_view, inp[lo:hi].contiguous(), sm, stages, key, lo, hi, block)
            for lo, hi in bounds(m, algo.pieces)]


def _prologue(out, inp, mesh: ShardMesh, levels, order, algo):
    """The group's digit key, the resolved algorithm, flat views and the group size."""
    key = mesh.digits(levels, order)
    return (key, algorithms.resolve(algo, key), out.view(-1), inp.reshape(-1),
            prod(mesh.mesh.size(n) for n in key))


def all_gather(out, inp, mesh: ShardMesh, levels, order=None, *, algo=Collectives.RING,
               comm: DType = DType.FP32) -> Work:
    """out (n) = concat over the chunk index (over `order`) of every rank's inp (n/s)."""
    key, algo, out, inp, s = _prologue(out, inp, mesh, levels, order, algo)
    if not key:
        return local_copy(out, inp)
    assert out.numel() == s * inp.numel(), f"all_gather: out has {out.numel()} elements, expected {s}*{inp.numel()}"
    on = device.launch(Op.ALL_GATHER, out, inp)
    with on.active():
        pieces, then = _ag_plan(out, inp, mesh, key, algo, comm, s)
        return Work(*pieces, then=then, on=on)


def _ag_plan(out, inp, mesh, key, algo, comm, s):
    """The pieces and the post-processing of an all_gather (comm dtype casts, dequantize)."""
    m = inp.numel()
    if comm.quantized:
        p = quant.shard_payload_bytes(m, comm)
        payload = quant.quantize(inp, comm)
        gathered = payload.new_empty(s * p)

        def decode():                            # rows at once (runtime/transport/quant.py [Note: rows at once])
            rows, got = out.view(s, m), gathered.view(s, p)
            for lo, hi in quant.row_batches(s, m, got.device):
                quant.dequantize_rows(got[lo:hi], m, comm, out=rows[lo:hi])
            free_bytes(payload, gathered)
        return _ag_bytes(gathered, payload, mesh, key, algo), decode
    cdt = torch_dtype(comm)
    if cdt == out.dtype and cdt == inp.dtype:
        return _ag_bytes(out, inp, mesh, key, algo), None
    tmp, src = out.new_empty(s * m, dtype=cdt), inp.to(cdt)
    return _ag_bytes(tmp, src, mesh, key, algo), _copy_back(out, tmp, src, inp)


def _copy_back(out, tmp, src, inp):
    """A cast collective's last act: `tmp` into `out`, then the casts' bytes freed
    (`src` unless it is `inp` itself; [Note: blocks reuse their buffers])."""
    def then():
        out.copy_(tmp)
        free_bytes(tmp, *([] if src is inp else [src]))
    return then


# -- reduce_scatter -----------------------------------------------------------------------
def _rs_piece(dst, src, sm, stages, scratch=None, pool=None):
    """Reduce-scatter `src` (dims: the stages' digits in order, then the piece) stage by
    stage; the stages between take their buffers from `pool` (fresh when None) and hand
    them back once read ([Note: blocks reuse their buffers])."""
    buf = src
    for i, st in enumerate(stages):
        nxt = dst if i == len(stages) - 1 else _take(pool, buf.numel() // _n(sm, st), buf, STAGE)
        yield from _rs(nxt, buf, sm.group(st, st), scratch)
        if i:
            _give(pool, buf, STAGE)
        buf = nxt


def _rs_pieces(out, inp, sm, key, algo, scratch=None):
    """The reduce-scatter's pieces: one flat stage reads `inp` in place; staged ones copy
    their columns out in the stages' order a block at a time (`staging_block`: the pieces'
    blocks together at most STAGING_BYTES)
    (shardc.lowering [Note: staging chunks])."""
    stages = algo.scatter(key, sm.mesh.ordered)
    if stages == (key,) and algo.pieces == 1:          # one flat stage
        return [_rs(out, inp, sm.group(key, key), scratch)]
    m = out.numel()
    full = inp.view(*[sm.mesh.size(n) for n in key], m).permute(scatter_perm(stages, key))
    block = staging_block(_n(sm, key) * inp.element_size(), algo.pieces, STAGING_BYTES)
    return [_rs_blocks(out, full, lo, hi, block, sm, stages, scratch) for lo, hi in bounds(m, algo.pieces)]


def _rs_blocks(out, full, lo, hi, block, sm, stages, scratch):
    """Columns [lo, hi) reduce-scattered a block at a time: copied out contiguous (the
    stages' digit order), through the stages into their columns of `out`; one block's
    staging alive at a time, its buffers reused ([Note: blocks reuse their buffers])."""
    pool = Workspace()
    for a in range(lo, hi, block):
        b = min(hi, a + block)
        src, owned = _copy_out(pool, full[..., a:b])
        yield from _rs_piece(out[a:b], src, sm, stages, pool if scratch is None else scratch, pool)
        if owned:
            _give(pool, src, STAGE)               # free before the next block is copied out
    pool.clear()


def _copy_out(pool, cols):
    """`cols` flat, and whether it is a copy in a buffer of `pool` (the caller hands it
    back) rather than `cols` itself (already contiguous: one block of the whole input)."""
    if cols.is_contiguous():
        return cols.view(-1), False
    src = _take(pool, cols.numel(), cols, STAGE)
    src.view(cols.shape).copy_(cols)
    return src, True


def _qgz(out, inp, sm, key, comm):
    """Quantized reduce-scatter: quantize s chunks, one all_to_all, dequantize and sum in fp32
    (runtime/transport/a2a.py, shared with the whole-step mode)."""
    pg = sm.group(key, key)
    send = a2a.qgz_send(inp, dist.get_world_size(pg), comm)
    recv = torch.empty_like(send)
    yield [dist.all_to_all_single(recv.view(-1), send.view(-1), group=pg, async_op=True)]
    out.copy_(a2a.qgz_sum(recv, out.numel(), comm))
    free_bytes(recv, send)


def reduce_scatter(out, inp, mesh: ShardMesh, levels, order=None, *, algo=Collectives.RING,
                   comm: DType = DType.FP32, scratch=None) -> Work:
    """out (n/s) = sum over the group of inp[chunk(index)], chunks indexed over `order`.
    `scratch` (a runtime Workspace) lends the gloo all-to-all's receive buffers."""
    key, algo, out, inp, s = _prologue(out, inp, mesh, levels, order, algo)
    if not key:
        return local_copy(out, inp)
    assert inp.numel() == s * out.numel(), f"reduce_scatter: inp has {inp.numel()} elements, expected {s}*{out.numel()}"
    on = device.launch(Op.REDUCE_SCATTER, out, inp)
    with on.active():
        if comm.quantized:
            return Work(_qgz(out, inp, mesh, key, comm), on=on)
        cdt = torch_dtype(comm)
        if cdt == out.dtype and cdt == inp.dtype:
            return Work(*_rs_pieces(out, inp, mesh, key, algo, scratch), on=on)
        tmp, src = out.new_empty(out.numel(), dtype=cdt), inp.to(cdt)
        return Work(*_rs_pieces(tmp, src, mesh, key, algo, scratch), then=_copy_back(out, tmp, src, inp), on=on)


# -- all_reduce ---------------------------------------------------------------------------
def _ar_piece(buf, sm, plan, pool=None):
    """All-reduce `buf` (numel divisible by the scatter stages' ranks): reduce-scatter down
    the plan's scatter stages, all-reduce over its `reduce` group, all-gather back up; the
    stages' chunks and receive buffers from `pool` (fresh when None), handed back at the end."""
    chunks = [buf]
    for st in plan.scatter:
        nxt = _take(pool, chunks[-1].numel() // _n(sm, st), buf, STAGE)
        yield from _rs(nxt, chunks[-1], sm.group(st, st), pool)
        chunks.append(nxt)
    yield [dist.all_reduce(chunks[-1], group=sm.group(plan.reduce, plan.reduce), async_op=True)]
    for i, st in enumerate(plan.gather):
        yield [_ag(chunks[-2 - i], chunks[-1 - i], sm.group(st, st))]
    for c in chunks[1:]:
        _give(pool, c, STAGE)


def all_reduce(t, mesh: ShardMesh, levels, *, algo=Collectives.RING) -> Work:
    """Sum `t` in place over the group of `levels`."""
    key = mesh.digits(levels, None)
    if not key:
        return Work()
    algo = algorithms.resolve(algo, key)
    on = device.launch(Op.ALL_REDUCE, t)
    with on.active():
        pieces, then = _ar_plan(t, mesh, key, algo)
        return Work(*pieces, then=then, on=on)


def _ar_plan(t, mesh, key, algo):
    """The all-reduce's pieces, each staging its columns in blocks (`staging_block`: the
    pieces' blocks together at most STAGING_BYTES, shardc.lowering [Note: staging chunks]); the padded copy only when n needs padding."""
    plan = algo.reduce(key, mesh.mesh.ordered)
    if plan.gather != tuple(reversed(plan.scatter)):
        raise ValueError(f"{algo!r}: an all-reduce gathers back up the stages it scattered down")
    inner = prod(_n(mesh, st) for st in plan.scatter)
    n = t.numel()
    if not plan.scatter or n < inner:                 # one flat all-reduce (or too small to split)
        return [_ar_flat(t, mesh.group(key))], None
    if n % inner == 0 and t.is_contiguous():
        flat, finish = t.view(-1), None
    else:
        flat = t.new_zeros(-(-n // inner) * inner)
        flat[:n] = t.reshape(-1)

        def finish():
            t.copy_(flat[:n].view(t.shape))
    view = flat.view(inner, -1)
    block = staging_block(inner * t.element_size(), algo.pieces, STAGING_BYTES)
    return [_ar_blocks(view, lo, hi, block, mesh, plan) for lo, hi in bounds(view.shape[1], algo.pieces)], finish


def _ar_blocks(view, lo, hi, block, mesh, plan):
    """Columns [lo, hi) of `view` all-reduced a block at a time: copied out contiguous,
    through the plan's stages, copied back; one block's staging alive at a time, its
    buffers reused ([Note: blocks reuse their buffers])."""
    pool = Workspace()
    for a in range(lo, hi, block):
        b = min(hi, a + block)
        buf, owned = _copy_out(pool, view[:, a:b])
        yield from _ar_piece(buf, mesh, plan, pool)
        if owned:
            view[:, a:b].copy_(buf.view(view.shape[0], -1))
            _give(pool, buf, STAGE)               # free before the next block is copied out
    pool.clear()


def _ar_flat(t, pg):
    yield [dist.all_reduce(t, group=pg, async_op=True)]
