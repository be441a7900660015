"""Gradient clipping — stage: runtime. `clip_grad_norm_` over every shard, DP and TP.

Input: the step's trainable flat groups (their OS slices of the synced gradient), the
plan's clip rows (one all-reduce of the squared norm per distinct OS level set), the
unit collectives to run them on, and the DTensor parameters (runtime/state/dtensor_params.py).
Output: the total 2-norm, equal to `torch.nn.utils.clip_grad_norm_` on the unsharded model;
every OS slice scaled by min(1, max_norm / (norm + 1e-6)).

[Note: counting each element once]
A rank's OS slice is its share of the data-parallel replicas, so summing squares over the
OS levels (the clip rows) counts each element of a plain model once. With tensor
parallelism the tp ranks hold different shards of a sharded DTensor parameter but the
same values of everything else (replicated DTensors, plain parameters): each rank adds
the squares of its sharded elements and 1/tp of the others, and one all-reduce over the
tp mesh (a TP collective, outside shardc's ledger, like DTensor's own) sums them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _squares(st, tp: dict) -> torch.Tensor:
    """Squared norm of this rank's OS slice, tp-replicated elements weighted 1/tp."""
    g = st.os_grad.float()
    if not tp:
        return g.pow(2).sum()
    total = torch.zeros((), dtype=torch.float32, device=g.device)
    for s, lo, hi in st.layout.ranges(st.os_start, st.os_len):
        if hi > lo:
            part = g[lo:hi].pow(2).sum()
            info = tp.get(s.fqn)
            total += part if info is not None and info.sharded else part / _tp_size(tp)
    return total                                   # padding: zero gradient, nothing to add


def _tp_size(tp: dict) -> int:
    return next(iter(tp.values())).mesh.size()


def clip_grad_norm_(groups, clip_rows, comm, tp: dict, max_norm: float, device) -> torch.Tensor:
    """See the module note; `groups` are the trainable flat groups, `comm` the collectives on
    the strategy's mesh; a group's squares are added over its placement's clip levels,
    weighted by its clip weight (shardc.lowering `Placement`, [Note: clip rows of experts])."""
    rows = {r.levels: r for r in clip_rows}
    by_levels: dict[tuple, list] = {}
    for g in groups:
        pl = g.gplan.placement
        by_levels.setdefault(pl.clip_levels, []).append((g.storage, pl.clip_weight))
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for levels, storages in by_levels.items():
        sq = torch.zeros(1, dtype=torch.float32, device=device)
        for st, w in storages:
            sq += _squares(st, tp) / w
        comm.all_reduce(rows.get(levels), sq).wait()
        total += sq
    if tp and _tp_size(tp) > 1:
        dist.all_reduce(total, group=next(iter(tp.values())).mesh.get_group())
    norm = total[0].sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in groups:
        g.storage.os_grad.mul_(coef.to(g.storage.os_grad.dtype))
    return norm
