"""The compiled step boundary — stage: runtime (the whole-step mode, `backend="inductor"`).

Input: the units (their flat storages and plan rows), the functional collectives
(funcol.py), the ledger, the strategy's accumulate. Output: `GraphBoundary`, the whole-step
mode's `StepBoundary` (the same interface the optimizer, the clip and the state dicts
use): the step's sync — every unit's grad shard reduce-scattered over OS∖G, all-reduced
over the replicas outside OS and divided by the world size — and the update — each OS
chunk written back into the params shard and all-gathered over OS∖P — each one
`torch.compile(fullgraph=True)` graph over every unit.

[Note: the loop decides, the graph syncs at the step]
Every micro-batch's graph reduces its gradients over G (graph_step.py) and autograd adds
them into the grad shard; the rest of the sync runs once, when opt.step() or
clip_grad_norm_ needs it. So any number of micro-batches, `no_sync()` and
`set_requires_gradient_sync(False)` are exact with nothing to fold: the loop's switches
are accepted and change nothing, since no sync is ever issued before the step.
"""
from __future__ import annotations

from shardc.lowering import Op, Phase

from .boundary import StepPhase, check_forward
from .graph_backend import compile_own


class GraphBoundary:
    """The step's state and its compiled sync and update graphs (see Note)."""

    def __init__(self, units, accumulate: int, comm, ledger, world: int, backend):
        self.units, self.comm, self.ledger, self.world = units, comm, ledger, world
        self.accumulate = max(1, accumulate)
        self.phase = StepPhase.FRESH
        self.micro = 0
        self.no_sync_depth = 0
        self.requires_sync: bool | None = None
        self.events: list = []
        self.generation = 0                 # as StepBoundary's
        self.backward_listeners: list = []
        self.forward_checks: list = []     # called before every forward (the parameters have values)
        self._sync = compile_own(self._sync_graph, backend)
        self._update = compile_own(self._update_graph, backend)
        groups = self.trainable_groups()
        self.sync_rows = [r for g in groups for r in g.gplan.rows if r.phase is Phase.SYNC]
        self.update_rows = [r for g in groups for r in g.gplan.rows if r.phase is Phase.UPDATE]

    def set_requires_sync(self, flag: bool) -> None:
        self.requires_sync = bool(flag)

    def enter_no_sync(self) -> None:
        self.no_sync_depth += 1

    def exit_no_sync(self) -> None:
        self.no_sync_depth -= 1

    def trainable_groups(self):
        return [u.trainable for u in self.units if u.trainable is not None]

    def pending_updates(self) -> list[int]:
        return []

    # -- the graphs ------------------------------------------------------------------------
    def _sync_graph(self) -> None:
        for g in self.trainable_groups():
            st, gp = g.storage, g.gplan
            rs, ar = gp.row(Phase.SYNC, Op.REDUCE_SCATTER), gp.row(Phase.SYNC, Op.ALL_REDUCE)
            mine = self.comm.reduce_scatter(rs, st.grad_shard) if rs is not None else st.os_grad
            mine = self.comm.all_reduce(ar, mine)
            st.grad_shard[st.os_in_g:st.os_in_g + st.os_len].copy_(mine / self.world)

    def _update_graph(self) -> None:
        for g in self.trainable_groups():
            st, row = g.storage, g.gplan.row(Phase.UPDATE, Op.ALL_GATHER)
            mine = st.shard[st.os_in_p:st.os_in_p + st.os_len]
            if st.master_separate:
                mine.copy_(st.master)
            if row is not None:
                st.shard.copy_(self.comm.all_gather(row, mine.clone()))

    def _record(self, rows) -> None:
        for r in rows:
            self.ledger.record_row(r)

    # -- the step ------------------------------------------------------------------------
    def check_forward(self, grad_enabled: bool) -> None:
        for check in self.forward_checks:
            check("a forward")
        check_forward(self.phase, grad_enabled)

    def end_backward(self) -> None:
        self.micro += 1
        self.phase = StepPhase.ACCUMULATING
        for listener in self.backward_listeners:
            listener()

    def wait_sync(self, what: str) -> None:
        if self.phase is StepPhase.ACCUMULATING:
            self._sync()
            self._record(self.sync_rows)
            self.phase = StepPhase.SYNCED
            self.generation += 1

    def after_step(self) -> None:
        self._update()
        self._record(self.update_rows)
        self.phase = StepPhase.STEPPED

    def complete_update(self, i: int) -> None:
        return None                  # the update graph waits its gathers (no deferred updates)

    def complete_updates(self) -> None:
        return None

    def zero_grad(self) -> None:
        for g in self.trainable_groups():
            g.storage.zero_now()
        self.micro = 0
        self.generation += 1
        self.phase = StepPhase.FRESH
