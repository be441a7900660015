"""Bucket size — the cost model's answer to a strategy with no `bucket` line.

Input: a Strategy (its mesh, scopes, prefetch, collectives), the parameter bytes of its
units as unit discovery found them (root first, unbucketed) and a bandwidth model
(default `AlphaBeta()`, as for `collectives auto`). Output: `bucket_bytes`, the size the
unit table merges consecutive units up to (`shardc.units`, units/bucket.py), 0 when fusing
does not pay; `resolve_bucket` writes it into a strategy with no `bucket` line.

[Note: when bucketing pays]
Every unit issues its own collectives (the rows `shardc.lowering` gives a unit under
the strategy's scopes), and each costs t(V) = A + V·B on the α–β model: A the latency
part (FACTOR·(p−1) ring steps of α), B seconds per byte. Fusing k units saves (k−1)·A
per collective and moves the same bytes. Below the crossover V* = A/B a unit's
collective is mostly latency, so the bucket size is V* (the largest over the unit's
rows). What fusing costs is the pipeline: with `prefetch k` the plan keeps k gathers in
flight while one unit computes, and a coarser unit list exposes more of the first
gather and holds bigger buffers. So the size is the largest S <= V* at which the
unit table's merge still leaves at least k + 2 non-root buckets (one computing, k in
flight, one being released), written as the bytes of the largest bucket it makes (the
same merge). When that merges no two units (none below V*, or at most k + 2 units): 0,
no bucketing. The answer depends on the model's
sizes and the bandwidth model only; `bucket 0` in the strategy turns the rule off and
`bucket SIZE` fixes the size.
"""
from __future__ import annotations

from dataclasses import replace

import shardc.algorithms as algorithms
from shardc.dsl.ir import Collectives, Strategy
from shardc.lowering import UnitSize, lower_unit
from shardc.units import bucket_runs, find_units
from shardc.units import unit_bytes as param_bytes

PROBE_BYTES = 1 << 30     # the size the per-byte slope is read at


def crossover_bytes(strategy: Strategy, bandwidth=None) -> int:
    """V*: the message size at which a unit's costliest collective is half latency."""
    from shardc.analysis.costmodel.timing import AlphaBeta
    bw = bandwidth or AlphaBeta()
    mesh = strategy.mesh
    algo = Collectives(algorithms.stand_in(strategy.collectives, algorithms.PROBE))   # [Note: what `auto` means]
    plan = lower_unit(mesh, UnitSize("probe", 1, 0, strategy.scopes))
    best = 0.0
    for g in plan.groups:
        for r in g.rows:
            def t(v):
                return bw.seconds(r.op, r.levels, v, mesh, algo)
            a = t(0.0)
            slope = (t(float(PROBE_BYTES)) - a) / PROBE_BYTES
            if a > 0 and slope > 0:
                best = max(best, a / slope)
    return int(best)


def _buckets(sizes: list[int], size: int) -> list[int]:
    """The bucket totals the unit table's merge (`bucket_runs`) makes of `sizes`."""
    return [sum(sizes[i] for i in run) for run in bucket_runs(sizes, size)]


def bucket_bytes(strategy: Strategy, unit_bytes: list[int], bandwidth=None) -> int:
    """The bucket size for `strategy` over units of `unit_bytes` (root first); 0: none.
    The largest size <= V* that leaves at least prefetch + 2 buckets, reported as its
    largest bucket's bytes (the same merge, a tight figure); 0 when that merges nothing."""
    rest = [b for b in unit_bytes[1:] if b > 0]
    keep = max(0, strategy.prefetch) + 2
    v = crossover_bytes(replace(strategy, bucket=None), bandwidth)
    if len(rest) <= keep or v <= 0:
        return 0
    lo, hi = 0, v                      # the bucket count falls as the size grows
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(_buckets(rest, mid)) >= keep else (lo, mid - 1)
    buckets = _buckets(rest, lo) if lo else rest
    return max(buckets) if len(buckets) < len(rest) else 0


def resolve_bucket(model, strategy: Strategy, bandwidth=None) -> Strategy:
    """`strategy` with its bucket size decided: no `bucket` line (None) -> `bucket_bytes`
    over this model's unbucketed units, 0 when bucketing does not pay (see Note)."""
    if strategy.bucket is not None:
        return strategy
    units = find_units(model, replace(strategy, bucket=0))
    return replace(strategy, bucket=bucket_bytes(strategy, param_bytes(model, units), bandwidth))
