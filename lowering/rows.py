"""Rows and storage — part of stage 3 (lowering): what one flat group sends and holds.

Input: a group's `Placement` (its mesh, scopes and factors), its padded size N, whether
it is trainable and whether the unit is the root. Output: a `GroupPlan` — the group's
ledger rows (docs/internals.md "Ledger") and its bytes per rank (internals.md "Memory").
This module owns the payload formula, bytes per element and the quantized block size.

[Note: the rule table]
  forward   all_gather      P        payload(N, s_P, params.comm)        per forward, s_P > 1
  backward  all_gather      P or Q   payload(N, s, ...)                  per backward, non-root
  backward  reduce_scatter  G        payload(N, s_G, grads.comm)         per backward (all_to_all if quantized)
  sync      reduce_scatter  OS∖G     N/s_G · b(grads.dtype)              once per step
  sync      all_reduce      mesh∖OS  N/s_OS · b(grads.dtype)             once per step
  update    all_gather      OS∖P     N/s_P · b(params.dtype)             once per step
  update    all_reduce      OS       4                                   per clip call, per distinct OS
A collective over a group whose factor is 1 is never issued, so it has no row.

[Note: step payloads]
A row's `comm` is the dtype on the wire, and its bytes count that dtype. The step's rows
(sync, update) move the stored shards as they are: the sync in the grad shard's dtype, the
update all-gather in the params' dtype. (Until 2026-11-27 they defaulted to fp32: a bf16
strategy sent twice the bytes its ledger recorded for them and cast each unit's shard to an
fp32 copy, every update all-gather's in flight at once after opt.step(): a simulated
LLaMA-65B rank under ZeRO-2 in bf16 held 261 GB of those copies, docs/simulate.md.)

[Note: the master is the params shard]
Where a trainable group's params are not fp32, are gathered (s_P > 1) and sharded exactly
as its optimizer states (s_P = s_OS: ZeRO-3, MiCS, HSDP), this rank's params chunk and its
OS chunk are the same elements. The group then keeps one copy of them, the fp32 master, as
its params shard, and casts it to the params dtype on the way into each forward (and
backward) all-gather, as FSDP2 does under `MixedPrecisionPolicy(param_dtype=bf16)`: no
persistent params-dtype shard beside the master (LLaMA-65B under MiCS on 1024 ranks: 16.3
GB per rank). The values gathered are the same (the master cast, as the shard was after
each step); `params` reports the fp32 shard and `optim` no separate master
(`master_is_params`, read by runtime/groups/storage.py and by this module's `group_plan`). The
cast's output lives while its all-gather is in flight (analysis/costmodel/timeline.py).
"""
from __future__ import annotations

from dataclasses import replace
from math import ceil

from shardc.dsl.ir import DType, Mesh, Scopes

from .ir import Factors, GroupPlan, LedgerRecord, Op, Over, Per, Phase, Placement, Row
from .layout import minus
from .placements import rank as placement_rank

BLOCK = 256            # elements per fp32 scale of a quantized payload
CLIP_BYTES = 4         # the squared-norm scalar of clip_grad_norm_


def elem_bytes(dtype: DType) -> int:
    """Bytes per element of an unquantized dtype."""
    return dtype.bits // 8


def code_bytes(m: int, dtype: DType) -> int:
    """Bytes of the codes of m elements quantized to `dtype` (int4: two per byte)."""
    return ceil(m * dtype.bits / 8)


def shard_payload_bytes(m: int, dtype: DType) -> int:
    """Bytes of one quantized m-element shard: codes then one fp32 scale per BLOCK elements."""
    return code_bytes(m, dtype) + ceil(m / BLOCK) * 4


