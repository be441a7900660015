"""Flat groups — stage: runtime. The collectives that move one flat group's stored states
(FSDP2's `_fsdp_param_group.py`; the tensors themselves are groups/storage.py's).

Input: a `FlatStorage`, the group's `GroupPlan` (`shardc.lowering`: its rows), a
`UnitCollectives` (eager/comm.py, guarded per unit) and the engine's reduce `Workspace`.
Output: the gather/release of the full buffer, the backward reduce-scatter, the per-step
sync and the update all-gather. Every collective issued is one row of the `GroupPlan`,
passed to the communication interface as such (which records it in the ledger); a group
with no row for a phase issues nothing in it. What is in flight is a NamedTuple.

[Note: reduce and sync]
Each backward reduce-scatters the full local gradient over G into a scratch chunk, added
into the persistent grad shard when the work is waited (end of that backward); both
buffers come from the engine's reduce workspace (runtime/groups/workspace.py) and are handed back
then. With s_G = 1 the gradients go straight into the shard (groups/storage.py). The
once-per-step sync reduce-scatters the grad shard over OS∖G into this rank's OS slice of
the grad shard, all-reduces that slice over the levels outside OS, and divides by the
world size — the only division (DDP semantics).

[Note: byte payloads]
A quantized secondary copy (hpZ int8/int4) is a uint8 payload; it travels as fp32 words
(bit-exact copies), padded to a multiple of four bytes.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import torch

from shardc.dsl.ir import DType
from shardc.lowering import RELEASE_GRADS, GroupPlan, Op, Phase, Row

from ..transport import quant
from ..eager.comm import DoneWork, ThenWork, UnitCollectives
from .storage import FlatStorage
from .transitions import GradState, StateTransitionError, assert_in_states
from .workspace import Workspace, free_bytes


class GatherInFlight(NamedTuple):
    work: object
    phase: Phase


class ReduceInFlight(NamedTuple):
    work: object
    chunk: torch.Tensor | None   # workspace: the reduce-scatter's output (N/s_G); None: the grad shard itself
    flat: torch.Tensor           # its input, the flat local gradient (N)
    pooled: bool                 # `flat` is the workspace's (else the gradient itself)


class SyncStage(enum.Enum):
    REDUCE_SCATTER = "reduce_scatter"      # over OS∖G, into `chunk`
    ALL_REDUCE = "all_reduce"              # the OS slice over the levels outside OS


class SyncInFlight(NamedTuple):
    stage: SyncStage
    work: object
    chunk: torch.Tensor | None


class FlatGroup:
    """One flat group: its storage and the rows that move it (see the module notes)."""

    def __init__(self, storage: FlatStorage, gplan: GroupPlan, comm: UnitCollectives,
                 workspace: Workspace, world: int):
        self.storage, self.gplan, self.comm, self.workspace = storage, gplan, comm, workspace
        self.world = world
        self.trainable = storage.trainable
        self.held = storage.s_p == 1
        self.gathering: GatherInFlight | None = None
        self.reducing: list[ReduceInFlight] = []
        self.syncing: SyncInFlight | None = None
        self._on_grads = self.reduce_slot_grads    # the engine's handler, once routed (`route_grads`)
        self.grad_state = GradState.PENDING        # this backward's gradients (groups/transitions.py)

    def _row(self, phase: Phase, op: Op | None = None) -> Row | None:
        return self.gplan.row(phase, op)

    # -- gather / release ----------------------------------------------------------
    def issue_gather(self, phase: Phase) -> bool:
        """Start filling the full buffer; False if it is already held or in flight."""
        st = self.storage
        if self.held or self.gathering is not None or st.n == 0:
            return False
        st.alloc_full()
        if phase is Phase.BACKWARD and st.secondary is not None:
            work = self._gather_secondary()
        else:
            row = self._row(phase, Op.ALL_GATHER) or self._row(Phase.FORWARD, Op.ALL_GATHER)
            work = self.comm.all_gather(row, st.full_data, st.gather_input(), phase=phase)
        self.gathering = GatherInFlight(work, phase)
        return True

    def wait_gather(self) -> None:
        if self.gathering is None:
            return
        work, phase = self.gathering
        work.wait()
        self.gathering = None
        self.held = True
        if phase is Phase.FORWARD and self.storage.secondary is not None:
            self.storage.keep_secondary()

    def _gather_secondary(self):
        """Backward re-gather over Q from the (possibly quantized) secondary shard."""
        st, row = self.storage, self._row(Phase.BACKWARD, Op.ALL_GATHER)
        if not st.sec_quant:
            return self.comm.all_gather(row, st.full_data, st.secondary)
        m, qd = st.q_len, st.sec_quant
        if row is None:
            quant.dequantize(st.secondary, m, qd, out=st.full_data)
            return DoneWork()
        s_q = st.plan.s(st.plan.q)
        p = st.secondary.numel()                     # see [Note: byte payloads]
        p4 = -(-p // 4) * 4
        send = torch.zeros(p4, dtype=torch.uint8, device=st.secondary.device)
        send[:p] = st.secondary
        got = torch.empty(s_q * p4, dtype=torch.uint8, device=send.device)
        raw = dataclasses.replace(row, comm=DType.FP32)      # already quantized: bytes as words
        work = self.comm.all_gather(raw, got.view(torch.float32), send.view(torch.float32))

        def decode():                                # rows at once (runtime/transport/quant.py)
            rows, payloads = st.full_data.view(s_q, m), got.view(s_q, p4)
            for lo, hi in quant.row_batches(s_q, m, payloads.device):
                quant.dequantize_rows(payloads[lo:hi], m, qd, out=rows[lo:hi])
        return ThenWork(work, decode)

    def release(self) -> bool:
        if self.storage.s_p == 1 or not self.held:
            return False
        self.wait_gather()
        self.storage.free_full()
        self.held = False
        return True

    def views(self) -> list[torch.Tensor]:
        return self.storage.views(self._on_grads)

    # -- the backward's transitions (groups/transitions.py [Note: asserted transitions]) -------------
    def route_grads(self, handler) -> None:
        """Hand the views' gradients to `handler` (the engine's) instead of reducing them here; once."""
        if self._on_grads != self.reduce_slot_grads:
            raise StateTransitionError("a flat group's gradients are routed once (at build)")
        self._on_grads = handler

    @property
    def reduced(self) -> bool:
        return self.grad_state is GradState.REDUCED

    def mark_reduced(self) -> None:
        """This backward's gradients are reduced (again, for a module run twice in a forward)."""
        assert_in_states("a flat group", "mark its gradients reduced", self.grad_state,
                         GradState.PENDING, GradState.REDUCED)
        self.grad_state = GradState.REDUCED

    def end_backward(self) -> None:
        self.grad_state = GradState.PENDING

    # -- gradients -------------------------------------------------------------------
    def reduce_slot_grads(self, grads) -> None:
        """One backward's parameter gradients (slot order, None: no gradient) into the shard."""
        st = self.storage
        if st.s_g == 1:
            st.add_slot_grads(grads)
        elif self.gplan.whole_grad and (whole := st.whole_grad(grads)) is not None:   # the plan's rule
            self.reduce_grad(whole, pooled=False)
        else:
            self.reduce_grad(st.flat_grads(grads, self.workspace))

    def reduce_grad(self, flat: torch.Tensor | None, pooled: bool = True) -> None:
        """Reduce-scatter one backward's full local gradient over G (async). `flat` is a
        workspace tensor of the grad dtype, handed back by `finish_grads` (`pooled=False`:
        a gradient reduce-scattered as it is, storage.whole_grad); None: this backward
        gave the group no gradient (zeros, so every rank issues the same rows)."""
        st = self.storage
        if st.s_g == 1:
            st.materialize()
            if flat is not None:
                st.grad_shard.add_(flat)
                if pooled:
                    self.workspace.give(flat)
            return
        dev = st.grad_device
        if flat is None:
            flat = self.workspace.take(st.n, st.gdtype, dev).zero_()
        # the shard itself when it holds nothing yet (groups/storage.py [Note: reduce into the shard])
        direct = st.reduce_target() if not self.reducing else None
        chunk = direct if direct is not None else self.workspace.take(st.grad_elems, st.gdtype, dev, role="chunk")
        row = self._row(Phase.BACKWARD, Op.ALL_TO_ALL) or self._row(Phase.BACKWARD, Op.REDUCE_SCATTER)
        work = self.comm.reduce_scatter(row, chunk, flat, scratch=self.workspace)
        self.reducing.append(ReduceInFlight(work, None if direct is not None else chunk, flat, pooled))

    def finish_grads(self) -> None:
        """Wait this group's backward reduce-scatters, add them in, hand the scratch back."""
        for work, chunk, flat, pooled in self.reducing:
            work.wait()
            if chunk is not None:               # else it landed in the shard itself
                self.storage.accumulate(chunk)
                self.workspace.give(chunk, role="chunk")
            if pooled:
                self.workspace.give(flat)
        self.reducing.clear()

    # -- the step's sync ---------------------------------------------------------------
    def sync_issue(self) -> None:
        """Stage 1 of the per-step sync: reduce-scatter the grad shard over OS∖G; with no
        such stage (OS = G), stage 2's all-reduce over the replicas is issued right away."""
        self.finish_grads()
        st = self.storage
        st.materialize()
        row = self._row(Phase.SYNC, Op.REDUCE_SCATTER)
        if row is not None:
            chunk = torch.empty(st.os_len, dtype=st.gdtype, device=st.grad_shard.device)
            self.syncing = SyncInFlight(SyncStage.REDUCE_SCATTER,
                                        self.comm.reduce_scatter(row, chunk, st.grad_shard), chunk)
        else:
            self.syncing = SyncInFlight(SyncStage.REDUCE_SCATTER, DoneWork(), None)
            self.sync_advance()        # no reduce-scatter stage: the all-reduce goes out now

    def sync_advance(self) -> None:
        """Stage 2: once the reduce-scatter is in, all-reduce the OS slice over the replicas."""
        if self.syncing is None or self.syncing.stage is not SyncStage.REDUCE_SCATTER:
            return
        work, chunk = self.syncing.work, self.syncing.chunk
        work.wait()
        if chunk is not None:
            self.storage.os_grad.copy_(chunk)
            free_bytes(chunk)                   # now, not when gloo lets it go (workspace.py [Note: bytes freed at once])
        ar = self.comm.all_reduce(self._row(Phase.SYNC, Op.ALL_REDUCE), self.storage.os_grad)
        self.syncing = SyncInFlight(SyncStage.ALL_REDUCE, ar, None)

    def sync_advance_early(self) -> None:
        """Stage 2 ahead of opt.step(), where there is one ([Note: early sync] in
        lowering/passes/early_sync.py): a sync with no all-reduce is left alone, since
        waiting its reduce-scatter here would only stall the backward."""
        if self.syncing is not None and self._row(Phase.SYNC, Op.ALL_REDUCE) is not None:
            self.sync_advance()

    def sync_wait(self) -> None:
        """Finish the sync and divide by the world size (the only division)."""
        if self.syncing is None:
            return
        self.sync_advance()
        self.syncing.work.wait()
        if self.world != 1:
            self.storage.os_grad.div_(self.world)
        self.syncing = None

    def zero_grads(self) -> None:
        self.finish_grads()
        self.storage.mark_zero(release=RELEASE_GRADS)   # zeroed lazily, freed: lowering [Note: gradient lifetimes]
        self.syncing = None

    # -- update ---------------------------------------------------------------------
    def update_issue(self, record: bool = True, out=None):
        """After the optimizer step: write the OS chunk back and all-gather over OS∖P into
        the params shard (or `out`, a buffer shaped like it: the whole-step mode's deferred
        update, graph/update.py). `record=False` (a checkpoint load, the whole-step mode):
        the same gather, left out of the ledger."""
        mine = self.storage.master_into_shard()
        row = self._row(Phase.UPDATE, Op.ALL_GATHER)
        if row is None:
            return DoneWork()
        src = mine.clone()
        work = self.comm.all_gather(row, self.storage.shard if out is None else out, src, record=record)
        return ThenWork(work, lambda: free_bytes(src))    # at the wait ([Note: bytes freed at once])
