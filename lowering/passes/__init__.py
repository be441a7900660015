"""Plan passes — part of stage 3 (lowering): `Lowering -> Lowering` rewrites of the schedule.

Input: the `Lowering` that `lower` built from the strategy. Output: the same plan with
its `Schedule` optimised; rows, sizes and bytes are never changed by a pass, so the
ledger and memory that `explain` adds up stay the same with any pass on or off.

`PLAN_PASSES` is the one place the passes and their order are listed; `lower(..., passes=)`,
`shardc.compile(..., passes=)`, `explain(..., passes=)` and `shardc compile/explain --passes`
pick a subset by name.
"""
from __future__ import annotations

from shardc.dsl.errors import ShardcError

from .defer_update import defer_update
from .early_sync import early_sync

__all__ = ["PLAN_PASSES", "run_plan_passes", "defer_update", "early_sync", "pass_names", "parse_passes"]

PLAN_PASSES = {"early_sync": early_sync, "defer_update": defer_update}


def pass_names(names) -> tuple[str, ...]:
    """The passes `names` selects (None: all of them), checked, in `PLAN_PASSES` order."""
    if names is None:
        return tuple(PLAN_PASSES)
    names = tuple(names)
    unknown = [n for n in names if n not in PLAN_PASSES]
    if unknown:
        raise ShardcError(f"unknown plan pass {unknown[0]!r}; the passes are: {', '.join(PLAN_PASSES)}")
    return tuple(n for n in PLAN_PASSES if n in names)


def parse_passes(text: str | None) -> tuple[str, ...] | None:
    """`--passes` text ("a,b"; "" for none) as checked names; None (not given) stays None."""
    return None if text is None else pass_names(n.strip() for n in text.split(",") if n.strip())


def run_plan_passes(lowering, names=None):
    for name in pass_names(names):
        lowering = PLAN_PASSES[name](lowering)
    return lowering
