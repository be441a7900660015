"""Communication ledger — stage: runtime.

Input: the plan row of every collective run (`record_row`: the one place a record is made),
whichever executor runs it — the eager communication interface (eager/comm.py) as it issues a
row, the whole-step mode as each compiled graph runs (its rows: graph/step.py,
graph/boundary.py), the clip rows of both clip entry points (step/clip.py [Note: one
clip]), a norm read on its own (state/norms.py, its row built by the lowering's
`norm_row`): no record is made by hand. Output: `comm_ledger()`, a merged,
sorted `list[LedgerRecord]` (docs/internals.md "Ledger"; merging and order are the
lowering's, shared with `explain`).

[Note: logical records]
A record is the collective the strategy asks for (phase, op, levels, full logical
bytes), before any hierarchical or ho-ring decomposition; `count` merges equal records.
"""
from __future__ import annotations

from collections import Counter

from shardc.lowering import LedgerRecord, Phase, ledger_key, merged

__all__ = ["Ledger", "LedgerRecord"]


class Ledger:
    """Accumulates logical collective records; merged on read."""

    def __init__(self) -> None:
        self._counts: Counter = Counter()

    def record_row(self, row, phase: Phase | None = None) -> None:
        """One run of plan row `row` (`phase` overrides the row's: a backward re-gather that
        reuses the forward row)."""
        self._counts[ledger_key(row, phase)] += 1

    def reset(self) -> None:
        self._counts.clear()

    def records(self) -> list[LedgerRecord]:
        return merged(self._counts)
