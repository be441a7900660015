"""Predicted communication ledger — what `ShardedModule.comm_ledger()` will record.

Input: a Strategy, the model's `UnitSize`s (root first), the number of micro-batches
(forwards and backwards) per optimizer step, and whether `clip_grad_norm_` is called.
Output: `list[LedgerRecord]` for one optimizer step: the rows of the lowered plan
(`shardc.lowering`, which owns the rule table of docs/internals.md "Ledger") times how
often each runs, merged and sorted as the runtime merges what it records.
"""
from __future__ import annotations

from collections import Counter

from shardc.dsl.ir import Strategy
from shardc.lowering import LedgerRecord, Lowering, Over, Per, ledger_key, lower, merged


__all__ = ["LedgerRecord", "predict_ledger", "ledger_of", "ledger_dicts", "counted_rows"]


def counted_rows(plan: Lowering, *, forwards: int, backwards: int, clips: int = 0) -> list[tuple]:
    """`(row, how often it runs per step)` for every row of the plan that runs (the time
    model reads each row's wire dtype, which the merged ledger does not keep)."""
    times = {Per.FORWARD: forwards, Per.BACKWARD: backwards, Per.STEP: 1, Per.CLIP: clips}
    rows = [r for u in plan.units for g in u.groups for r in g.rows] + list(plan.clip_rows)
    return [(r, times[r.per]) for r in rows if times[r.per]]


def ledger_of(plan: Lowering, *, forwards: int, backwards: int, clips: int = 0) -> list[LedgerRecord]:
    """Sum of the plan's rows, each counted per forward / backward / step / clip call."""
    counts: Counter = Counter()
    for r, n in counted_rows(plan, forwards=forwards, backwards=backwards, clips=clips):
        counts[ledger_key(r)] += n
    return merged(counts)


def predict_ledger(strategy: Strategy, units, *, micro_batches: int | None = None,
                   forwards: int | None = None, clip_grad_norm: bool = False) -> list[LedgerRecord]:
    """The ledger of one optimizer step of `strategy` on `units` (UnitSizes, root first).

    `micro_batches` defaults to `strategy.accumulate`; `forwards` (default: one per
    micro-batch) counts extra eval forwards too. `clip_grad_norm` adds the 4-byte
    all-reduce of the squared norm per distinct optimizer level set.
    """
    m = strategy.accumulate if micro_batches is None else micro_batches
    fwd = m if forwards is None else forwards
    return ledger_of(lower(strategy.mesh, units, strategy.prefetch), forwards=fwd, backwards=m, clips=int(clip_grad_norm))


def ledger_dicts(records) -> list[dict]:
    """Records as JSON-ready dicts (`levels` as a list)."""
    return [{"phase": r.phase, "op": r.op, "levels": list(r.levels), "bytes": r.bytes,
             "count": r.count} | ({"over": r.over} if r.over != Over.DENSE.value else {}) for r in records]
