"""Buffers — stage: runtime. DDP's rule for the model's (unsharded) buffers.

Input: a `ShardedModule` and its strategy's `buffers` mode (`BufferSync`).
Output: `broadcast(module, group)` (the mesh's rank 0's buffers to every rank of the
mesh, one broadcast per dtype, not recorded in the ledger) and `Buffers`, whose `install(sm)` runs it under `buffers
broadcast` before every forward in training mode (a forward pre-hook on the
ShardedModule, so emitted forwards get it too), and whose `settle()` the state-dict and
export paths call so that what they return is rank 0's. `buffers local` keeps only the broadcast
made when sharding.

[Note: before the forward, and before reading]
Buffers change inside a training forward (BatchNorm's running statistics) and autograd
may hold them for the backward, so they are synchronised before the next forward, as
DDP does, never after one. Between a training forward and the next, each rank holds
its own update; `settle` broadcasts then (only if a training forward ran since the last
broadcast), so every rank's state dict and every checkpoint hold rank 0's values.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardc.dsl.ir import BufferSync

from .compile import eager


def broadcast(module: nn.Module, group) -> None:
    """Every rank of `group` (the mesh's ranks; None: one rank) takes the buffers of the
    group's first rank."""
    if group is None:
        return
    by_dtype: dict[tuple, list[torch.Tensor]] = {}
    for b in module.buffers():
        by_dtype.setdefault((b.dtype, b.device), []).append(b)
    with torch.no_grad():
        for bufs in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in bufs])
            dist.broadcast(flat, group=group, group_src=0)
            off = 0
            for b in bufs:
                b.copy_(flat[off:off + b.numel()].view_as(b))
                off += b.numel()


class Buffers:
    """The buffers of one ShardedModule's model under its `buffers` mode (see Note)."""

    def __init__(self, module: nn.Module, mode: BufferSync, faults, group):
        self.module, self.mode, self.faults, self.group = module, mode, faults, group
        self.dirty = False                 # a training forward ran since the last broadcast

    def settle(self, caller: str | None = None) -> None:
        """Under `buffers broadcast`: rank 0's buffers everywhere if a training forward ran
        since the last broadcast. Collective then (every rank must call it); `caller` names
        the API for the bounded entry rendezvous (runtime/eager/faults.py)."""
        if self.dirty:
            if caller is not None:
                self.faults.enter(caller)
            broadcast(self.module, self.group)
            self.dirty = False

    def install(self, owner: nn.Module) -> None:
        """Under `buffers broadcast`, sync the buffers before each training forward of `owner`."""
        if self.mode is not BufferSync.BROADCAST or not any(True for _ in self.module.buffers()):
            return

        @eager                           # a collective: never traced (runtime/compile.py)
        def before_forward(module, args):
            if module.training:
                self.settle()
                self.dirty = True

        owner.register_forward_pre_hook(before_forward)
