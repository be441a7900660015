"""Parameters no op has touched yet — stage: runtime (state). The first rank's init
(init_first.py) lays each parameter out as a view of its group's buffer; this tells which of
those views an init function wrote whole before anything read them, so they need no NaN.

Input: the views (`add`: a buffer's storage, the slot's offset and size, the view) and the
aten ops the init function runs while `watch()` is active. Output: each view either marked
touched (its values are the op's) or filled with NaN right before the first op that could
read it (`settle`: a view no op touched, filled when its parameter is final).

[Note: NaN only where it can be seen]
init.py marks a parameter without a value by materializing it as NaN: whatever is still all
NaN after every call got no value (`unset`). Filling each parameter first costs a write of
every byte before the init writes it again: on the first rank, which draws the whole model
alone, 0.41 of its 1.2 CPU s of values (1-layer 175M Llama, 4 gloo ranks, cProfile). The
NaN matters only to an op that reads the old contents, and to the final check. So the fill
is deferred: an op that overwrites a whole view without reading it (`OVERWRITES`: the
random fills, `fill_`, `zero_`, `copy_` into it) with the view exactly as its first
argument marks it touched and runs; any other op whose tensor arguments overlap a view not
yet touched (a read, a partial write: `weight[pad].zero_()` before a draw, an in-place
`mul_`) first fills that whole view with NaN, as init.py would have. A view no op touched
is filled when its last holder ran (`settle`). So every op sees the bytes init.py's path
gives it and every parameter ends as it would there, NaN where unset; the only writes
saved are the NaN fills an overwrite would have replaced. Views are found by storage and
element range, so `.data` aliases (their own version counters) are seen too.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
OVERWRITES = {aten.normal_, aten.uniform_, aten.fill_, aten.zero_, aten.copy_, aten.random_,
              aten.exponential_, aten.log_normal_, aten.cauchy_, aten.geometric_, aten.bernoulli_}


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The element range [a, b) of t's storage that t can address."""
    if t.numel() == 0:
        return t.storage_offset(), t.storage_offset()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset(), t.storage_offset() + last + 1


class Untouched(TorchDispatchMode):
    """The views not yet touched, by their buffer's storage; see the module note."""

    def __init__(self):
        super().__init__()
        self.views: dict[int, dict[int, torch.Tensor]] = {}   # storage ptr -> {slot offset: view}

    def add(self, view: torch.Tensor) -> None:
        self.views.setdefault(view.untyped_storage().data_ptr(), {})[view.storage_offset()] = view

    def pending(self, view: torch.Tensor) -> bool:
        return view.storage_offset() in self.views.get(view.untyped_storage().data_ptr(), {})

    def settle(self, view: torch.Tensor) -> None:
        """View done: NaN if no op touched it (floating; as init.py materialized it)."""
        if self.forget(view) and view.is_floating_point():
            view.fill_(float("nan"))

    def forget(self, view: torch.Tensor) -> bool:
        """Stop watching `view` (its value comes from elsewhere); True if it was untouched."""
        mine = self.views.get(view.untyped_storage().data_ptr(), {})
        return mine.pop(view.storage_offset(), None) is not None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.views:
            whole = None
            if func.overloadpacket in OVERWRITES and args and isinstance(args[0], torch.Tensor):
                whole = args[0]
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and not t.is_meta:
                    self._touch(t, t is whole)
        return func(*args, **kwargs)

    def _touch(self, t: torch.Tensor, overwrite: bool) -> None:
        mine = self.views.get(t.untyped_storage().data_ptr())
        if not mine:
            return
        a, b = _extent(t)
        for off in [o for o, v in mine.items() if o < b and a < o + v.numel()]:
            view = mine.pop(off)
            exact = overwrite and off == a and t.numel() == view.numel() and t.is_contiguous()
            if not exact and view.is_floating_point():
                view.fill_(float("nan"))
