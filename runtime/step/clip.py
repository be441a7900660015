"""Gradient clipping — stage: runtime. The one total gradient norm of both entry points.

Input: this rank's partial sums of the gradients' |x|^p, each with the clip levels and
weight of its group's placement (shardc.lowering `Placement`); the plan's clip rows (one
all-reduce of the partial per distinct clip level set); the unit collectives to run them
on; the DTensor (TP) parameters (runtime/state/dtensor_params.py).
Output: the total p-norm, equal to `torch.nn.utils.clip_grad_norm_` on the unsharded
model, and (`clip_grad_norm_`) every OS slice scaled by min(1, max_norm / (norm + 1e-6)).

[Note: one clip]
`sm.clip_grad_norm_` and torch's own `clip_grad_norm_(sm.parameters())` take the same
total: `total_norm` below, over the partials the one adds per flat group (its OS slice)
and the other per parameter (its piece, runtime/state/params.py `PartialNorm`). Either
runs the plan's clip rows and nothing else, so both ledgers equal explain's clip rows:
one all-reduce of one fp32 scalar (`CLIP_BYTES`) per distinct clip level set per call.

[Note: counting each element once]
A rank's OS slice is its share of the data-parallel replicas, so summing over the OS
levels (the clip rows) counts each element of a plain model once. With tensor
parallelism the tp ranks hold different shards of a sharded DTensor parameter but the
same values of everything else (replicated DTensors, plain parameters): each rank adds
the partials of its sharded elements and 1/tp of the others (`tp_weight`), and one
all-reduce over the tp mesh (a TP collective, outside shardc's ledger, like DTensor's
own) sums them. An expert's partial is divided by its placement's clip weight
(shardc.lowering [Note: clip rows of experts]).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def tp_weight(tp: dict, fqn: str) -> float:
    """The share of parameter `fqn`'s partial this rank adds ([Note: counting each element once])."""
    if not tp:
        return 1.0
    info = tp.get(fqn)
    return 1.0 if info is not None and info.sharded else 1.0 / _tp_size(tp)


def _squares(st, tp: dict) -> torch.Tensor:
    """Squared norm of this rank's OS slice, tp-replicated elements weighted 1/tp."""
    g = st.os_grad.float()
    if not tp:
        return g.pow(2).sum()
    total = torch.zeros((), dtype=torch.float32, device=g.device)
    for s, lo, hi in st.layout.ranges(st.os_start, st.os_len):
        if hi > lo:
            part = g[lo:hi].pow(2).sum()
            w = tp_weight(tp, s.fqn)
            total += part if w == 1.0 else part / _tp_size(tp)
    return total                                   # padding: zero gradient, nothing to add


def _tp_size(tp: dict) -> int:
    return next(iter(tp.values())).mesh.size()


def total_norm(parts, clip_rows, comm, tp: dict, p: float, device) -> torch.Tensor:
    """The p-norm (finite p) of every gradient: `parts` are (clip levels, clip weight,
    this rank's partial sum of |x|^p); one clip row's all-reduce per distinct level set,
    then over tp. See [Note: one clip]."""
    rows = {r.levels: r for r in clip_rows}
    by_levels: dict[tuple, torch.Tensor] = {}
    for levels, w, part in parts:
        sq = by_levels.setdefault(levels, torch.zeros(1, dtype=torch.float32, device=device))
        sq += part.float() / w
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for levels, sq in by_levels.items():
        comm.all_reduce(rows.get(levels), sq).wait()
        total += sq
    if tp and _tp_size(tp) > 1:
        dist.all_reduce(total, group=next(iter(tp.values())).mesh.get_group())
    return total[0].sqrt() if p == 2 else total[0].pow(1.0 / p) if p != 0 else total[0]


def clip_grad_norm_(groups, clip_rows, comm, tp: dict, max_norm: float, device) -> torch.Tensor:
    """`sm.clip_grad_norm_`: `groups` are the trainable flat groups, `comm` the collectives
    on the strategy's mesh; each group's squares are one partial of `total_norm`, over its
    placement's clip levels and weight."""
    parts = [(g.gplan.placement.clip_levels, g.gplan.placement.clip_weight, _squares(g.storage, tp))
             for g in groups]
    norm = total_norm(parts, clip_rows, comm, tp, 2.0, device)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in groups:
        g.storage.os_grad.mul_(coef.to(g.storage.os_grad.dtype))
    return norm
