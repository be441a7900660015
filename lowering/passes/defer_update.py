"""Plan pass `defer_update` — part of stage 3 (lowering): Lowering -> Lowering.

Input: a `Lowering`. Output: the same plan whose `Schedule.update_deferred` lists, in
forward order, every unit with an update all-gather (an UPDATE row: optimizer states
sharded wider than the parameters, e.g. ZeRO-1/2, PaRO-NIG/IIG).

[Note: deferred update]
Without the pass opt.step() issues every unit's update all-gather and waits them all,
so the step ends only when the last one is in. With the pass opt.step() issues them
(same order on every rank; the ledger records them with the step that owes them) and
returns; unit i's is waited right before unit i is next needed: before its gather is
issued or it runs in the next forward (eval forwards included). Whatever reads or
writes the parameters or their shards outside a forward completes all of them first:
opt.step() and clip_grad_norm_ (engine `wait_sync`), state_dict/full_state_dict and
their loads (runtime/module.py). Same rows, same bytes: only the wait point moves.
"""
from __future__ import annotations

from dataclasses import replace

from ..ir import Lowering, Phase


def defer_update(lowering: Lowering) -> Lowering:
    units = tuple(i for i, u in enumerate(lowering.units)
                  if any(g.row(Phase.UPDATE) is not None for g in u.groups if g.trainable))
    return replace(lowering, schedule=replace(lowering.schedule, update_deferred=units))
