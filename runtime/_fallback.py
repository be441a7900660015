"""Temporary stand-in for runtime/mesh.py + runtime/collectives.py (flat ring only).

Used only while those modules are missing; same signatures as internals.md.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .layout import coords, mixed_index


class _Work:
    def __init__(self, work, after=None):
        self.work, self.after = work, after

    def wait(self):
        if self.work is not None:
            self.work.wait()
        if self.after is not None:
            self.after()
            self.after = None
        return True


class ShardMesh:
    def __init__(self, mesh, device_type: str = "cpu"):
        self.mesh = mesh
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self._groups = {}
        self._all = [coords(r, mesh) for r in range(self.world)]

    def _members(self, levels, order):
        outside = [n for n in self.mesh.names if n not in levels]
        me = self._all[self.rank]
        ranks = [r for r in range(self.world) if all(self._all[r][n] == me[n] for n in outside)]
        return sorted(ranks, key=lambda r: mixed_index(self._all[r], self.mesh, order))

    def group(self, levels, order=None):
        levels = self.mesh.ordered(levels)
        key = levels
        if key not in self._groups:
            outside = [n for n in self.mesh.names if n not in levels]
            buckets = {}
            for r in range(self.world):
                buckets.setdefault(tuple(self._all[r][n] for n in outside), []).append(r)
            mine, _ = dist.new_subgroups_by_enumeration(sorted(buckets.values()))
            self._groups[key] = mine
        return self._groups[key]

    def index(self, levels, order=None):
        return mixed_index(self._all[self.rank], self.mesh, tuple(order or levels))


def all_gather(out, inp, mesh, levels, order, *, algo=None, comm=None):
    members = mesh._members(levels, order)
    grp = mesh.group(levels)
    s = len(members)
    chunks = out.view(-1).chunk(s)
    by_grank = [None] * s
    for pos, r in enumerate(members):
        by_grank[sorted(members).index(r)] = chunks[pos]
    return _Work(dist.all_gather(by_grank, inp.reshape(-1).contiguous(), group=grp, async_op=True))


def reduce_scatter(out, inp, mesh, levels, order, *, algo=None, comm=None):
    members = mesh._members(levels, order)
    grp = mesh.group(levels)
    tmp = inp.reshape(-1).clone()
    pos = members.index(mesh.rank)
    n = out.numel()
    return _Work(dist.all_reduce(tmp, group=grp, async_op=True),
                 after=lambda: out.view(-1).copy_(tmp[pos * n:(pos + 1) * n]))


def all_reduce(t, mesh, levels, *, algo=None):
    return _Work(dist.all_reduce(t, group=mesh.group(levels), async_op=True))
