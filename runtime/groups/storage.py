"""Flat storage — stage: runtime. The stored states of one flat group (FSDP2's `_fsdp_param.py`).

Input: a `GroupLayout` (parameter offsets in a padded flat buffer), the unit's `RankPlan`
(`shardc.lowering`: factors and this rank's chunks) and the device.
Output: `FlatStorage`: the persistent shards, allocated empty and then given their values by
the builder (runtime/build.py: `write_param` for one parameter's whole value, `write_chunk`
for this rank's params chunk), never from an N-element copy of the unit (params N/s_P, the optional secondary copy
N/s_Q, grads N/s_G, the fp32 master of the OS chunk), the transient full buffer the
module's parameters are views of while gathered, and the local arithmetic on them. It
communicates nothing: the collectives that move these tensors are groups/flat_group.py's.

[Note: full buffer and autograd]
The trainable full buffer is one leaf `nn.Parameter` of N elements; the module's
parameters are views of it made by one autograd function (`_Views`, one node per unit
and forward), whose backward runs once the unit's parameter gradients are all in and
hands them to the callback given to `views` (the engine's): no N-element concatenation, no
`.grad` on the leaf. The slot sizes and shapes the views are cut by are computed once; a
frozen group's views are made once (its buffer's storage is refilled in place, so they
stay views of the gathered values). Between uses the full buffer's storage is resized
to 0 (FSDP2's trick), so tensors autograd saved in the forward stay valid when the
backward re-gather refills the same storage. Collectives write through `full_data`
(`full.data`, which has its own version counter), so refilling never trips autograd's
in-place checks.

[Note: grad accumulation]
zero_grad() does not write the grad shard: it marks it `stale` (logically zero), and the
first backward's gradients are copied in (instead of added to zeros); whatever reads the
shard before a backward wrote it (`os_grad`, the sync, a backward that gave the group no
gradient) zeroes it first (`materialize`). With s_G = 1 the gradients are added into the
shard's slot views (made once) by one `torch._foreach_add_` (`add_slot_grads`); otherwise
they are laid out flat (`flat_grads`), reduce-scattered, and the chunk is added in
(`accumulate`). A group of one parameter with no padding has its layout already: its
gradient, when contiguous and of the grad dtype, is reduce-scattered as it is
(`whole_grad`), with no flat copy beside it (an embedding's or a head's unit: the largest
of a language model, where that copy is the backward's peak).

[Note: reduce into the shard]
A backward reduce-scatter (s_G > 1) whose grad shard holds nothing yet (stale, or never
allocated: the step's first micro-batch) writes its output straight into the shard
(`reduce_target`); only a later micro-batch's reduce lands in a workspace chunk that is then
added in. So the shard comes into being at the reduce's issue, not at its wait, and no chunk
of N/s_G elements sits beside it: FSDP2 likewise keeps its reduce-scatter's output as the
sharded gradient. Measured by the same tracker, simulated (fake process group) on the 836M
Llama at 8 ranks: the chunk beside the grad shard was what held shardc's backward above
FSDP2's (bench/peak_fsdp2.py --simulate-836m, docs/BENCHMARKS.md). A shard marked clean here
is written before anything reads it: every reader (the sync, the norms, opt.step()) waits
the group's reduce-scatters first (`FlatGroup.finish_grads`).

[Note: nothing whole at build]
Building a storage allocates and writes only what it keeps: the params shard, the
secondary, the master. The full buffer of a gathered group (s_P > 1) is not made at build:
its first gather makes it (`alloc_full`: `empty`, N elements), as FSDP2 makes its unsharded
parameter at its first all-gather; a reader before that (`full`, `full_data`) gets it made
with its storage empty. Zeroing it at build, as before, touched N elements per group and the
freed pages stayed in the process's heap: building the 124.7M Llama's ZeRO-3 units on 4
ranks reached +323 MiB per rank for 119 MiB of shards (issue 54's "~120 MiB during
compile"); allocating it `empty` and freeing it at once, as after that, touched no page but
was an allocation of N elements all the same, which torch's MemTracker counts (and which a
GPU's caching allocator would hold for a moment): each rank's tracked start-up was its
shards plus the largest unit whole (tests/test_startup_peak.py).

[Note: shards allocated empty]
The params shard (s_P > 1) is allocated `empty`, and only the elements of its chunk that no
parameter covers (padding, gaps) are zeroed: every other element is written before it is
read, by the init (init_first.py scatters whole chunks; init.py writes each parameter's
part), a scatter of a model with values, or a load. A parameter no value source gave one is
in the parameter set's `unset` (runtime/state/params.py), and a forward, a step or a save
refuses to read it (`require`), so its garbage is never seen. Zeroing the whole shard
first, as before, wrote every page twice: 1.2-3.7 s of start-up's allocation on the 836M
Llama at 8 ranks, against FSDP2's `to_empty` 0.2-0.3 s (issue 50).

[Note: grad shard lifetime]
The grad shard (N/s_G elements of the grads dtype) is not allocated at compile: it comes
into being, zeros, the first time anything touches it, which in training is the unit's
first backward (its gradients arriving, or the sync of a unit that got none) and lives
until the module is dropped. So a load, an init or a scatter after compile never has the
grad shards beside the params (issue 54); `grad_nbytes` is its size for memory reports
before that. A `zero_grad()` before the first backward allocates nothing (it marks stale).
From then on the eager runtime's `zero_grad()` also frees the shard's storage (resized to
0, FSDP2's trick, so the views made of it stay valid: `mark_zero(release=True)`), as
torch's `zero_grad(set_to_none=True)` frees a model's gradients: a released shard is
stale, and its next write covers all of it (`_grad_back` gives the storage back first:
the unit's first gradients of the next step, or whatever materializes it). So from
zero_grad() to a unit's first reduced gradient in the next step (its backward's
reduce-scatter issued into it, [Note: reduce into the shard], or its slot gradients with
s_G = 1) the shard holds no bytes
(shardc.lowering [Note: reductions in flight] for the rest of the backward's buffers).
The whole-step mode keeps the shard allocated (its graphs read it even when stale).
"""
from __future__ import annotations

