"""The tensors opt.step() steps on each rank — stage: analysis (cost model). A `Lowering`
-> the optimizer's pieces per rank, in the order it steps them, for the per-tensor loop's
temporaries (timeline.py [Note: timeline: optimizer step]).

Input: the plan (each trainable group's `tensors`: its parameters as (index in the model's
parameter order, elements), in layout order, and its padded size) and the optimizer with
its kwargs and device. Output: `step_bytes`, lowering/optimizers.py `step_temporary_bytes`
for the implementation torch runs there: for the per-tensor loop the largest over the ranks
of it for that rank's pieces (foreach and fused read only the stepped bytes).

[Note: a rank's pieces in step order]
An optimizer over a ShardedModule steps its parameters in the model's order
(`ShardedModule.parameters()`), each as the rank's piece of it: the part of the parameter's
slot in its flat group (parameters packed from offset 0 in unit order, the padding at the
end: runtime/groups/layout.py) inside the rank's OS chunk (lowering/layout.py `RankPlan`),
fp32; a parameter with no element on the rank is stepped too, as an empty piece (its empty
`denom` ends the previous one's). The loop's temporaries read consecutive pieces (the
previous one's `denom` is still bound while the next one's is made), so a rank's figure
needs its pieces in that order (measured on 8 gloo ranks, HF GPT-2 under zero3: each
block's c_fc piece is a whole chunk, and an empty piece comes between two of them): a
group whose parameters the plan does not know (sizes given without a model; an expert
group) counts as one piece of its whole chunk, after the others (a bound). Ranks whose
chunks start at the same offsets in every group step the same pieces: each such set is
walked once.
"""
from __future__ import annotations

from shardc.lowering import Lowering, RankPlan
from shardc.lowering.optimizers import step_impl, step_temporary_bytes

BYTES = 4                       # the optimizer steps fp32 pieces (the master where params are not fp32)


def _starts(plan: Lowering, groups: list) -> list[tuple[int, ...]]:
    """Each distinct tuple of the ranks' OS chunk starts over `groups` (one per rank set)."""
    world = max((g.placement.mesh.world for g in groups), default=1)
    plans: dict = {}
    out = set()
    for r in range(world):
        key = []
        for g in groups:
            pl = g.placement
            rp = plans.get((id(pl), r))
            if rp is None:
                rp = plans[id(pl), r] = RankPlan(pl.mesh, pl.scopes, r % pl.mesh.world)
            key.append(rp.chunk("optim", g.n)[0])
        out.add(tuple(key))
    return sorted(out)


def pieces(groups: list, starts: tuple[int, ...]) -> list[int]:
    """One rank's stepped tensors' bytes in step order ([Note: a rank's pieces in step order])."""
    known, unknown = [], []
    for g, start in zip(groups, starts):
        if not g.tensors:
            unknown.append(g.optim_elems * BYTES)
            continue
        end, off = start + g.optim_elems, 0
        for idx, n in g.tensors:
            lo, hi = max(start, off), min(end, off + n)
            known.append((idx, max(hi - lo, 0) * BYTES))     # an empty piece is stepped too
            off += n
    return [b for _, b in sorted(known)] + unknown


def step_bytes(plan: Lowering, optimizer: str, kw: dict | None, stepped: int, device: str) -> int:
    """The optimizer's step temporaries on its worst rank: `step_temporary_bytes` over each
    rank set's pieces where torch runs the per-tensor loop, else over `stepped` alone."""
    groups = [g for u in plan.units for g in u.groups if g.trainable]
    if step_impl(kw, device) != "loop" or not groups:
        return step_temporary_bytes(optimizer, kw, stepped, (), device)
    return max(step_temporary_bytes(optimizer, kw, stepped, pieces(groups, s), device) for s in _starts(plan, groups))
