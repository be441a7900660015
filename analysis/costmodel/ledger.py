"""Predicted communication ledger — what `ShardedModule.comm_ledger()` will record.

Input: a Strategy, the model's `UnitSize`s (root first), the number of micro-batches
(forwards and backwards) per optimizer step, and whether `clip_grad_norm_` is called.
Output: `list[LedgerRecord]` for one optimizer step, merged and sorted exactly as the
runtime does (docs/internals.md, "Ledger").

[Note: one rule table]
Every record comes from one row of the internals.md table, applied per flat group
(trainable, frozen) of every unit, with N the padded group size:
  forward   all_gather      P        payload(N, params.comm)             per forward, s_P > 1
  backward  all_gather      P or Q   payload(N, ...)                     per backward, non-root
  backward  reduce_scatter  G        payload(N, grads.comm)              per backward (all_to_all if quantized)
  sync      reduce_scatter  OS∖G     N/s_G · b(grads.dtype)              once
  sync      all_reduce      mesh∖OS  N/s_OS · b(grads.dtype)             once
  update    all_gather      OS∖P     N/s_P · b(params.dtype)             once
  update    all_reduce      OS       4                                   per clip call, per distinct OS
A collective over a group whose factor is 1 is never issued, so it is never recorded.
"""
from __future__ import annotations

from collections import Counter

from shardc.dsl.ir import DType, Mesh, Strategy

from shardc.analysis.costmodel.sizes import Factors, UnitSize, payload_bytes

PHASES = ("forward", "backward", "sync", "update")

try:  # the runtime's record type: predictions compare equal to measurements
    from shardc.runtime import LedgerRecord  # type: ignore[attr-defined]
except ImportError:
    from shardc.runtime.ledger import LedgerRecord


def nbytes(dtype: DType) -> int:
    """Bytes per element of an unquantized dtype."""
    return dtype.bits // 8


def _minus(mesh: Mesh, a, b) -> tuple[str, ...]:
    return mesh.ordered(set(a) - set(b))


def _unit_records(u: UnitSize, mesh: Mesh, fwd: int, bwd: int):
    """Yield `(phase, op, levels, bytes, count)` for every group of one unit."""
    sc = u.scopes
    P, G, OS = sc.params.levels, sc.grads.levels, sc.optim.levels
    f = Factors.of(sc, mesh)
    sec = sc.params.secondary
    for n, trainable in u.groups(mesh):
        if f.p > 1:
            if fwd:
                yield "forward", "all_gather", P, payload_bytes(n, f.p, sc.params.comm), fwd
            if not u.root and bwd:
                if sec is None:
                    yield "backward", "all_gather", P, payload_bytes(n, f.p, sc.params.comm), bwd
                elif f.q > 1:
                    dt = sec.quant or sc.params.dtype
                    yield "backward", "all_gather", mesh.ordered(sec.levels), payload_bytes(n, f.q, dt), bwd
        if not trainable:
            continue
        if f.g > 1 and bwd:
            op = "all_to_all" if sc.grads.comm.quantized else "reduce_scatter"
            yield "backward", op, G, payload_bytes(n, f.g, sc.grads.comm), bwd
        gb = nbytes(sc.grads.dtype)
        os_g = _minus(mesh, OS, G)
        if mesh.factor(os_g) > 1:
            yield "sync", "reduce_scatter", os_g, n // f.g * gb, 1
        outside = _minus(mesh, mesh.names, OS)
        if mesh.factor(outside) > 1:
            yield "sync", "all_reduce", outside, n // f.os * gb, 1
        os_p = _minus(mesh, OS, P)
        if mesh.factor(os_p) > 1:
            yield "update", "all_gather", os_p, n // f.p * nbytes(sc.params.dtype), 1


def predict_ledger(strategy: Strategy, units: list[UnitSize], *, micro_batches: int | None = None,
                   forwards: int | None = None, clip_grad_norm: bool = False) -> list[LedgerRecord]:
    """The ledger of one optimizer step of `strategy` on `units`.

    `micro_batches` defaults to `strategy.accumulate`; `forwards` (default: one per
    micro-batch) counts extra eval forwards too. `clip_grad_norm` adds the 4-byte
    all-reduce of the squared norm per distinct optimizer level set.
    """
    m = strategy.accumulate if micro_batches is None else micro_batches
    fwd = m if forwards is None else forwards
    mesh = strategy.mesh
    counts: Counter = Counter()
    for u in units:
        for phase, op, levels, b, c in _unit_records(u, mesh, fwd, m):
            counts[(phase, op, tuple(levels), b)] += c
    if clip_grad_norm:
        seen = {u.scopes.optim.levels for u in units if u.trainable}
        for levels in seen:
            if mesh.factor(levels) > 1:
                counts[("update", "all_reduce", tuple(levels), 4)] += 1
    keys = sorted(counts, key=lambda k: (PHASES.index(k[0]), k[1], k[2], k[3]))
    return [LedgerRecord(p, o, l, b, counts[(p, o, l, b)]) for p, o, l, b in keys]


def ledger_dicts(records) -> list[dict]:
    """Records as JSON-ready dicts (`levels` as a list)."""
    return [{"phase": r.phase, "op": r.op, "levels": list(r.levels), "bytes": r.bytes,
             "count": r.count} for r in records]