import torch
from torch import nn

from shardc.lowering import Over, RankPlan, master_is_params

from ..transport import quant
from ..dtypes import torch_dtype
from .layout import GroupLayout
from .workspace import Workspace, free_bytes


class FlatStorage:
    """One flat group's tensors (see the module notes); `trainable` groups also hold grads."""

    def __init__(self, layout: GroupLayout, plan: RankPlan, device: torch.device, is_root: bool,
                 over: Over = Over.DENSE):
        self.layout, self.plan, self.is_root, self.over = layout, plan, is_root, over
        sc = plan.scopes
        self.n = layout.n
        self.trainable = layout.trainable
        self.pdtype = torch_dtype(sc.params.dtype)
        self.gdtype = torch_dtype(sc.grads.dtype)
        self.s_p, self.s_g, self.s_os = plan.s(plan.p), plan.s(plan.g), plan.s(plan.os)
        self.p_start, self.p_len = plan.chunk("params", self.n)
        self._sizes = layout.split_sizes                     # made once (see Note)
        self._shapes = tuple(s.shape for s in layout.slots)
        self._stable_views: list[torch.Tensor] | None = None
        # a gathered group's full buffer is made at its first gather ([Note: nothing whole at build])
        self._full_device = device
        self._full = self._full_data = None
        if self.s_p == 1:
            self._make_full(torch.zeros)
        # the fp32 master is the params shard (shardc.lowering [Note: the master is the params shard])
        self.master_is_params = (master_is_params(sc.params.dtype, self.trainable, self.s_p, self.s_os)
                                 and plan.chunk("optim", self.n) == (self.p_start, self.p_len))
        if self.s_p == 1:
            self.shard = self.full_data
        else:
            self.shard = torch.empty(self.p_len, dtype=torch.float32 if self.master_is_params else self.pdtype,
                                     device=device)       # [Note: shards allocated empty]
            self._zero_gaps()
        self._init_secondary(device)
        if self.trainable:
            self._init_grads(device)

    def _zero_gaps(self) -> None:
        """The elements of this rank's params chunk that no parameter covers (padding, gaps
        between slots) as zeros: the rest is written by whatever gives the values."""
        lo, hi = self.p_start, self.p_start + self.p_len
        end = lo
        for s in sorted(self.layout.slots, key=lambda s: s.offset):
            if s.offset > end:
                self.shard[end - lo:min(s.offset, hi) - lo].zero_()
            end = max(end, min(s.offset + s.numel, hi))
            if end >= hi:
                return
        self.shard[end - lo:].zero_()

    def _init_secondary(self, dev: torch.device) -> None:
        sec = self.plan.scopes.params.secondary
        self.secondary = None
        self.sec_quant = None
        if sec is None or self.is_root:
            return
        self.q_start, self.q_len = self.plan.secondary_chunk(self.n)
        self.sec_quant = sec.quant
        if self.sec_quant:
            self.secondary = torch.zeros(quant.shard_payload_bytes(self.q_len, self.sec_quant),
                                         dtype=torch.uint8, device=dev)
        else:
            self.secondary = torch.zeros(self.q_len, dtype=self.pdtype, device=dev)

    def _init_grads(self, device: torch.device) -> None:
        plan, n = self.plan, self.n
        g_start, g_len = plan.chunk("grads", n)
        self.os_start, self.os_len = plan.chunk("optim", n)
        self._g_len, self._g_device = g_len, device
        self._grad_shard: torch.Tensor | None = None     # allocated at first use ([Note: grad shard lifetime])
        self._gviews: list[torch.Tensor] | None = None
        self.stale = False                 # zero_grad() ran and no backward wrote the shard yet
        self.os_in_g = self.os_start - g_start
        self.os_in_p = self.os_start - self.p_start
        if self.pdtype == torch.float32 or self.master_is_params:
            self.master = self.shard[self.os_in_p:self.os_in_p + self.os_len]
            self.master_separate = False
        else:
            self.master = torch.zeros(self.os_len, dtype=torch.float32, device=device)
            self.master_separate = True

    @property
    def grad_nbytes(self) -> int:
        """The grad shard's size, allocated or not (memory reports count it from the start)."""
        return self._g_len * torch.empty((), dtype=self.gdtype).element_size()

    @property
    def grad_elems(self) -> int:
        """The grad shard's elements (N/s_G; asking allocates nothing)."""
        return self._g_len

    @property
    def grad_device(self) -> torch.device:
        """Where the grad shard lives (asking allocates nothing)."""
        return self._g_device

    @property
    def grad_allocated(self) -> bool:
        return self._grad_shard is not None

    @property
    def grad_shard(self) -> torch.Tensor:
        """This rank's grad chunk (N/s_G), zeros when first touched: see [Note: grad shard lifetime]."""
        if self._grad_shard is None:
            self._grad_shard = torch.zeros(self._g_len, dtype=self.gdtype, device=self._g_device)
            self._gviews = self.plain_views(self._grad_shard) if self.s_g == 1 else None
        return self._grad_shard

    # -- values (the builder's) ---------------------------------------------------------------
    def write_param(self, slot, value: torch.Tensor) -> None:
        """Parameter `slot`'s whole value (any shape of slot.numel elements): the part inside
        this rank's params chunk into the shard (cast), and into the fp32 master."""
        value = self._as_params(value.detach().reshape(-1))
        a, b = max(slot.offset, self.p_start), min(slot.offset + slot.numel, self.p_start + self.p_len)
        if a < b:
            self.shard[a - self.p_start:b - self.p_start].copy_(value[a - slot.offset:b - slot.offset])
            self._master_from_shard(a, b)

    def write_chunk(self, chunk: torch.Tensor) -> None:
        """This rank's whole params chunk (p_len elements, padding included)."""
        self.shard.copy_(self._as_params(chunk))
        self._master_from_shard(self.p_start, self.p_start + self.p_len)

    def _as_params(self, value: torch.Tensor) -> torch.Tensor:
        """A value for the shard: where the master is the shard, rounded to the params dtype
        first, so the master holds what a separate one would (the cast values)."""
        return value.to(self.pdtype) if self.master_is_params else value

    def gather_input(self) -> torch.Tensor:
        """What a forward all-gather sends: the params shard, or the master cast to the params
        dtype where it is the shard (a transient that lives while the gather is in flight)."""
        return self.shard.to(self.pdtype) if self.master_is_params else self.shard

    def _master_from_shard(self, a: int, b: int) -> None:
        """Elements [a, b) of the flat buffer were written to the shard: the master's part of
        them follows (as the cast values, so every value source gives the same master)."""
        if not (self.trainable and self.master_separate):
            return
        a, b = max(a, self.os_start), min(b, self.os_start + self.os_len)
        if a < b:
            self.master[a - self.os_start:b - self.os_start].copy_(
                self.shard[a - self.p_start:b - self.p_start])

    # -- the full buffer ------------------------------------------------------------------
    def _make_full(self, make) -> None:
        full = make(self.n, dtype=self.pdtype, device=self._full_device)
        self._full = nn.Parameter(full) if self.trainable else full
        self._full_data = self._full.data          # own version counter (see Note)

    @property
    def full(self) -> torch.Tensor:
        """The full buffer (N elements; its storage empty between gathers): made, empty, by a
        reader before its first gather ([Note: nothing whole at build])."""
        if self._full is None:
            self._make_full(torch.empty)
            self.free_full()
        return self._full

    @property
    def full_data(self) -> torch.Tensor:
        """`full.data`, kept (collectives write through it: see Note)."""
        self.full
        return self._full_data

    @property
    def full_made(self) -> torch.Tensor | None:
        """`full_data` once anything made it, else None (asking makes nothing)."""
        return self._full_data

    def alloc_full(self) -> None:
        if self._full is None:                     # the first gather: the one allocation
            return self._make_full(torch.empty)
        need = self._full_data.numel() * self._full_data.element_size()
        if self._full_data.untyped_storage().size() != need:
            self._full_data.untyped_storage().resize_(need)

    def free_full(self) -> None:
        if self._full is not None:
            free_bytes(self._full_data)

    def keep_secondary(self) -> None:
        """After a forward gather: this rank's secondary chunk from the full buffer."""
        mine = self.full_data[self.q_start:self.q_start + self.q_len]
        if self.sec_quant:
            quant.quantize(mine, self.sec_quant, out=self.secondary)
        else:
            self.secondary.copy_(mine)

    def views(self, on_grads) -> list[torch.Tensor]:
        """The parameters as views of the full buffer (autograd-tracked when trainable;
        `on_grads(grads)` receives their gradients, slot order)."""
        if self.trainable and self.n:
            return _Views.apply(self.full, self.plain_views, on_grads)
        if self._stable_views is None:            # frozen: `full` is a plain tensor (see Note)
            self._stable_views = self.plain_views(self.full)
        return self._stable_views

    def plain_views(self, base: torch.Tensor) -> list[torch.Tensor]:
        if not self.n:
            return []
        return [p.view(shape) for p, shape in zip(base.split_with_sizes(self._sizes), self._shapes)]

    # -- gradients (see [Note: grad accumulation]) ------------------------------------------
    def add_slot_grads(self, grads) -> None:
        """s_G = 1: one backward's gradients (slot order, None: none) into the shard."""
        shard = self._grad_back() if self.stale else self.grad_shard   # allocates it at the first backward
        dst = [v for v, g in zip(self._gviews, grads) if g is not None]
        src = [g for g in grads if g is not None]
        if self.stale:
            for v, g in zip(self._gviews, grads):
                if g is None:
                    v.zero_()
            shard[self.layout.phi:].zero_()
            if dst:
                torch._foreach_copy_(dst, src)
            self.stale = False
        elif dst:
            torch._foreach_add_(dst, src)

    def whole_grad(self, grads) -> torch.Tensor | None:
        """The one gradient of a one-parameter group, flat, when it is the layout itself
        (no padding, contiguous, the grad dtype and device: see [Note: grad accumulation]).
        The plan says which groups are such (lowering `GroupPlan.whole_grad`, which explain's
        timeline reads); this checks the tensor autograd gave."""
        if len(self._sizes) != 1 or self.layout.phi != self.n or grads[0] is None:
            return None
        g = grads[0]
        if g.dtype != self.gdtype or g.device != self._g_device or not g.is_contiguous():
            return None
        return g.view(-1)

    def flat_grads(self, grads, workspace: Workspace) -> torch.Tensor:
        """One backward's gradients laid out flat (N elements, zeros where none) in a
        workspace tensor."""
        flat = workspace.take(self.n, self.gdtype, self._g_device)
        dst, src = [], []
        for piece, g in zip(self.plain_views(flat), grads):
            if g is None:
                piece.zero_()
            else:
                dst.append(piece)
                src.append(g)
        if dst:
            torch._foreach_copy_(dst, src)
        flat[self.layout.phi:].zero_()
        return flat

    def reduce_target(self) -> torch.Tensor | None:
        """The grad shard itself as a backward reduce-scatter's output when nothing is in it
        yet (stale after zero_grad(), or never written): the reduced chunk lands there with
        no chunk of its own beside it, as FSDP2 keeps its reduce-scatter's output as the
        sharded gradient ([Note: reduce into the shard]); None when it holds gradients to add to."""
        if self._grad_shard is not None and not self.stale:
            return None
        self.stale = False
        if self._grad_shard is None:
            self._grad_shard = torch.empty(self._g_len, dtype=self.gdtype, device=self._g_device)
            self._gviews = self.plain_views(self._grad_shard) if self.s_g == 1 else None
            return self._grad_shard
        return self._grad_back()

    def accumulate(self, chunk: torch.Tensor) -> None:
        """Add a reduced grad chunk (N/s_G) into the shard (copy it when stale)."""
        if self.stale:
            self._grad_back().copy_(chunk)
            self.stale = False
        else:
            self.grad_shard.add_(chunk)

    def mark_zero(self, release: bool = False) -> None:
        """zero_grad(): the grad shard is logically zero (written lazily, see Note); with
        `release` its storage is freed until it is next written ([Note: grad shard lifetime])."""
        self.stale = True
        if release and self._grad_shard is not None:
            free_bytes(self._grad_shard)

    def _grad_back(self) -> torch.Tensor:
        """The grad shard with its storage (given back after a released zero_grad), for a
        write that covers all of it."""
        g = self.grad_shard
        need = g.numel() * g.element_size()
        if g.untyped_storage().size() != need:
            g.untyped_storage().resize_(need)
        return g

    def materialize(self) -> None:
        """A stale grad shard (zero_grad() ran, no backward wrote it) becomes zeros."""
        if self.stale:
            self._grad_back().zero_()
            self.stale = False

    @property
    def os_grad(self) -> torch.Tensor:
        self.materialize()
        return self.grad_shard[self.os_in_g:self.os_in_g + self.os_len]

    # -- optimizer chunk ---------------------------------------------------------------------
    def master_into_shard(self) -> torch.Tensor:
        """After an update: the OS chunk written back into the params shard (cast); returns
        that slice of the shard."""
        mine = self.shard[self.os_in_p:self.os_in_p + self.os_len]
        if self.master_separate:
            mine.copy_(self.master)
        return mine

    def checkpoint_chunk(self) -> tuple[torch.Tensor, int]:
        """(source tensor, its start in the flat buffer) a checkpoint reads and writes: the
        fp32 master (trainable) or the params shard (frozen)."""
        return (self.master, self.os_start) if self.trainable else (self.shard, self.p_start)


class _Views(torch.autograd.Function):
    """The parameters of a trainable group as views of its full buffer (see Note)."""

    @staticmethod
    def forward(ctx, full, plain_views, on_grads):
        ctx.on_grads = on_grads
        # views of the leaf's version counter, which refills through `full_data` never bump
        return tuple(plain_views(full.detach()))

    @staticmethod
    def backward(ctx, *grads):
        ctx.on_grads(grads)
        return None, None, None
