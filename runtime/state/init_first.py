"""Initialization on the first rank, sent — stage: runtime (state). A model built on the
meta device gets its values from one rank's run of the init, each rank receiving its chunks.

Input: the model (parameters and buffers on the meta device), the function called per
module (`init=`), the flat groups' storages (where each parameter lives), the
canonical parameters by name, the device, the data-parallel `ShardMesh` and the RNG state
to start from. Output: every rank's shards written with the values of one process's
`model.to_empty(device=d); model.apply(fn)`, the buffers materialized and equal to the
first rank's, every rank's RNG advanced as that one process's was, and the names of
parameters no call gave a value (`unset`, the same on every rank).

[Note: one rank draws, every rank receives]
init.py's [Note: the same values on every world size] has every rank run the whole
model's init and keep its part: the CPU generator is one sequence (each draw's state is
the previous draw's), so no rank can compute its shard's values without drawing every
value before them, and every rank did the same draws. Here the mesh's first rank alone
runs `fn` on every module, in `nn.Module.apply`'s order and from the same RNG state, so
the values are the same, and sends each rank its chunk: no rank repeats a draw another
rank made (issue 50). Each parameter is materialized as a view of its flat group's padded
buffer (the group's layout; NaN once anything could read it, untouched.py's [Note: NaN only
where it can be seen]; the padding zero), so what `fn` writes
is already laid out; a parameter `fn` replaced (`.data = ...`) or of another dtype than
the group's params is copied in (cast) once its last holder ran. When a group's last
parameter is final, the buffer is scattered over the data-parallel group (a replicated
group, s_P = 1, is broadcast), each rank receiving straight into its params shard. The
scatter is asynchronous, and up to `SENDS_IN_FLIGHT` sent buffers may stay in flight while
the first rank fills the next; it is 0, so the first rank holds one unit's buffer, the
bound lowering/startup.py states (1 would overlap a send with the next unit's draws, at
one more unit's buffer). The other ranks draw nothing: they join the same scatters in the same
order, which each computes from the model's structure alone (a group is sent after the
module that last holds one of its parameters). Then one broadcast gives every rank the
first rank's `unset`, its RNG state after the init (so a rank's generator is where one
process's would be, as when every rank ran the init) and an error `fn` raised (every rank
raises it; the first rank sends zeros for the groups it had not filled, so no rank waits
for a send that never comes); and buffers are broadcast as after a scatter (a buffer's
init may draw too).
[Note: one buffer, reused]
A sent buffer is kept (one per dtype, the largest) and the next group's buffer is its
front: a fresh buffer per group cost the first rank a page fault per 4 KiB of every unit
(the C allocator returns big blocks to the OS at each free), which was most of the time of
the NaN fill before `fn` (measured: 6.1 of 21.9 s of values on a 1-layer 175M Llama at 4
ranks, loaded machine). The pool holds at most the largest unit's buffer, the bound below.
[Note: each rank draws its part]
On CPU (`Pieces`, init_pieces.py) the first rank sends instructions, not values. A whole `normal_` or
float32 `uniform_`, `fill_` or `zero_` of a parameter is not run on the first rank
(untouched.py's [Note: deferred whole writes]): a draw is counted on a lagging generator,
not drawn, and its start kept as a stream position (draws.py's [Notes: a draw split by ranks,
a lagging generator]). When a group is final, each rank's pieces of it are queued:
("normal"/"uniform", position, ...), ("fill", value), or ("copy", values) for a parameter
ops ran on. The queue is sent (one object scatter, each rank its own list) after a group
with values, so at most one group's are held, and at the end; after the last send one
broadcast carries the generator's runs, every rank's segment of the positions, which each
rank walks (one jump to its start), and the closing box below (the first rank's RNG state,
`unset`, an error); all-gathers of the walked states (fixed-size tensors), a round at a
time, give every rank the states its draws start from. Each
rank writes the pieces into its shard (padding stays the zeros its allocation gave it). So
no whole parameter is drawn or sent: on this path a parameter is not a view of a group
buffer but a tensor of its own whose storage gets its bytes at the first op other than
those (untouched.py's [Note: storage at the first real op]), kept until its group is sent;
no rank moves the generator past another rank's part; and where the init only draws and
fills, the values take one object scatter, one broadcast and a round of all-gathers of
states (init_pieces.py's [Note: states a round at a time]; then the buffers' broadcast),
not a scatter per group: under load each collective waits for every rank to be scheduled.
Values as before: one process's. Elsewhere (CUDA parameters) the buffer is scattered
(`_Sender`).
Memory: a rank other than the first holds its shards and a round's generator states; the
first, beyond them, the parameters an op read (their values until their group is sent) and
a parameter of another dtype while its module runs; on the scatter path the buffer being
filled and `SENDS_IN_FLIGHT` sent ones (lowering/startup.py's `unit_values_bytes` is one
buffer, the bound for both).
Used where the data-parallel group is the whole world and no parameter is a DTensor
(runtime/build.py); else every rank runs the init (init.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardc.dsl.errors import ShardcError
from shardc.lowering import RankPlan

from ..buffers import broadcast
from .init import _materialize as _materialize_alone
from .init import all_nan, apply_order, materialize_buffers, rng
from .init_pieces import Pieces
from .untouched import Untouched

SENDS_IN_FLIGHT = 0            # scattered buffers a first rank keeps while it fills the next (0: the bound of
#                                lowering/startup.py, one unit; 1 overlaps the send with the next unit)


class _Schedule:
    """When each flat group is complete: the index in apply order of the last module
    holding one of its parameters (the same on every rank: the model's structure)."""

    def __init__(self, order, storages, params: dict[str, nn.Parameter]):
        last = {}
        for i, (_, m) in enumerate(order):
            for p in m._parameters.values():
                if p is not None:
                    last[id(p)] = i
        self.last = last
        self.done_at: dict[int, list] = {}
        for k, st in enumerate(storages):
            idx = max((last[id(params[s.fqn])] for s in st.layout.slots), default=-1)
            self.done_at.setdefault(idx, []).append(k)


def initialize_first(model: nn.Module, fn, storages, params: dict[str, nn.Parameter], device: torch.device,
                     smesh, state=None) -> set[str]:
    """See the module note. Every rank of `smesh` calls it (collective); returns `unset`."""
    group, me = smesh.dp_group(), smesh.rank
    order = apply_order(model)
    sched = _Schedule(order, storages, params)
    sender = (Pieces if device.type == "cpu" else _Sender)(storages, smesh, group, device)
    for k in sched.done_at.get(-1, ()):        # groups of no parameter: padding only
        sender.finish(k, True) if me == 0 else sender.receive(k)
    error = None
    if me == 0:
        error = _run_first(model, fn, order, sched, storages, params, device, sender, state)
    else:
        for i in range(len(order)):
            for k in sched.done_at.get(i, ()):
                sender.receive(k)

    def closing():                         # what every rank takes from the first after the init
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return error, sender.unset, torch.random.get_rng_state(), cuda
    error, unset, cpu_state, cuda_state = sender.drain(closing if me == 0 else None)
    if me != 0:
        torch.random.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
    materialize_buffers(model, device)
    broadcast(model, group)
    if error is not None:
        raise ShardcError(error)           # every rank the same sentence (it ran on the first)
    return unset


def _run_first(model, fn, order, sched, storages, params, device, sender, state) -> str | None:
    """The first rank's loop: init.initialize's, the values laid out and sent (see Note)."""
    slot_of = {}
    for k, st in enumerate(storages):
        for s in st.layout.slots:
            slot_of[id(params[s.fqn])] = (k, s)
    names = {id(p): n for n, p in params.items()}
    real: dict[int, nn.Parameter] = {}
    holders: dict[int, list] = {}
    error = None
    untouched = sender.untouched
    with rng(state):
        for i, (path, m) in enumerate(order):
            if error is None:
                try:
                    with torch.no_grad():
                        _materialize(m, device, real, holders, slot_of, sender)
                    with untouched:
                        fn(m)
                except Exception as e:  # noqa: BLE001 — every rank raises it (see Note)
                    error = (f"init function {getattr(fn, '__name__', fn)!r} failed on module {path or '<root>'} "
                             f"({type(m).__name__}): {type(e).__name__}: {e}")
            with torch.no_grad():
                for pid in [pid for pid in real if sched.last[pid] == i]:
                    value = real.pop(pid)
                    if error is None and pid in slot_of:
                        sender.keep(value, *slot_of[pid], names[pid])
                    for mod, attr, meta in holders.pop(pid):
                        mod._parameters[attr] = meta
                    del value          # a view of its group's buffer: kept, it kept that buffer alive
                    #                    beside the next group's (two units on the first rank, tracked)
            for k in sched.done_at.get(i, ()):
                sender.finish(k, error is None)
    return error


def _materialize(m: nn.Module, device, real: dict, holders: dict, slot_of: dict, sender) -> None:
    """m's own parameters as views of their group's buffer (NaN), where the dtype is the
    group's and the parameter is a plain tensor; else as init.py makes them; buffers too."""
    for attr, p in list(m._parameters.items()):
        if p is None or not p.is_meta:
            continue
        key = id(p)
        if key not in real:
            where = slot_of.get(key)
            st = sender.storages[where[0]] if where else None
            if st is None or isinstance(p, DTensor) or p.dtype != st.pdtype or not p.is_contiguous():
                continue                   # made below, as init.py does
            s = where[1]
            view = sender.slot(where[0], s, p.shape)
            sender.untouched.add(view)     # NaN once an op could read it ([Note: NaN only where it can be seen])
            real[key] = nn.Parameter(view, requires_grad=p.requires_grad)
            holders[key] = []
        holders[key].append((m, attr, p))
        m._parameters[attr] = real[key]
    _materialize_alone(m, device, real, holders, True)     # the rest: separate tensors; buffers


class _Sender:
    """The flat groups' padded buffers on the first rank, and their scatters (every rank)."""

    def __init__(self, storages, smesh, group, device):
        self.storages, self.smesh, self.group, self.device = storages, smesh, group, device
        self.full: dict[int, torch.Tensor] = {}
        self.pool: dict[torch.dtype, torch.Tensor] = {}   # a sent buffer per dtype, reused
        self.pending: list = []            # (work, storage) in send order
        self.unset: set[str] = set()
        self.untouched = Untouched()       # the views not yet written (untouched.py)

    def slot(self, k: int, s, shape) -> torch.Tensor:
        """The parameter at slot s of group k: a view of the group's buffer."""
        return self.buffer(k)[s.offset:s.offset + s.numel].view(shape)

    def buffer(self, k: int) -> torch.Tensor:
        """Group k's padded buffer (taken at its first use, the padding zero): the front of a
        pooled one of its dtype where one is large enough ([Note: one buffer, reused])."""
        if k not in self.full:
            st = self.storages[k]
            buf = self._take(st.n, st.pdtype)
            end = 0
            for s in sorted(st.layout.slots, key=lambda s: s.offset):
                buf[end:s.offset].zero_()
                end = max(end, s.offset + s.numel)
            buf[end:].zero_()
            self.full[k] = buf
        return self.full[k]

    def _take(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """n elements of a pooled buffer of `dtype` (the largest kept), else a new one; a
        smaller pooled buffer is dropped for it, so the pool never holds two of a dtype."""
        pooled = self.pool.pop(dtype, None)
        if pooled is not None and pooled.numel() >= n:
            return pooled[:n]
        return torch.empty(n, dtype=dtype, device=self.device)

    def _give_back(self, buf: torch.Tensor | None) -> None:
        """A sent buffer to the pool (its base: the whole pooled allocation)."""
        if buf is None:
            return
        base = buf._base if buf._base is not None else buf
        kept = self.pool.get(base.dtype)
        if kept is None or kept.numel() < base.numel():
            self.pool[base.dtype] = base

    def finish(self, k: int, ok: bool) -> None:
        """Group k is final on the first rank: its buffer sent (zeros after an error)."""
        self.send(k, self.buffer(k) if ok else self.zeros(k))

    def receive(self, k: int) -> None:
        self.send(k, None)

    def zeros(self, k: int) -> torch.Tensor:
        self.full.pop(k, None)
        st = self.storages[k]
        return torch.zeros(st.n, dtype=st.pdtype, device=self.device)

    def keep(self, value: torch.Tensor, k: int, slot, name: str) -> None:
        """A parameter's final value in its group's buffer (a no-op for a view of it)."""
        buf = self.buffer(k)
        dst = buf[slot.offset:slot.offset + slot.numel]
        if value.data_ptr() != dst.data_ptr() or value.dtype != dst.dtype:
            self.untouched.forget(dst)
            dst.copy_(value.detach().reshape(-1))
        else:
            self.untouched.settle(dst)
        if dst.is_floating_point() and all_nan(dst):
            self.unset.add(name)

    def send(self, k: int, full: torch.Tensor | None) -> None:
        st = self.storages[k]
        self.full.pop(k, None)
        if self.group is None:
            st.write_chunk(full[st.p_start:st.p_start + st.p_len])
            self._give_back(full)
            return
        if st.s_p == 1:
            buf = full if full is not None else st.shard
            work = dist.broadcast(buf, group=self.group, group_src=0, async_op=True)
        else:
            chunks = None
            if full is not None:
                starts = [RankPlan(self.smesh.mesh, st.plan.scopes, r).chunk("params", st.n)[0]
                          for r in range(self.smesh.mesh.world)]
                chunks = [full[a:a + st.p_len] for a in starts]
            work = dist.scatter(st.shard, chunks, group=self.group, group_src=0, async_op=True)
        self.pending.append((work, st, full))
        while len(self.pending) > SENDS_IN_FLIGHT:
            self._wait()

    def _wait(self) -> None:
        work, st, full = self.pending.pop(0)
        work.wait()
        if st.s_p == 1 and full is not None:
            st.write_chunk(full)
        else:
            st.write_chunk(st.shard)       # the master follows the received shard
        self._give_back(full)

    def drain(self, closing) -> tuple:
        """Every send completed; then the first rank's `closing()` on every rank (a broadcast)."""
        while self.pending:
            self._wait()
        box = [closing() if closing is not None else None]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]