def payload_bytes(n: int, s: int, dtype: DType) -> int:
    """Payload of one collective with logical numel n over s ranks in comm dtype `dtype`."""
    if dtype.quantized:
        return s * shard_payload_bytes(n // s, dtype)
    return n * elem_bytes(dtype)


def _gathers(sc: Scopes, f: Factors, mesh: Mesh, n: int, root: bool):
    P = mesh.ordered(sc.params.levels)
    if f.p == 1:
        return
    yield Row(Phase.FORWARD, Op.ALL_GATHER, P, sc.chunk_order("params"), payload_bytes(n, f.p, sc.params.comm),
              Per.FORWARD, sc.params.comm)
    sec = sc.params.secondary
    if root:
        return
    if sec is None:
        yield Row(Phase.BACKWARD, Op.ALL_GATHER, P, sc.chunk_order("params"),
                  payload_bytes(n, f.p, sc.params.comm), Per.BACKWARD, sc.params.comm)
    elif f.q > 1:
        Q, dt = mesh.ordered(sec.levels), sec.quant or sc.params.dtype
        yield Row(Phase.BACKWARD, Op.ALL_GATHER, Q, Q, payload_bytes(n, f.q, dt), Per.BACKWARD, dt)


def _gradients(sc: Scopes, f: Factors, mesh: Mesh, n: int):
    G, OS, P = (mesh.ordered(getattr(sc, k).levels) for k in ("grads", "optim", "params"))
    gb = elem_bytes(sc.grads.dtype)
    if f.g > 1:
        op = Op.ALL_TO_ALL if sc.grads.comm.quantized else Op.REDUCE_SCATTER
        yield Row(Phase.BACKWARD, op, G, sc.chunk_order("grads"), payload_bytes(n, f.g, sc.grads.comm),
                  Per.BACKWARD, sc.grads.comm, "grads")
    os_g = minus(mesh, OS, G)
    if mesh.factor(os_g) > 1:
        order = tuple(l for l in sc.chunk_order("optim") if l not in sc.chunk_order("grads"))
        # the wire dtype is the one the bytes count: the grad shard's ([Note: step payloads])
        yield Row(Phase.SYNC, Op.REDUCE_SCATTER, os_g, order, n // f.g * gb, Per.STEP, sc.grads.dtype, "optim")
    outside = minus(mesh, mesh.names, OS)
    if mesh.factor(outside) > 1:
        yield Row(Phase.SYNC, Op.ALL_REDUCE, outside, outside, n // f.os * gb, Per.STEP, sc.grads.dtype, "optim")
    os_p = minus(mesh, OS, P)
    if mesh.factor(os_p) > 1:
        order = tuple(l for l in sc.chunk_order("optim") if l not in sc.chunk_order("params"))
        yield Row(Phase.UPDATE, Op.ALL_GATHER, os_p, order, n // f.p * elem_bytes(sc.params.dtype),
                  Per.STEP, sc.params.dtype, "optim")


def _secondary_bytes(sc: Scopes, f: Factors, n: int, root: bool) -> int:
    sec = sc.params.secondary
    if sec is None or root:
        return 0
    per = n // f.q
    return shard_payload_bytes(per, sec.quant) if sec.quant else per * elem_bytes(sc.params.dtype)


def master_is_params(params_dtype: DType, trainable: bool, s_p: int, s_os: int) -> bool:
    """Whether the fp32 master is the group's params shard ([Note: the master is the params shard])."""
    return trainable and params_dtype is not DType.FP32 and s_p > 1 and s_p == s_os


def group_plan(pl: Placement, phi: int, n: int, trainable: bool, root: bool, single: bool = False,
               tensors=()) -> GroupPlan:
    """`single`: its trainable elements are one tensor (whole_grad when unpadded, grads in the
    params dtype); `tensors`: its trainable tensors, (model order, elements) in layout order."""
    sc, f, mesh = pl.scopes, pl.factors, pl.mesh
    rows = tuple(_gathers(sc, f, mesh, n, root)) + (tuple(_gradients(sc, f, mesh, n)) if trainable else ())
    if pl.over != Over.DENSE:
        rows = tuple(replace(r, over=pl.over) for r in rows)
    pb = elem_bytes(sc.params.dtype)
    one = master_is_params(sc.params.dtype, trainable, f.p, f.os)
    return GroupPlan(
        trainable=trainable, placement=pl, phi=phi, n=n, rows=rows,
        params_bytes=n // f.p * (4 if one else pb),
        secondary_bytes=_secondary_bytes(sc, f, n, root),
        grads_bytes=n // f.g * elem_bytes(sc.grads.dtype) if trainable else 0,
        optim_elems=n // f.os if trainable else 0,
        master_bytes=n // f.os * 4 if trainable and sc.params.dtype is not DType.FP32 and not one else 0,
        gathered_bytes=n * pb if f.p > 1 else 0,
        whole_grad=single and trainable and phi == n and sc.params.dtype is sc.grads.dtype,
        tensors=tuple(tensors))


def clip_rows(mesh: Mesh, optim_levels) -> tuple[Row, ...]:
    """The clip_grad_norm_ all-reduce of the squared norm, once per distinct optimizer level set."""
    out = []
    for levels in sorted(set(optim_levels)):
        lv = mesh.ordered(levels)
        if mesh.factor(lv) > 1:
            out.append(Row(Phase.UPDATE, Op.ALL_REDUCE, lv, lv, CLIP_BYTES, Per.CLIP, state="optim"))
    return tuple(out)


def norm_row(levels: tuple[str, ...], nbytes: int, over: Over = Over.DENSE) -> Row:
    """The all-reduce of whole-tensor norm partials over `levels` (`nbytes`: one entry per
    tensor), what a norm of shardc tensors read on its own runs (runtime/state/norms.py; a
    clip's total runs the plan's clip rows instead): a clip row of the measured size, so the
    ledger gets it through `record_row` like any other."""
    return Row(Phase.UPDATE, Op.ALL_REDUCE, levels, levels, nbytes, Per.CLIP, over=over)


PHASE_ORDER = tuple(p.value for p in Phase)


def ledger_key(row: Row, phase: Phase | None = None) -> tuple:
    """What the ledger counts a run of `row` under (`phase` overrides the row's: a backward
    re-gather that reuses the forward row): (phase, op, levels, bytes, over)."""
    return (Phase(phase or row.phase).value, Op(row.op).value, tuple(row.levels), int(row.bytes), row.over.value)


def merged(counts) -> list[LedgerRecord]:
    """`{ledger_key: count}` as ledger records, in ledger order (phase, op, levels, bytes, `Over` order)."""
    keys = sorted(counts, key=lambda k: (PHASE_ORDER.index(k[0]), k[1], k[2], k[3], placement_rank(k[4])))
    return [LedgerRecord(p, o, tuple(l), b, counts[(p, o, l, b, e)], e) for p, o, l, b, e in keys]
