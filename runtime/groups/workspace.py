"""Scratch buffers — stage: runtime. Flat tensors reused by the backward's reduce-scatters.

Input: requests for a flat scratch tensor of n elements (dtype, device) from the flat
groups (the full local gradient a backward reduce-scatters, the chunk it lands in) and
from the gloo reduce-scatter (its all-to-all receive buffer).
Output: a view of a pooled tensor, handed back once its reduce-scatter is waited.

[Note: reduce workspace]
A backward with s_G > 1 needs, per unit, one N-element buffer (the unit's gradients laid
out flat, the reduce-scatter's input; none for a one-parameter unit whose gradient is
the layout already, groups/storage.py [Note: grad accumulation]), one N/s_G-element chunk (its
output; none in the step's first micro-batch, whose reduce-scatter writes into the grad
shard itself, groups/storage.py [Note: reduce into the shard]) and, on gloo, the all-to-all's receive buffer (at most the lowering's receive block, in
blocks past it: runtime/eager/collectives.py [Note: bounded all-to-all]; handed back as soon
as its local sum is done), all alive until the reduce-scatter is waited. The engine waits
the previous unit's reduce-scatter before the next unit's gradients are laid out flat
(eager/engine.py; shardc.lowering [Note: reductions in flight], REDUCE_IN_FLIGHT = 1), so one
of each is taken at a time and the next unit reuses them. Allocating them fresh per unit and backward
costs an allocation and, above the C allocator's reuse threshold (32 MiB for glibc),
page faults on every use; the pool hands back a view of a tensor an earlier unit or
micro-batch returned (the first one large enough, or a new one). The engine empties the
pool (`clear`) at the end of the backward that issues the step's sync and in
zero_grad(), so between steps, in opt.step() and in the forward that follows it the pool
holds nothing. Within a step's accumulation window it holds at most N + N/s_G elements
of the largest unit plus one receive block (the in-flight bound above; a smaller free
tensor is dropped when a larger one is needed). The parameters'
gathered full buffers are not pooled: their storage is freed on release, so the
transient window stays what the plan says.

[Note: pools by role]
The reduce-scatters' output chunks (N/s_G) are pooled apart from the N-element buffers (the
flat inputs and gloo's receive blocks): `take(..., role="chunk")`. In one pool, a step whose
first micro-batch reduces into the grad shards (groups/storage.py [Note: reduce into the
shard]) leaves only N-element buffers free, the second micro-batch's chunk is cut from one
of them and the receive block then needs a new one: the pool grew to 3N where the plan
says N + N/s_G + one receive block (measured on gloo ranks, HF GPT-2 at 4 ranks, PaRO-IIG:
396,544 B over explain's peak; bench/peak_gloo.py).

[Note: bytes freed at once]
`clear` frees the free tensors' bytes (their storages resized to 0), not only its
references: a tensor handed back has been waited, but gloo's worker thread holds the op's
tensors a moment longer (it drops its reference after marking the op done), so dropping
ours could leave the bytes held into what follows: measured on 2 gloo ranks, examples/gpt.py
`small` under zero3, 1 run in 120 began the optimizer step with the backward's last
reduce-scatter's buffers still held (1,583,104 B; the step's peak 1.17x explain's). A
handed-back tensor is never read again by its taker (the contract of `give`), so nothing
live shares those bytes. `free_bytes` is the one way the runtime frees a buffer it made
once every reader is done: this pool's, the collectives' own (runtime/eager/collectives.py
[Note: blocks reuse their buffers]), the step sync's chunk and the update gather's clone
(groups/flat_group.py), the gathered parameters and the released grad shards
(groups/storage.py).
"""
from __future__ import annotations

import torch


def free_bytes(*ts: torch.Tensor) -> None:
    """The tensors' bytes freed now, their storages resized to 0, whoever else still holds
    them ([Note: bytes freed at once]): for buffers whose every reader is done."""
    for t in ts:
        t.untyped_storage().resize_(0)


class Workspace:
    """A free list of flat tensors per (dtype, device)."""

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self.allocations = 0            # tensors made so far (tests read it)

    def take(self, n: int, dtype: torch.dtype, device: torch.device, role: str = "flat") -> torch.Tensor:
        """n uninitialised elements: a view of a free pooled tensor of `role`, or a new one
        ([Note: pools by role])."""
        free = self._free.setdefault((role, dtype, device), [])
        for k, t in enumerate(free):
            if t.numel() >= n:
                return free.pop(k)[:n]
        if free:                        # every free one is too small: drop the smallest
            free.pop(min(range(len(free)), key=lambda k: free[k].numel()))
        self.allocations += 1
        return torch.empty(n, dtype=dtype, device=device)

    def give(self, t: torch.Tensor, role: str = "flat") -> None:
        """Hand back a tensor `take(..., role)` returned (its collective has been waited)."""
        base = t if t._base is None else t._base
        self._free.setdefault((role, base.dtype, base.device), []).append(base)

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)

    def clear(self) -> None:
        """Drop the free tensors and free their bytes now ([Note: bytes freed at once])."""
        for ts in self._free.values():
            free_bytes(*ts)
        self._free.clear()
