"""Communication ledger — stage: runtime.

Input: one logical record per collective call made by the runtime (flat.py, engine.py).
Output: `comm_ledger()`, a merged, sorted `list[LedgerRecord]` (docs/internals.md "Ledger").

[Note: logical records]
A record is the collective the strategy asks for (phase, op, levels, full logical
bytes), before any hierarchical or ho-ring decomposition; `count` merges equal records.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from shardc.dsl.ir import DType

from .quant import payload_bytes

PHASES = ("forward", "backward", "sync", "update")
OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")


@dataclass(frozen=True, slots=True)
class LedgerRecord:
    phase: str
    op: str
    levels: tuple[str, ...]
    bytes: int
    count: int


def payload(numel: int, s: int, comm: DType) -> int:
    """Bytes of one collective over `s` ranks with full logical numel `numel` (internals.md)."""
    return payload_bytes(numel, s, comm)


def elem_bytes(dtype: DType) -> int:
    return dtype.bits // 8


class Ledger:
    """Accumulates logical collective records; merged on read."""

    def __init__(self) -> None:
        self._counts: Counter = Counter()

    def record(self, phase: str, op: str, levels: tuple[str, ...], nbytes: int) -> None:
        assert phase in PHASES and op in OPS, (phase, op)
        self._counts[(phase, op, tuple(levels), int(nbytes))] += 1

    def reset(self) -> None:
        self._counts.clear()

    def records(self) -> list[LedgerRecord]:
        keys = sorted(self._counts, key=lambda k: (PHASES.index(k[0]), k[1], k[2], k[3]))
        return [LedgerRecord(*k, self._counts[k]) for k in keys]
