"""The step's collectives as compiled graphs — stage: runtime (the whole-step mode, `backend="inductor"`).

Input: the units (their flat storages and plan rows), the functional collectives
(graph/funcol.py), the ledger, the compile backend. Output: `GraphStepOps`, the executor the one
`StepBoundary` (step/boundary.py) runs the step through in the whole-step mode: the step's sync
— every unit's grad shard reduce-scattered over OS∖G, all-reduced over the replicas
outside OS and divided by the world size — and the update — each OS chunk written back
into the params shard and all-gathered over OS∖P — each one `torch.compile(fullgraph=True)`
graph over every unit (the eager executor is eager/step_ops.py).

[Note: the graphs sync at the step]
Every micro-batch's graph reduces its gradients over G (graph/step.py), handed into the
grad shard when its backward is done ([Note: gradient hand-off] there). Under the
`early_sync` pass the backward that ends the step syncs the units with a G row itself
(graph/sync.py [Note: early sync as graphs]); the rest of the sync (every unit's, without
that pass or when the loop turned sync off after choosing that graph) runs as one graph
when the step completes (at opt.step() or clip_grad_norm_, or before a micro-batch that
runs after the loop said the step ended: the boundary then folds it in exactly, as it
does eagerly). No unit's sync is issued here before that (`sync_unit` does nothing: the
boundary's early syncs are the eager executor's); only the sync the last backward's graph
ran (`early_sync`) is overlap that a micro-batch run past the step loses, so the boundary
warns of it when there is one (`overlaps_sync`).

Under the `defer_update` pass the update graph leaves out the units the schedule defers:
opt.step() issues their update all-gathers eagerly and returns, owing them to the next
forward's graph (graph/update.py [Note: deferred updates, issued at the step]).
"""
from __future__ import annotations

from shardc.lowering import Op, Phase

from .backend import compile_own
from .sync import synced_slice
from .update import OwedUpdate


class GraphStepOps:
    """The step's sync and update as compiled graphs over every unit (see Note)."""
    def __init__(self, units, comm, ledger, world: int, backend, early=None, keys=None):
        self.units, self.comm, self.ledger, self.world = units, comm, ledger, world
        self.early_sync = early                  # graph/sync.py `EarlySync`: groups synced in the last backward
        self.keys = keys or {}                   # graph/update.py: deferred unit -> its owed update's key
        self._sync = compile_own(self._sync_graph, backend)
        self._sync_rest = compile_own(self._sync_rest_graph, backend)
        self._update = compile_own(self._update_graph, backend)
        groups = self._groups()
        self.sync_rows = [r for g in groups for r in g.gplan.rows if r.phase is Phase.SYNC]
        self.rest_rows = [r for g in self._rest() for r in g.gplan.rows if r.phase is Phase.SYNC]
        self.update_rows = [r for g in groups for r in g.gplan.rows if r.phase is Phase.UPDATE]

    @property
    def overlaps_sync(self) -> bool:
        """Is some of the step's sync run before the step (by the last backward's graph)?"""
        return self.early_sync is not None

    def _groups(self):
        return [u.trainable for u in self.units if u.trainable is not None]

    def _rest(self):
        """The groups the early sync does not cover (all of them without it)."""
        return [g for g in self._groups() if self.early_sync is None or not self.early_sync.covers(g)]

    # -- the graphs ------------------------------------------------------------------------
    def _sync_graph(self) -> None:
        self._sync_groups(self._groups())

    def _sync_rest_graph(self) -> None:
        self._sync_groups(self._rest())

    def _sync_groups(self, groups) -> None:
        for g in groups:
            st, gp = g.storage, g.gplan
            rs, ar = gp.row(Phase.SYNC, Op.REDUCE_SCATTER), gp.row(Phase.SYNC, Op.ALL_REDUCE)
            if rs is None and ar is None and self.world == 1:
                continue                # one rank: nothing to move, nothing to divide
            lo, n = st.os_in_g, st.os_len                 # complete() materialized the shard
            st.grad_shard[lo:lo + n].copy_(synced_slice(self.comm, rs, ar, self.world, st.grad_shard, lo, n))

    def _now(self):
        """The groups updated at the step (the rest: deferred, see the module docstring)."""
        return [u.trainable for u in self.units if u.trainable is not None and u.index not in self.keys]

    def _update_graph(self) -> None:
        for g in self._now():
            mine, row = g.storage.master_into_shard(), g.gplan.row(Phase.UPDATE, Op.ALL_GATHER)
            if row is not None:
                g.storage.shard.copy_(self.comm.all_gather(row, mine.clone()))

    def _record(self, rows) -> None:
        for r in rows:
            self.ledger.record_row(r)

    # -- what the boundary runs --------------------------------------------------------------
    def sync_unit(self, u, bounded: bool = False) -> None:
        return None                     # the sync graph runs every unit when it completes

    def advance_early(self, group) -> None:
        return None

    def complete(self) -> None:
        for g in self._groups():
            g.storage.materialize()      # a zero_grad() no backward followed: zeros
        if self.early_sync is not None and self.early_sync.take_synced():   # the last backward synced the rest
            if self._rest():
                self._sync_rest()
            self._record(self.rest_rows)
            return
        self._sync()
        self._record(self.sync_rows)

    def update(self) -> list:
        """The update graph; the deferred units' update all-gathers issued: [(unit, OwedUpdate)]."""
        if self._now():
            self._update()
        owed = [(u.index, OwedUpdate(u.trainable, self.keys[u.index])) for u in self.units if u.index in self.keys]
        self._record(self.update_rows)   # the step owes them all, as in the eager runtime
        return owed

    def zero(self) -> None:
        for g in self._groups():
            g.storage.mark_zero()        # no fill: the next hand-off copies (graph/step.py)
        if self.early_sync is not None:
            self.early_sync.take_synced()
