"""Plan pass `early_sync` — part of stage 3 (lowering): Lowering -> Lowering.

Input: a `Lowering`. Output: the same plan whose `Schedule.sync_early` lists every unit
with trainable parameters, in backward order (the root last).

[Note: early sync]
Without the pass the step's sync (reduce-scatter of the grad shard over OS∖G, then the
all-reduce over the replicas) of every unit is issued together by the callback that ends
the step's last backward, so all of it waits for the whole backward. With the pass the
engine issues unit i's sync as soon as unit i's backward reduce-scatter is waited — when
the next unit's reduce-scatter is issued (one in flight, runtime/eager/engine.py) — so it overlaps the
rest of the backward. Issuing a sync issues its first stage: the reduce-scatter over
OS∖G, or, for a unit with none (OS = G), the all-reduce over the replicas (runtime/groups/flat_group.py
`sync_issue`); an all-reduce that follows a reduce-scatter goes out when the next unit's
sync is issued (its reduce-scatter has had that unit's backward to land), the last ones
at opt.step(). Only the backward the step's sync was planned for does this (the
engine decides at its start by the same rule as at its end, runtime/eager/engine.py "accumulation");
a unit whose reduce-scatter is the backward's last, or that got no gradient, is synced
at the end as before. Same rows, same bytes, same order per process group on every
rank: only the issue point moves.
"""
from __future__ import annotations

from dataclasses import replace

from ..ir import Lowering


def early_sync(lowering: Lowering) -> Lowering:
    return replace(lowering, schedule=replace(lowering.schedule, sync_early=lowering.backward_order()))
