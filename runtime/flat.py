"""Flat groups — stage: runtime. The sharded storage of one unit's parameters.

Input: a `GroupLayout` (parameter offsets in a padded flat buffer), the group's
`GroupPlan` and the unit's `RankPlan` (from `shardc.lowering`), the full initial values
(identical on every rank), a `Comm`.
Output: the persistent shards (params N/s_P, optional secondary N/s_Q, grads N/s_G),
the transient full buffer the module's parameters are views of while gathered, and the
per-step collectives. Every collective issued is one row of the `GroupPlan` (its
levels, digit order, payload bytes and wire dtype), recorded in the ledger as such;
a group with no row for a phase issues nothing in it.

[Note: full buffer and autograd]
The trainable full buffer is one leaf `nn.Parameter` of N elements; the module's
parameters are views of it made by one autograd function (`_Views`, one node per unit
and forward), whose backward runs once the unit's parameter gradients are all in and
hands them to `on_grads` (the engine): no N-element concatenation, no `.grad` on the
leaf. With s_G = 1 each gradient is added straight into its slice of the grad shard;
otherwise they are copied into one N-element buffer that is reduce-scattered, taken from
the engine's reduce workspace (runtime/workspace.py) with the chunk it lands in, and
handed back when the reduce-scatter is waited. The slot sizes and shapes the views are
cut by are computed once; a frozen group's views are made once (its buffer's storage is
refilled in place, so they stay views of the gathered values).
Between uses the full buffer's storage is resized
to 0 (FSDP2's trick), so tensors autograd saved in the forward stay valid when the
backward re-gather refills the same storage. Collectives write through `full_data`
(`full.data`, which has its own version counter), so refilling never trips autograd's
in-place checks.

[Note: grad accumulation]
Each backward reduce-scatters the full local gradient over G into a scratch chunk,
added into the persistent grad shard when the work is waited (end of that backward).
With s_G = 1 the gradients are added into the shard's slot views (made once) by one
`torch._foreach_add_`. zero_grad() does not write the shard: it marks it `stale`
(logically zero), and the first backward's gradients are copied in (instead of added
to zeros); whatever reads the shard before a backward wrote it (`os_grad`, the sync, a
backward that gave the group no gradient) zeroes it first.
The once-per-step sync reduce-scatters the grad shard over OS∖G into this rank's OS
slice of the grad shard, all-reduces that slice over the levels outside OS, and
divides by the world size — the only division (DDP semantics).
"""
from __future__ import annotations

import torch
from torch import nn

from shardc.dsl.ir import DType
from shardc.lowering import GroupPlan, Op, Phase, RankPlan, Row

from . import quant
from .comm import Comm, DoneWork, ThenWork
from .layout import GroupLayout
from .workspace import Workspace

TORCH_DTYPE = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    need = t.numel() * t.element_size()
    if t.untyped_storage().size() != need:
        t.untyped_storage().resize_(need)


