"""The step's sync inside the backward that ends the step — stage: runtime (the whole-step
mode, `backend="inductor"`, under the `early_sync` plan pass).

Input: the units (their trainable flat groups and plan rows), the plan's `Schedule`, the
functional collectives (graph/funcol.py), the world size. Output: `EarlySync`: for each group
that reduce-scatters its gradient in the backward (a G row), a gather function whose
backward also runs the group's sync rows, and the anchors and flags that carry the
result out; `EarlySync.hand_off` writes it where the eager runtime's sync writes it.

[Note: early sync as graphs]
The eager runtime issues unit i's sync as soon as unit i's reduce-scatter is in, on the
backward that ends the step (lowering/passes/early_sync.py). The whole-step mode compiles
that backward as its own graph (graph/step.py, `_compiled_sync`): each such group's gather
function, in its backward, reduce-scatters the gradient over G as always (returned as the
grad anchor's gradient), adds it to what the grad shard holds (`acc`, where `keep`: the
shard is not stale), reduce-scatters that over OS∖G, all-reduces the OS slice over the
replicas and divides it by the world size: the synced OS slice, returned as the gradient
of a second anchor (`sync_anchor`). The graph backend keeps each reduce-scatter's wait
one chain later (graph/backend.py [Note: one reduce-scatter in flight]), so a unit's sync
overlaps the next units' backward, as in the eager runtime. When the backward is done,
the G chunk goes into the grad shard as always (graph/step.py [Note: gradient hand-off])
and the synced slice over the shard's OS slice; the step boundary's sync then runs the
step graph only for the groups left (those with no G row: their gradients are whole, the
sync is all of their communication, graph/boundary.py). The choice is made when the
forward runs, by the boundary's own rule (`StepBoundary.backward_ends_step`); should the
loop change its mind before the backward ends (it turns gradient sync off in between),
the synced slice is dropped and the step's sync runs at the step, exactly, as it would
have: the collectives ran on every rank alike, so nothing is out of step. Same rows, same
bytes, same order per process group on every rank; the ledger records them when they run.
"""
from __future__ import annotations

import torch

from shardc.lowering import Op, Phase

from .step import gathered


def synced_slice(comm, rs_row, ar_row, world: int, grad, lo: int, n: int):
    """One group's step sync of its whole grad shard `grad`: reduce-scattered over OS∖G
    (or, with no such row, its OS slice [lo, lo + n) taken), all-reduced over the replicas
    outside OS, divided by the world size (the only division). The step's sync graph
    (graph/boundary.py) and the early sync below both run it."""
    mine = comm.reduce_scatter(rs_row, grad) if rs_row is not None else grad[lo:lo + n]
    return comm.all_reduce(ar_row, mine) / world


def sync_gather_function(comm, gather_row, reduce_row, rs_row, ar_row, world: int, lo: int, n: int):
    """Like graph_step.gather_function, whose backward also syncs (see Note): `lo`, `n` the
    OS slice within the grad shard."""

    class GatherSync(torch.autograd.Function):
        @staticmethod
        def forward(ctx, shard, anchor, sync_anchor, acc, keep):
            ctx.save_for_backward(acc, keep)
            return gathered(comm, gather_row, shard)

        @staticmethod
        def backward(ctx, grad):
            acc, keep = ctx.saved_tensors
            chunk = comm.reduce_scatter(reduce_row, grad.contiguous())
            total = torch.where(keep, acc, torch.zeros_like(acc)) + chunk
            return None, chunk, synced_slice(comm, rs_row, ar_row, world, total, lo, n), None, None

    return GatherSync


class EarlySync:
    """The early sync of the groups with a G row, as part of the step's last backward."""

    def __init__(self, units, schedule, comm, world: int):
        self.functions, self.anchors, self.keeps, self.rows = {}, {}, {}, []
        self.synced = False                  # this step's sync of these groups ran in a backward
        planned = set(schedule.sync_early)
        for u in units:
            g = u.trainable
            if g is None or u.index not in planned:
                continue
            gp, st = g.gplan, g.storage
            reduce = gp.row(Phase.BACKWARD, Op.ALL_TO_ALL) or gp.row(Phase.BACKWARD, Op.REDUCE_SCATTER)
            if reduce is None:
                continue
            rs, ar = gp.row(Phase.SYNC, Op.REDUCE_SCATTER), gp.row(Phase.SYNC, Op.ALL_REDUCE)
            self.functions[id(g)] = sync_gather_function(comm, gp.row(Phase.FORWARD, Op.ALL_GATHER), reduce,
                                                         rs, ar, world, st.os_in_g, st.os_len)
            self.anchors[id(g)] = torch.nn.Parameter(st.grad_shard.new_zeros(1).expand(st.os_len))
            self.keeps[id(g)] = torch.zeros((), dtype=torch.bool, device=st.grad_shard.device)
            self.rows += [r for r in (rs, ar) if r is not None]

    def take_synced(self) -> bool:
        """Did a backward sync these groups this step? (and forget it: the step takes it)"""
        synced, self.synced = self.synced, False
        return synced

    def covers(self, g) -> bool:
        return id(g) in self.functions

    def prepare(self, groups) -> None:
        """When the sync graph's backward starts (after the boundary folded a finished
        step's sync, which leaves the shards stale): which grad shards hold gradients for
        the graph to add to."""
        for g in groups:               # through `.data`: its own version counter, so the
            if self.covers(g):         # graph's saved `keep` passes autograd's check
                self.keeps[id(g)].data.fill_(not g.storage.stale)

    def hand_off(self, g, due: bool) -> None:
        """After the G chunk went into the shard: the synced OS slice over it, when the
        step's sync is still due (else dropped: see Note)."""
        anchor = self.anchors[id(g)]
        if due and anchor.grad is not None:
            g.storage.os_grad.copy_(anchor.grad)
            self.synced = True
        anchor.grad = None
