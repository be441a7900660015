"""Deferred updates in the whole-step mode — stage: runtime (`backend="inductor"`, the
`defer_update` plan pass).

Input: the deferred units' trainable flat groups (their eager update all-gather,
groups/flat_group.py `update_issue`). Output: `OwedUpdate` (one update in flight from opt.step()
on), `update_keys` (each deferred unit's key) and the opaque op `shardc::await_update`
(`AWAIT`) the forward's graph waits one with (graph/step.py).

[Note: deferred updates, issued at the step]
Under the `defer_update` pass the update graph leaves out the units the schedule defers.
opt.step() issues their update all-gathers as the eager runtime does (each group's own
`update_issue`, eagerly, into a buffer of its own) and returns; the next forward's graph
waits each one with the opaque op `shardc::await_update`, right before its unit is first
needed, and writes the result into the params shard (graph/step.py [Note: deferred
update as graphs]). So the gathers travel while the loop zeroes the gradients and loads
the next batch, as eagerly. Whatever reads the parameters before that forward completes
them here (`OwedUpdate.wait`, through the boundary's `complete_updates`, as it waits the
eager runtime's deferred work). An owed update is keyed by an int the graph carries as a
constant (`update_keys`): the op finds its in-flight `OwedUpdate` in `_OWED`, which holds
it weakly: the step boundary of its ShardedModule owns it (`StepBoundary._updates`) until
it is waited, so an update owed when its module goes away (no forward followed
opt.step()) is released with the module, buffer and all.
"""
from __future__ import annotations

import itertools
import weakref

import torch

# key -> the OwedUpdate in flight (weakly: its module's boundary owns it; see Note)
_OWED: "weakref.WeakValueDictionary[int, OwedUpdate]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()               # a fresh key per deferred unit of any runtime: no per-model state


@torch.library.custom_op("shardc::await_update", mutates_args=())
def await_update(shard: torch.Tensor, key: int) -> torch.Tensor:
    """The params shard after the owed update `key` (see Note): its all-gather waited."""
    return _OWED.pop(key).take()


@await_update.register_fake
def _(shard, key):
    return torch.empty_like(shard)


AWAIT = torch.ops.shardc.await_update.default


def update_keys(deferred) -> dict[int, int]:
    """The key of each deferred unit's owed update, fixed when the runtime is built."""
    return {i: next(_KEYS) for i in sorted(deferred)}


class OwedUpdate:
    """A deferred unit's update all-gather, in flight since opt.step() and owed to the next
    forward's graph; `wait` completes it now, when something needs the parameters first."""

    def __init__(self, group, key: int):
        self.group, self.key = group, key
        self.buf = torch.empty_like(group.storage.shard)
        self.work = group.update_issue(record=False, out=self.buf)
        _OWED[key] = self

    def take(self) -> torch.Tensor:
        """Its all-gather waited: the gathered shard (handed over once)."""
        self.work.wait()
        buf, self.buf, self.work = self.buf, None, None
        return buf

    def wait(self) -> None:
        _OWED.pop(self.key, None)
        self.group.storage.shard.copy_(self.take())
