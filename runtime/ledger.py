"""Communication ledger — stage: runtime.

Input: one logical record per collective call, made by the communication interface (comm.py),
each carrying the bytes of the plan row it executes. Output: `comm_ledger()`, a merged,
sorted `list[LedgerRecord]` (docs/internals.md "Ledger"; merging and order are the
lowering's, shared with `explain`).

[Note: logical records]
A record is the collective the strategy asks for (phase, op, levels, full logical
bytes), before any hierarchical or ho-ring decomposition; `count` merges equal records.
"""
from __future__ import annotations

from collections import Counter

from shardc.lowering import LedgerRecord, Op, Phase, merged

__all__ = ["Ledger", "LedgerRecord"]


class Ledger:
    """Accumulates logical collective records; merged on read."""

    def __init__(self) -> None:
        self._counts: Counter = Counter()

    def record(self, phase: Phase, op: Op, levels: tuple[str, ...], nbytes: int) -> None:
        self._counts[(Phase(phase).value, Op(op).value, tuple(levels), int(nbytes))] += 1

    def reset(self) -> None:
        self._counts.clear()

    def records(self) -> list[LedgerRecord]:
        return merged(self._counts)