class FlatGroup:
    def __init__(self, layout: GroupLayout, gplan: GroupPlan, plan: RankPlan, comm: Comm,
                 init: torch.Tensor, is_root: bool, workspace: Workspace | None = None):
        self.layout, self.gplan, self.plan, self.comm, self.is_root = layout, gplan, plan, comm, is_root
        self.workspace = workspace if workspace is not None else Workspace()
        self._sizes = layout.split_sizes                     # made once (see Note)
        self._shapes = tuple(s.shape for s in layout.slots)
        self._stable_views: list[torch.Tensor] | None = None
        sc = plan.scopes
        self.n = n = layout.n
        self.trainable = layout.trainable
        self.pdtype = TORCH_DTYPE[sc.params.dtype]
        self.gdtype = TORCH_DTYPE[sc.grads.dtype]
        self.s_p, self.s_g, self.s_os = plan.s(plan.p), plan.s(plan.g), plan.s(plan.os)
        self.p_start, self.p_len = plan.chunk("params", n)
        full = torch.empty(n, dtype=self.pdtype, device=init.device)
        self.full = nn.Parameter(full) if self.trainable else full
        self.full_data = self.full.data            # own version counter (see Note)
        if self.s_p == 1:
            self.full_data.copy_(init)
            self.shard = self.full_data
        else:
            self.shard = init[self.p_start:self.p_start + self.p_len].to(self.pdtype).clone()
            _free(self.full_data)
        self.held = self.s_p == 1
        self.pending = None                        # (work, phase)
        self.secondary = None
        if sc.params.secondary is not None and not is_root:
            self.q_start, self.q_len = plan.secondary_chunk(n)
            self.sec_quant = sc.params.secondary.quant
            if self.sec_quant:
                nb = quant.shard_payload_bytes(self.q_len, self.sec_quant)
                self.secondary = torch.zeros(nb, dtype=torch.uint8, device=init.device)
            else:
                self.secondary = torch.zeros(self.q_len, dtype=self.pdtype, device=init.device)
        self.grad_pending: list = []
        self.on_grads = self.reduce_slot_grads     # the engine's handler replaces it
        if self.trainable:
            self._init_grads(init)

    def _init_grads(self, init: torch.Tensor) -> None:
        plan, n = self.plan, self.n
        g_start, g_len = plan.chunk("grads", n)
        self.os_start, self.os_len = plan.chunk("optim", n)
        self.grad_shard = torch.zeros(g_len, dtype=self.gdtype, device=init.device)
        self.stale = False                 # zero_grad() ran and no backward wrote the shard yet
        self._gviews = self._plain_views(self.grad_shard) if self.s_g == 1 else None
        self.os_in_g = self.os_start - g_start
        self.os_in_p = self.os_start - self.p_start
        self.sync_state = None
        if self.pdtype == torch.float32:
            self.master = self.shard[self.os_in_p:self.os_in_p + self.os_len]
            self.master_separate = False
        else:
            self.master = init[self.os_start:self.os_start + self.os_len].float().clone()
            self.master_separate = True

    # -- gather / release ----------------------------------------------------------
    def issue_gather(self, phase: str) -> bool:
        """Start filling the full buffer; False if it is already held or in flight."""
        if self.held or self.pending is not None or self.n == 0:
            return False
        _alloc(self.full_data)
        if phase == "backward" and self.secondary is not None:
            work = self._gather_secondary()
        else:
            row = self._row(Phase(phase), Op.ALL_GATHER) or self._row(Phase.FORWARD, Op.ALL_GATHER)
            work = self._issue(row, self.comm.all_gather, self.full_data, self.shard, phase=phase)
        self.pending = (work, phase)
        return True

    def _row(self, phase: Phase, op: Op | None = None) -> Row | None:
        return self.gplan.row(phase, op)

    def _issue(self, row: Row | None, collective, out, inp, phase: str | None = None, **kw):
        """Run `row` (a plan row) as `collective`; no row: the group's factor is 1, copy locally."""
        if row is None:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp.reshape(out.shape))
            return DoneWork()
        return collective(phase or row.phase.value, out, inp, row.levels, row.order, row.bytes,
                          comm=row.comm, **kw)

    def wait_gather(self) -> None:
        if self.pending is None:
            return
        work, phase = self.pending
        work.wait()
        self.pending = None
        self.held = True
        if phase == "forward" and self.secondary is not None:
            mine = self.full_data[self.q_start:self.q_start + self.q_len]
            if self.sec_quant:
                quant.quantize(mine, self.sec_quant, out=self.secondary)
            else:
                self.secondary.copy_(mine)

    def _gather_secondary(self):
        """Backward re-gather over Q from the (possibly quantized) secondary shard."""
        row, s_q = self._row(Phase.BACKWARD, Op.ALL_GATHER), self.plan.s(self.plan.q)
        if not self.sec_quant:
            return self._issue(row, self.comm.all_gather, self.full_data, self.secondary)
        m, qd = self.q_len, self.sec_quant
        if row is None:
            quant.dequantize(self.secondary, m, qd, out=self.full_data)
            return DoneWork()
        # [Note: byte payloads] the uint8 payload travels as fp32 words (bit-exact copies).
        p = self.secondary.numel()
        p4 = -(-p // 4) * 4
        send = torch.zeros(p4, dtype=torch.uint8, device=self.secondary.device)
        send[:p] = self.secondary
        got = torch.empty(s_q * p4, dtype=torch.uint8, device=send.device)
        work = self.comm.all_gather("backward", got.view(torch.float32), send.view(torch.float32),
                                    row.levels, row.order, row.bytes)

        def decode():
            for c in range(s_q):
                quant.dequantize(got[c * p4:c * p4 + p], m, qd, out=self.full_data[c * m:(c + 1) * m])
        return ThenWork(work, decode)

    def release(self) -> bool:
        if self.s_p == 1 or not self.held:
            return False
        self.wait_gather()
        _free(self.full_data)
        self.held = False
        return True

    def views(self) -> list[torch.Tensor]:
        """The parameters as views of the full buffer (autograd-tracked when trainable)."""
        if self.trainable and self.n:
            return _Views.apply(self.full, self)
        if self._stable_views is None:            # frozen: `full` is a plain tensor (see Note)
            self._stable_views = self._plain_views(self.full)
        return self._stable_views

    def _plain_views(self, base: torch.Tensor) -> list[torch.Tensor]:
        if not self.n:
            return []
        return [p.view(shape) for p, shape in zip(base.split_with_sizes(self._sizes), self._shapes)]

    # -- gradients -------------------------------------------------------------------
    def reduce_slot_grads(self, grads) -> None:
        """One backward's parameter gradients (slot order, None: no gradient) into the shard."""
        if self.s_g == 1:
            dst = [v for v, g in zip(self._gviews, grads) if g is not None]
            src = [g for g in grads if g is not None]
            if self.stale:                     # see [Note: grad accumulation]
                for v, g in zip(self._gviews, grads):
                    if g is None:
                        v.zero_()
                self.grad_shard[self.layout.phi:].zero_()
                if dst:
                    torch._foreach_copy_(dst, src)
                self.stale = False
            elif dst:
                torch._foreach_add_(dst, src)
            return
        flat = self.workspace.take(self.n, self.gdtype, self.grad_shard.device)
        dst, src = [], []
        for piece, g in zip(self._plain_views(flat), grads):
            if g is None:
                piece.zero_()
            else:
                dst.append(piece)
                src.append(g)
        if dst:
            torch._foreach_copy_(dst, src)
        flat[self.layout.phi:].zero_()
        self.reduce_grad(flat)

    def reduce_grad(self, grad: torch.Tensor | None) -> None:
        """Reduce-scatter one backward's full local gradient over G (async). `grad` is a
        workspace tensor of the grad dtype, handed back by `finish_grads`; None: this
        backward gave the group no gradient (zeros, so every rank issues the same rows)."""
        if self.s_g == 1:
            self.materialize()
            if grad is not None:
                self.grad_shard.add_(grad)
                self.workspace.give(grad)
            return
        dev = self.grad_shard.device
        if grad is None:
            grad = self.workspace.take(self.n, self.gdtype, dev).zero_()
        tmp = self.workspace.take(self.grad_shard.numel(), self.gdtype, dev)
        row = self._row(Phase.BACKWARD, Op.ALL_TO_ALL) or self._row(Phase.BACKWARD, Op.REDUCE_SCATTER)
        work = self._issue(row, self.comm.reduce_scatter, tmp, grad, scratch=self.workspace)
        self.grad_pending.append((work, tmp, grad))

    def finish_grads(self) -> None:
        """Wait this group's backward reduce-scatters, add them in, hand the scratch back."""
        for work, tmp, grad in self.grad_pending:
            work.wait()
            if self.stale:
                self.grad_shard.copy_(tmp)
                self.stale = False
            else:
                self.grad_shard.add_(tmp)
            self.workspace.give(tmp)
            self.workspace.give(grad)
        self.grad_pending.clear()

    def materialize(self) -> None:
        """A stale grad shard (zero_grad() ran, no backward wrote it) becomes zeros."""
        if self.stale:
            self.grad_shard.zero_()
            self.stale = False

    @property
    def os_grad(self) -> torch.Tensor:
        self.materialize()
        return self.grad_shard[self.os_in_g:self.os_in_g + self.os_len]

    def sync_issue(self) -> None:
        """Stage 1 of the per-step sync: reduce-scatter the grad shard over OS∖G; with no
        such stage (OS = G), stage 2's all-reduce over the replicas is issued right away."""
        self.finish_grads()
        self.materialize()
        row = self._row(Phase.SYNC, Op.REDUCE_SCATTER)
        if row is not None:
            tmp = torch.empty(self.os_len, dtype=self.gdtype, device=self.grad_shard.device)
            self.sync_state = ("rs", self._issue(row, self.comm.reduce_scatter, tmp, self.grad_shard), tmp)
        else:
            self.sync_state = ("rs", DoneWork(), None)
            self.sync_advance()        # no reduce-scatter stage: the all-reduce goes out now

    def sync_advance(self) -> None:
        """Stage 2: once the reduce-scatter is in, all-reduce the OS slice over the replicas."""
        if self.sync_state is None or self.sync_state[0] != "rs":
            return
        _, work, tmp = self.sync_state
        work.wait()
        if tmp is not None:
            self.os_grad.copy_(tmp)
        row = self._row(Phase.SYNC, Op.ALL_REDUCE)
        ar = DoneWork() if row is None else self.comm.all_reduce("sync", self.os_grad, row.levels, row.bytes)
        self.sync_state = ("ar", ar, None)

    def sync_advance_early(self) -> None:
        """Stage 2 ahead of opt.step(), where there is one ([Note: early sync]): a sync
        with no all-reduce is left alone, since waiting its reduce-scatter here would only
        stall the backward."""
        if self.sync_state is not None and self._row(Phase.SYNC, Op.ALL_REDUCE) is not None:
            self.sync_advance()

    def sync_wait(self) -> None:
        """Finish the sync and divide by the world size (the only division)."""
        if self.sync_state is None:
            return
        self.sync_advance()
        self.sync_state[1].wait()
        if self.plan.mesh.world != 1:
            self.os_grad.div_(self.plan.mesh.world)
        self.sync_state = None

    def zero_grads(self) -> None:
        self.finish_grads()
        self.stale = True                      # zeroed lazily, see [Note: grad accumulation]
        self.sync_state = None

    # -- update ---------------------------------------------------------------------
    def update_issue(self, record: bool = True):
        """After the optimizer step: write the OS chunk back and all-gather over OS∖P.
        `record=False` (a checkpoint load): the same gather, left out of the ledger."""
        mine = self.shard[self.os_in_p:self.os_in_p + self.os_len]
        if self.master_separate:
            mine.copy_(self.master)
        row = self._row(Phase.UPDATE, Op.ALL_GATHER)
        if row is None:
            return DoneWork()
        if not record:
            c = self.comm
            return c.C.all_gather(self.shard, mine.clone(), c.smesh, row.levels, row.order, algo=c.algo,
                                  comm=row.comm)
        return self._issue(row, self.comm.all_gather, self.shard, mine.clone())


class _Views(torch.autograd.Function):
    """The parameters of a trainable group as views of its full buffer (see Note)."""

    @staticmethod
    def forward(ctx, full, group):
        ctx.group = group
        # views of the leaf's version counter, which refills through `full_data` never bump
        return tuple(group._plain_views(full.detach()))

    @staticmethod
    def backward(ctx, *grads):
        ctx.group.on_grads(grads)
        return None, None
