"""Bucket merge — stage: units (the unbucketed unit table -> the bucketed one).

Input: the units as `find_units` found them (root first), their parameter bytes and a
bucket size (decided: the strategy's `bucket` line, or the cost model's
`analysis/costmodel/bucketing.py: bucket_bytes`). Output: the unit table with
consecutive small units merged.

[Note: bucket]
`bucket SIZE` merges consecutive non-root units with equal scopes while their parameter
bytes stay <= SIZE (units of SIZE or more stay alone); `bucket 0` never merges. A merged
unit is named `first..last-suffix` (`transformer.h.0..1`), lists its members'
parameters and modules in order, and keeps their scopes. The rule is `bucket_runs`; the
cost model sizes buckets by the same function (`bucket_bytes` searches the size at
which it leaves enough buckets), so the size it picks is the merge it predicts.
"""
from __future__ import annotations

from shardc.units.spec import UnitSpec

__all__ = ["bucket_runs", "merge"]


def bucket_runs(sizes: list[int], size: int, keys=None) -> list[list[int]]:
    """The greedy merge units are bucketed by, as index runs of `sizes`: consecutive
    entries below `size` with equal `keys` (the units' scopes) while the total stays
    <= `size`; an entry of `size` or more stands alone."""
    keys = [None] * len(sizes) if keys is None else keys
    out, run, total = [], [], 0
    for i, (b, k) in enumerate(zip(sizes, keys)):
        if run and (keys[run[0]] != k or total + b > size):
            out.append(run)
            run, total = [], 0
        if b < size:
            run.append(i)
            total += b
        else:
            out.append([i])
    return out + ([run] if run else [])


def merge(units: list[UnitSpec], nbytes: list[int], size: int) -> list[UnitSpec]:
    """`units` (root first) with consecutive non-root units merged per `bucket_runs`;
    `nbytes[i]` is unit i's parameter bytes."""
    rest = units[1:]
    out = [units[0]]
    for idx in bucket_runs(nbytes[1:], size, [u.scopes for u in rest]):
        run = [rest[i] for i in idx]
        if len(run) == 1:
            out.append(run[0])
        else:
            name = f"{run[0].name}..{run[-1].name.split('.')[-1]}"
            out.append(UnitSpec(name, sum((u.params for u in run), ()), run[0].scopes,
                                sum((u.modules for u in run), ())))
    return out
